"""KNN quality and answer-length estimates over labelled prompts (FAISS, exact inner product).

Each training prompt stores, per pool model, its quality score and answer
length. A query's estimate for a model is the weighted mean over its k
nearest neighbours with weights 1 / (1 - cos + 1e-6), normalised, as in the
paper. The budget filter (Eq. 2) prices each model's expected length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from gateway.estimators import ArtefactError

K = 10
EPS = 1e-6
# The index is small (thousands of rows): OpenMP threads cost more than they
# save on a batch's search, and they would contend with onnxruntime's.
faiss.omp_set_num_threads(1)


@dataclass(frozen=True, slots=True)
class KnnEstimate:
    """Estimates for a batch of prompts: arrays of shape (n, models)."""

    models: tuple[str, ...]
    quality: np.ndarray
    length: np.ndarray  # expected answer tokens
    neighbours: np.ndarray  # (n, k) indices into the training set


class KnnEstimator:
    def __init__(self, index: faiss.Index, quality: np.ndarray, length: np.ndarray, models: tuple[str, ...],
                 k: int = K):
        if quality.shape != length.shape or quality.shape != (index.ntotal, len(models)):
            raise ValueError(f"labels {quality.shape}/{length.shape} do not match index of "
                             f"{index.ntotal} x {len(models)} models")
        self.index = index
        self.quality = quality.astype(np.float32)
        self.length = length.astype(np.float32)
        self.models = tuple(models)
        self.k = min(k, index.ntotal)

    @classmethod
    def build(cls, embeddings: np.ndarray, quality: np.ndarray, length: np.ndarray, models, k: int = K) -> KnnEstimator:
        index = faiss.IndexFlatIP(embeddings.shape[1])
        index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
        return cls(index, quality, length, tuple(models), k)

    def estimate(self, embeddings: np.ndarray) -> KnnEstimate:
        """One FAISS search for the whole batch; rows of `embeddings` must be L2-normalised."""
        n = len(embeddings)
        m = len(self.models)
        if n == 0:
            empty = np.zeros((0, m), dtype=np.float32)
            return KnnEstimate(self.models, empty, empty, np.zeros((0, self.k), dtype=np.int64))
        sims, idx = self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), self.k)
        w = 1.0 / (1.0 - sims + EPS)
        w /= w.sum(axis=1, keepdims=True)  # (n, k)
        q = np.einsum("nk,nkm->nm", w, self.quality[idx])
        mean_len = np.einsum("nk,nkm->nm", w, self.length[idx])
        return KnnEstimate(self.models, q, mean_len, idx)

    def save(self, directory: Path) -> dict[str, str]:
        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(directory / "knn.faiss"))
        np.savez(directory / "knn_labels.npz", quality=self.quality, length=self.length, models=np.array(self.models))
        return {"index": "knn.faiss", "labels": "knn_labels.npz"}

    @classmethod
    def load(cls, directory: Path, files: dict[str, str], k: int = K) -> KnnEstimator:
        index_path, labels_path = directory / files["index"], directory / files["labels"]
        try:
            index = faiss.read_index(str(index_path))
        except RuntimeError as e:
            raise ArtefactError(f"{index_path}: cannot read FAISS index: {str(e).splitlines()[0][:200]}") from None
        try:
            with np.load(labels_path, allow_pickle=False) as z:
                quality, length, models = z["quality"], z["length"], tuple(str(m) for m in z["models"])
        except (OSError, ValueError, KeyError) as e:
            raise ArtefactError(f"{labels_path}: cannot read KNN labels: {e}") from None
        try:
            return cls(index, quality, length, models, k)
        except ValueError as e:
            raise ArtefactError(f"{labels_path}: {e}") from None

