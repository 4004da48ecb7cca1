"""The estimators the scheduler uses at run time, loaded from a built models/ directory."""

from __future__ import annotations

from pathlib import Path

from gateway.estimators.build import read_manifest, verify
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.knn import KnnEstimate, KnnEstimator
from gateway.estimators.latency import LatencyHeads


class Estimators:
    def __init__(self, embedder: Embedder, knn: KnnEstimator, heads: LatencyHeads, manifest: dict):
        self.embedder = embedder
        self.knn = knn
        self.heads = heads
        self.manifest = manifest

    @classmethod
    def load(cls, config, models_dir: Path | None = None) -> Estimators:
        """Raises ArtefactError naming the file if anything is missing, corrupt or of another build."""
        models_dir = Path(models_dir or config.estimators.models_dir)
        manifest = read_manifest(models_dir)
        verify(models_dir, manifest)
        est = config.estimators
        embedder = Embedder(models_dir / manifest["embedder"]["onnx"], default_tokenizer_path(),
                            max_tokens=est.max_tokens, threads=est.threads, batch_size=est.batch_size)
        knn = KnnEstimator.load(models_dir, manifest["knn"])
        heads = LatencyHeads.load(models_dir, manifest["heads"]["files"], manifest["heads"]["priors_s"])
        return cls(embedder, knn, heads, manifest)

    def estimate(self, prompts: list[str]) -> KnnEstimate:
        """Quality and length per pool model for a batch: one embed call, one FAISS search."""
        return self.knn.estimate(self.embedder.embed(prompts))
