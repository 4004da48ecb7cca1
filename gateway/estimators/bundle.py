"""The estimators the scheduler uses at run time, loaded from a built models/ directory."""

from __future__ import annotations

import logging
from collections.abc import Sequence
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
from gateway.estimators.refit import TrafficFit, load_traffic_fit
from gateway.policies.eldr import centroids
from gateway.policies.qos.actor import QosActor

log = logging.getLogger(__name__)


class Estimators:
    """The embedder, the KNN index (the paper's estimate, and what the pipeline policies and ELDR read), and
    the quality and length estimates `train` chose on the user's labels (estimators/crossfit.py): the KNN's
    own, or learned heads (estimators/heads.py) in their place. A refresh (serving/refresh.py) adds what
    traffic taught (estimators/refit.py): corrections of the built estimates, and heads for models the built
    labels do not cover. `version` names the estimators that routed an answer (the manifest's, counting
    refreshes)."""

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
        self.version = int(manifest.get("version", 1))
        self.traffic_fit: TrafficFit | None = None  # a refresh's; None as built
        # model -> (traffic quality labels, their summed score) for models estimated by no head or index: the
        # posterior that exploration draws from (set by a refresh; empty until the first).
        self.traffic_labels: dict[str, tuple[int, float]] = {}
        self.models_dir = models_dir  # where fitted extras (ELDR's centroids) are kept; None: in memory only
        self._warned: list[str] = []
        self._centroids: dict[tuple[int, int, int], np.ndarray] = {}
        self._label_means: tuple[np.ndarray, np.ndarray] | None = None  # `priors`' source, taken on first use

    @classmethod
    def load(cls, config, models_dir: Path | None = None) -> Estimators:
        """Raises ArtefactError naming the file if anything is missing, corrupt or of another build
        (another manifest format or other package versions: `routebalance train` rebuilds them)."""
        models_dir = Path(models_dir or config.estimators.models_dir)
        manifest = read_manifest(models_dir)
        verify(models_dir, manifest)
        check_versions(models_dir, manifest)
        est = config.estimators
        built = manifest["embedder"]
        built_as = (built.get("max_tokens", est.max_tokens), built.get("precision", "fp32"))
        if built_as != (est.max_tokens, est.precision):
            # the index holds embeddings made one way; prompts embedded another way would find wrong neighbours
            raise ArtefactError(f"{models_dir}: built with the embedder at max_tokens {built_as[0]}, precision "
                                f"{built_as[1]}; [estimators] asks for max_tokens {est.max_tokens}, precision "
                                f"{est.precision}: run `routebalance train` to rebuild")
        embedder = Embedder(models_dir / built["onnx"], default_tokenizer_path(),
                            max_tokens=est.max_tokens, threads=est.threads, batch_size=est.batch_size,
                            cache_entries=est.embed_cache_entries)
        chosen = manifest["knn"]
        knn = KnnEstimator.load(models_dir, chosen, k=chosen.get("k", K))
        quality_head = length_head = traffic_fit = None
        if "refreshed" in manifest:
            traffic_fit = load_traffic_fit(models_dir / manifest["refreshed"]["file"])
        if "learned" in manifest:
            quality_head, length_head = load_heads(models_dir / manifest["learned"]["file"])
            for head in (quality_head, length_head):
                if head is not None and head.features != knn.index.d:
                    raise ArtefactError(f"{models_dir / manifest['learned']['file']}: heads on {head.features} "
                                        f"features, the index embeds in {knn.index.d}")
        reported = manifest.get("report", {}).get("heads", {})
        heads = LatencyHeads.load(models_dir, {tier: h["file"] for tier, h in manifest["heads"].items()},
                                  {tier: h["tpot_prior_ms"] / 1000 for tier, h in manifest["heads"].items()},
                                  {tier: r["head_mape"] for tier, r in reported.items() if "head_mape" in r})
        headless = sorted({tier_key(i.model, i.gpu) for i in config.instances} - manifest["heads"].keys())
        if headless:
            log.warning("no TPOT head for %s in %s: priced with their tpot_prior_ms until `routebalance train "
                        "--if-stale` fits them (seconds)", ", ".join(headless), models_dir)
        out = cls(embedder, knn, heads, manifest, models_dir, quality_head, length_head,
                  shrink=chosen.get("shrink", True))
        out.traffic_fit = traffic_fit
        running = [v for v in manifest.get("versions", []) if v["version"] == out.version]
        if running and running[0].get("traffic"):  # a refreshed version: what exploration has learned so far
            out.traffic_labels = {m: (int(n), float(score)) for m, (n, score) in running[0]["traffic"].items()}
        return out

    def refreshed(self, traffic_fit: TrafficFit | None, manifest: dict,
                  traffic_labels: dict[str, tuple[int, float]] | None = None) -> Estimators:
        """The same built estimators with another refresh on top (None: as built), for the caller to swap in."""
        out = Estimators(self.embedder, self.knn, self.heads, manifest, self.models_dir, self.quality_head,
                         self.length_head, self.shrink)
        out.traffic_fit = traffic_fit
        out.traffic_labels = dict(traffic_labels or {})
        out._centroids = self._centroids
        return out

    def unlabelled(self, instances) -> dict[str, tuple[int, float]]:
        """The pool's models without a quality estimate of their own, each with its traffic labels so far."""
        known = set(self.knn.models) | set(self.traffic_fit.headed if self.traffic_fit is not None else ())
        return {i.model: self.traffic_labels.get(i.model, (0, 0.0)) for i in instances if i.model not in known}

    @property
    def models(self) -> tuple[str, ...]:
        """The models estimated: the index's, then any a refresh adds."""
        extra = self.traffic_fit.models if self.traffic_fit is not None else ()
        return self.knn.models + tuple(m for m in extra if m not in self.knn.models)

    def built_estimate(self, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(quality, length) over the index's models as `train` built them (no refresh)."""
        return self._built(self.knn.estimate(embeddings, shrink=self.shrink), embeddings)

    def _built(self, est: KnnEstimate, embeddings: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        quality = self.quality_head.predict(embeddings) if self.quality_head is not None else est.quality
        length = self.length_head.predict(embeddings) if self.length_head is not None else est.length
        return quality, length

    def estimate_embedded(self, embeddings: np.ndarray) -> KnnEstimate:
        """Quality and length per model for embedded prompts: as built, then what a refresh added (NaN for a
        model a refresh knows only partly)."""
        est = self.knn.estimate(embeddings, shrink=self.shrink)
        built_q, built_l = self._built(est, embeddings)
        models = self.models
        quality, length = _widened(built_q, len(models)), _widened(built_l, len(models))
        if self.traffic_fit is not None:
            self.traffic_fit.apply(embeddings, models, quality, length)
        return KnnEstimate(models, quality, length, est.neighbours)

    def estimate(self, prompts: list[str]) -> KnnEstimate:
        """Quality and length per pool model for a batch: one embed call, one FAISS search."""
        return self.estimate_embedded(self.embedder.embed(prompts))

    def for_instances(self, prompts: list[str], instances, blind: Sequence[bool] | None = None) -> Estimates:
        """Estimates with one column per instance (its model's prediction). A prompt marked `blind` is not
        embedded: its row is the instances' priors (`priors`), its embedding zeros.

        A model the labels do not cover is routable on a pessimistic prior: its
        quality is the lowest of the labelled models' for that prompt (an unknown
        model has not earned better), its length their mean. Exploration
        (serving/explore.py) tries it on a bounded share of requests, and its
        labels from traffic give it its own estimate at a refresh.
        """
        if blind is None or not any(blind):
            return self.for_embedded(self.embedder.embed(prompts), instances)
        seen = [k for k, b in enumerate(blind) if not b]
        quality, length = self.priors(instances)
        out = Estimates(np.tile(quality, (len(prompts), 1)), np.tile(length, (len(prompts), 1)),
                        np.zeros((len(prompts), self.embedder.dim), np.float32))
        if seen:
            est = self.for_embedded(self.embedder.embed([prompts[k] for k in seen]), instances)
            out.quality[seen], out.length[seen] = est.quality, est.length
            out.embeddings[seen] = est.embeddings
        return out

    def priors(self, instances) -> tuple[np.ndarray, np.ndarray]:
        """Per instance, what its model is expected to do on a prompt not looked at: the index's prior mean
        quality and mean answer length over the labels (a model they do not cover: the lowest quality and the
        mean length of those they do, as in `for_embedded`)."""
        column = {m: j for j, m in enumerate(self.knn.models)}
        if self._label_means is None:  # the labels of a version never change: their means are taken once
            self._label_means = (self.knn.prior.mean.astype(np.float64),
                                 self.knn.length.mean(axis=0).astype(np.float64))
        mean_q, mean_len = self._label_means
        quality = np.array([mean_q[column[i.model]] if i.model in column else mean_q.min() for i in instances])
        length = np.array([mean_len[column[i.model]] if i.model in column else mean_len.mean() for i in instances])
        return quality, length

    def for_embedded(self, embeddings: np.ndarray, instances) -> Estimates:
        """`for_instances` of prompts already embedded."""
        est = self.estimate_embedded(embeddings)
        column = {m: j for j, m in enumerate(est.models)}
        missing = sorted({i.model for i in instances} - column.keys())
        if missing and missing != self._warned:
            log.warning("no quality/length labels for %s: routed on the lowest labelled quality (explored on a bounded "
                        "share of requests) until a refresh gives it its own estimate", ", ".join(missing))
            self._warned = missing
        labelled = len(self.knn.models)  # the index labels every prompt for these: the stand-in's source
        low_q, mean_len = est.quality[:, :labelled].min(axis=1), est.length[:, :labelled].mean(axis=1)
        est = KnnEstimate(est.models, _filled(est.quality, low_q), _filled(est.length, mean_len), est.neighbours)
        quality = np.column_stack([est.quality[:, column[i.model]] if i.model in column else low_q for i in instances])
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


def _widened(a: np.ndarray, columns: int) -> np.ndarray:
    """`a` with NaN columns added up to `columns` (a copy: the heads write into it)."""
    out = np.full((a.shape[0], columns), np.nan, dtype=np.float32)
    out[:, :a.shape[1]] = a
    return out


def _filled(a: np.ndarray, stand_in: np.ndarray) -> np.ndarray:
    """NaN entries of `a` (n, m) replaced by the row's stand-in (n,)."""
    gaps = np.isnan(a)
    return np.where(gaps, stand_in[:, None], a) if gaps.any() else a
