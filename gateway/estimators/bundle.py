"""The estimators the scheduler uses at run time, loaded from a built models/ directory."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from gateway.artefacts import ArtefactError
from gateway.core.request import Estimates
from gateway.core.view import tier_key
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.heads import LengthHeads, QualityHeads, load_heads
from gateway.estimators.knn import K, KnnEstimate, KnnEstimator
from gateway.estimators.latency import LatencyHeads
from gateway.estimators.manifest import check_versions, read_manifest, verify
from gateway.policies.eldr import centroids
from gateway.policies.qos.actor import QosActor

log = logging.getLogger(__name__)


class Estimators:
    """The embedder, the KNN index (the paper's estimate, and what the pipeline policies and ELDR read), and
    the quality and length estimates `train` chose on the user's labels (estimators/crossfit.py): the KNN's
    own, or learned heads (estimators/heads.py) in their place."""

    def __init__(self, embedder: Embedder, knn: KnnEstimator, heads: LatencyHeads, manifest: dict,
                 models_dir: Path | None = None, quality_head: QualityHeads | None = None,
                 length_head: LengthHeads | None = None, shrink: bool = True):
        self.embedder = embedder
        self.knn = knn
        self.heads = heads
        self.quality_head = quality_head
        self.length_head = length_head
        self.shrink = shrink
        self.manifest = manifest
        self.models_dir = models_dir  # where fitted extras (ELDR's centroids) are kept; None: in memory only
        self._warned: list[str] = []
        self._centroids: dict[tuple[int, int, int], np.ndarray] = {}

    @classmethod
    def load(cls, config, models_dir: Path | None = None) -> Estimators:
        """Raises ArtefactError naming the file if anything is missing, corrupt or of another build
        (another manifest format or other package versions: `routebalance train` rebuilds them)."""
        models_dir = Path(models_dir or config.estimators.models_dir)
        manifest = read_manifest(models_dir)
        verify(models_dir, manifest)
        check_versions(models_dir, manifest)
        est = config.estimators
        embedder = Embedder(models_dir / manifest["embedder"]["onnx"], default_tokenizer_path(),
                            max_tokens=est.max_tokens, threads=est.threads, batch_size=est.batch_size,
                            cache_entries=est.embed_cache_entries)
        chosen = manifest["knn"]
        knn = KnnEstimator.load(models_dir, chosen, k=chosen.get("k", K))
        quality_head = length_head = None
        if "learned" in manifest:
            quality_head, length_head = load_heads(models_dir / manifest["learned"]["file"])
            for head in (quality_head, length_head):
                if head is not None and head.models != knn.models:
                    raise ArtefactError(f"{models_dir / manifest['learned']['file']}: heads for {head.models}, "
                                        f"the index labels {knn.models}")
        heads = LatencyHeads.load(models_dir, {tier: h["file"] for tier, h in manifest["heads"].items()},
                                  {tier: h["tpot_prior_ms"] / 1000 for tier, h in manifest["heads"].items()})
        headless = sorted({tier_key(i.model, i.gpu) for i in config.instances} - manifest["heads"].keys())
        if headless:
            log.warning("no TPOT head for %s in %s: priced with their tpot_prior_ms until `routebalance train "
                        "--if-stale` fits them (seconds)", ", ".join(headless), models_dir)
        return cls(embedder, knn, heads, manifest, models_dir, quality_head, length_head,
                   shrink=chosen.get("shrink", True))

    def estimate_embedded(self, embeddings: np.ndarray) -> KnnEstimate:
        """Quality and length per labelled model for embedded prompts, from the chosen estimators."""
        est = self.knn.estimate(embeddings, shrink=self.shrink)
        quality = self.quality_head.predict(embeddings) if self.quality_head is not None else est.quality
        length = self.length_head.predict(embeddings) if self.length_head is not None else est.length
        return KnnEstimate(est.models, quality, length, est.neighbours)

    def estimate(self, prompts: list[str]) -> KnnEstimate:
        """Quality and length per pool model for a batch: one embed call, one FAISS search."""
        return self.estimate_embedded(self.embedder.embed(prompts))

    def for_instances(self, prompts: list[str], instances) -> Estimates:
        """Estimates with one column per instance (its model's prediction).

        A model the labels do not cover gets the mean over the labelled models
        (a prompt-blind stand-in), so a pool model added without retraining is
        still routable; retrain to give it its own labels.
        """
        embeddings = self.embedder.embed(prompts)
        est = self.estimate_embedded(embeddings)
        column = {m: j for j, m in enumerate(est.models)}
        missing = sorted({i.model for i in instances} - column.keys())
        if missing and missing != self._warned:
            log.warning("no quality/length labels for %s: using the mean over the labelled models", ", ".join(missing))
            self._warned = missing
        mean_q, mean_len = est.quality.mean(axis=1), est.length.mean(axis=1)
        quality = np.column_stack([est.quality[:, column[i.model]] if i.model in column else mean_q for i in instances])
        length = np.column_stack([est.length[:, column[i.model]] if i.model in column else mean_len for i in instances])
        return Estimates(quality, length, embeddings)

    def eldr_centroids(self, k: int, calibration: int, seed: int) -> np.ndarray:
        """(k, d) unit centroids of the training prompts' embeddings by balanced k-means (ELDR's, one per
        instance): stored under models/eldr/ (fitted there first if missing or from another index)."""
        key = (k, calibration, seed)
        if key not in self._centroids:
            index = self.knn.index
            source = self.manifest.get("files", {}).get(self.manifest.get("knn", {}).get("index", ""), "")
            fitted = centroids.load_or_fit(self.models_dir, lambda: index.reconstruct_n(0, index.ntotal), k,
                                           calibration, seed, source)
            self._centroids[key] = fitted.centroids
        return self._centroids[key]

    @staticmethod
    def qos_actor(path: str | Path) -> QosActor:
        """The qos-rl policy's ONNX actor (the core cannot import onnxruntime, so its policy asks here)."""
        return QosActor(path)
