"""KNN quality and answer-length estimates over labelled prompts (FAISS, exact inner product).

Each training prompt stores, per pool model, its quality score and answer
length. A query's raw estimate for a model is the weighted mean over its k
nearest neighbours with weights 1 / (1 - cos + 1e-6), normalised, as in the
paper. The budget filter (Eq. 2) prices each model's expected length.

Quality is then shrunk toward the model's prior (empirical Bayes). Ten
neighbours are little evidence when labels are noisy (0/1 correctness is
common): the argmax of raw neighbour means picks whichever model was luckiest
on them. With sigma2 the label noise within a neighbourhood, tau2 the spread
of true neighbourhood means and n_eff = 1 / sum(w^2) the evidence, the
estimate is

    mu + B (raw - mu),   B = tau2 / (tau2 + sigma2 / n_eff)

per model: a model's estimate leaves its prior only as far as the evidence
carries it. mu, sigma2 and tau2 are fitted on the training set itself, each
training prompt's neighbours found among the others (ShrinkagePrior.fit).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from gateway.artefacts import ArtefactError

K = 10
EPS = 1e-6
PROMPT_TOKENS = 85.0  # the paper's mean test prompt, for a training set built without prompt lengths
# The index is small (thousands of rows): OpenMP threads cost more than they
# save on a batch's search, and they would contend with onnxruntime's.
faiss.omp_set_num_threads(1)


@dataclass(frozen=True, slots=True)
class ShrinkagePrior:
    """Per model: prior mean quality, label noise within a neighbourhood, spread of neighbourhood means."""

    mean: np.ndarray  # (models,)
    noise_var: np.ndarray  # sigma2
    signal_var: np.ndarray  # tau2

    def shrink(self, raw: np.ndarray, n_eff: np.ndarray) -> np.ndarray:
        """(n, models) raw neighbour means, (n,) evidence -> shrunk estimates."""
        keep = self.signal_var / (self.signal_var + self.noise_var / n_eff[:, None])
        return self.mean + keep * (raw - self.mean)

    @classmethod
    def trusting(cls, mean: np.ndarray) -> ShrinkagePrior:
        """No shrinkage: every estimate is its raw neighbour mean."""
        return cls(mean, np.zeros_like(mean), np.ones_like(mean))

    @classmethod
    def fit(cls, index: faiss.Index, quality: np.ndarray, k: int, sample: int = 4000, seed: int = 0) -> ShrinkagePrior:
        """Method of moments on up to `sample` training prompts, each against its k nearest others."""
        n = index.ntotal
        mean = quality.mean(axis=0).astype(np.float64)
        if n <= k + 1:  # too few prompts to tell noise from signal: trust the neighbours as they are
            return cls.trusting(mean)
        rows = np.random.default_rng(seed).choice(n, size=min(sample, n), replace=False)
        queries = index.reconstruct_batch(rows)
        sims, idx = index.search(queries, k + 1)
        # Drop each prompt itself (or the first hit, when duplicates make another row come first).
        own = idx == rows[:, None]
        drop = np.where(own.any(axis=1), own.argmax(axis=1), 0)
        keep = np.ones_like(own)
        keep[np.arange(len(rows)), drop] = False
        sims, idx = sims[keep].reshape(len(rows), k), idx[keep].reshape(len(rows), k)
        w = neighbour_weights(sims)
        labels = quality[idx].astype(np.float64)  # (s, k, models)
        local = np.einsum("sk,skm->sm", w, labels)
        n_eff = 1.0 / (w**2).sum(axis=1)
        # Weighted within-neighbourhood variance, corrected for the weighted sample size. A neighbourhood
        # that one near-duplicate dominates (n_eff near 1) says nothing about the spread within it.
        within = np.einsum("sk,skm->sm", w, (labels - local[:, None, :]) ** 2)
        spread = n_eff > 1.5
        if not spread.any():
            return cls.trusting(mean)
        noise_var = (within[spread] * (n_eff[spread] / (n_eff[spread] - 1))[:, None]).mean(axis=0)
        signal_var = local.var(axis=0) - (noise_var[None, :] / n_eff[:, None]).mean(axis=0)
        floor = 1e-4 * quality.var(axis=0).astype(np.float64) + 1e-12  # no signal at all: nearly the prior
        return cls(mean, noise_var, np.maximum(signal_var, floor))


def neighbour_weights(sims: np.ndarray) -> np.ndarray:
    """The paper's weights 1 / (1 - cos + eps), normalised per query."""
    w = 1.0 / (1.0 - sims.astype(np.float64) + EPS)
    return w / w.sum(axis=1, keepdims=True)


@dataclass(frozen=True, slots=True)
class KnnEstimate:
    """Estimates for a batch of prompts: arrays of shape (n, models)."""

    models: tuple[str, ...]
    quality: np.ndarray  # shrunk toward each model's prior (raw neighbour means with shrink=False)
    length: np.ndarray  # expected answer tokens
    neighbours: np.ndarray  # (n, k) indices into the training set


class KnnEstimator:
    def __init__(self, index: faiss.Index, quality: np.ndarray, length: np.ndarray, models: tuple[str, ...],
                 k: int = K, prior: ShrinkagePrior | None = None, input_tokens: np.ndarray | None = None,
                 prompt_hashes: np.ndarray | None = None):
        """`input_tokens`: each training prompt's length (Avengers-Pro prices its clusters with them);
        without them every prompt counts PROMPT_TOKENS. `prompt_hashes`: each training prompt's SHA-256
        (gateway/learning/labels.py), so a refresh keeps a prompt out of the rows that test it ("" unknown)."""
        if quality.shape != length.shape or quality.shape != (index.ntotal, len(models)):
            raise ValueError(f"labels {quality.shape}/{length.shape} do not match index of "
                             f"{index.ntotal} x {len(models)} models")
        self.index = index
        self.quality = quality.astype(np.float32)
        self.length = length.astype(np.float32)
        self.models = tuple(models)
        self.k = min(k, index.ntotal)
        self.input_tokens = (np.full(index.ntotal, PROMPT_TOKENS, dtype=np.float32) if input_tokens is None
                             else np.asarray(input_tokens, dtype=np.float32))
        if self.input_tokens.shape != (index.ntotal,):
            raise ValueError(f"input_tokens {self.input_tokens.shape} do not match index of {index.ntotal}")
        self.prompt_hashes = (np.full(index.ntotal, "", dtype="<U64") if prompt_hashes is None
                              else np.asarray(prompt_hashes, dtype="<U64"))
        if self.prompt_hashes.shape != (index.ntotal,):
            raise ValueError(f"prompt_hashes {self.prompt_hashes.shape} do not match index of {index.ntotal}")
        self.prior = prior if prior is not None else ShrinkagePrior.fit(index, self.quality, self.k)
        if any(np.shape(v) != (len(models),) for v in (self.prior.mean, self.prior.noise_var, self.prior.signal_var)):
            raise ValueError(f"shrinkage prior does not match the {len(models)} models")

    @classmethod
    def build(cls, embeddings: np.ndarray, quality: np.ndarray, length: np.ndarray, models, k: int = K,
              input_tokens: np.ndarray | None = None, prompt_hashes: np.ndarray | None = None) -> KnnEstimator:
        index = faiss.IndexFlatIP(embeddings.shape[1])
        index.add(np.ascontiguousarray(embeddings, dtype=np.float32))
        return cls(index, quality, length, tuple(models), k, input_tokens=input_tokens, prompt_hashes=prompt_hashes)

    def estimate(self, embeddings: np.ndarray, shrink: bool = True) -> KnnEstimate:
        """One FAISS search for the whole batch; rows of `embeddings` must be L2-normalised.
        shrink=False gives the raw neighbour means (the paper's estimate; for comparison)."""
        n = len(embeddings)
        m = len(self.models)
        if n == 0:
            empty = np.zeros((0, m), dtype=np.float32)
            return KnnEstimate(self.models, empty, empty, np.zeros((0, self.k), dtype=np.int64))
        sims, idx = self.index.search(np.ascontiguousarray(embeddings, dtype=np.float32), self.k)
        w = neighbour_weights(sims)  # (n, k)
        raw = np.einsum("nk,nkm->nm", w, self.quality[idx])
        q = self.prior.shrink(raw, 1.0 / (w**2).sum(axis=1)) if shrink else raw
        mean_len = np.einsum("nk,nkm->nm", w, self.length[idx])
        return KnnEstimate(self.models, q, mean_len, idx)

    def save(self, directory: Path) -> dict[str, str]:
        directory.mkdir(parents=True, exist_ok=True)
        faiss.write_index(self.index, str(directory / "knn.faiss"))
        np.savez(directory / "knn_labels.npz", quality=self.quality, length=self.length, models=np.array(self.models),
                 prior_mean=self.prior.mean, prior_noise_var=self.prior.noise_var,
                 prior_signal_var=self.prior.signal_var, input_tokens=self.input_tokens,
                 prompt_hashes=self.prompt_hashes)
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
                prior = ShrinkagePrior(z["prior_mean"], z["prior_noise_var"], z["prior_signal_var"])
                input_tokens = z["input_tokens"]
                prompt_hashes = z["prompt_hashes"] if "prompt_hashes" in z else None
        except (OSError, ValueError, KeyError) as e:
            raise ArtefactError(f"{labels_path}: cannot read KNN labels: {e}") from None
        try:
            return cls(index, quality, length, models, k, prior, input_tokens, prompt_hashes)
        except ValueError as e:
            raise ArtefactError(f"{labels_path}: {e}") from None

