"""ELDR's centroids: balanced k-means over prompt embeddings, one centroid per instance.

ELDR (papers/eldr-expert-locality-routing.txt, "Decode Clustering and
Routing") clusters calibration signatures offline into K groups, one per
decode instance, with Hungarian-balanced k-means: each centroid takes at most
ceil(N/K) of the N points, minimising the total cosine distance, so no
instance's region of the signature space is much more popular than another's.
Our signatures are the prompts' MiniLM embeddings (the gateway computes them
for every request already), not prefill expert activations.

Fitting: k-means++ seeding, then rounds of (assign every point to a centroid
slot, each centroid owning ceil(N/K) slots, by one linear assignment over the
N x K*ceil(N/K) cosine-distance matrix: scipy's Hungarian solver; move each
centroid to its points' normalised mean) until no point changes cluster.
Deterministic for a seed. The calibration points are a seeded sample of the
KNN index's training prompts (the labelled workload's embeddings).

Stored as `<models_dir>/eldr/centroids-k<K>-n<N>-s<seed>.npz`, with the
sha256 of the index they came from, so a rebuilt index refits them
(`routebalance train-policy eldr` fits those of a config's pool up front;
the policy fits missing ones on first use).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import linear_sum_assignment

log = logging.getLogger(__name__)
FORMAT = 1


def _unit(x: np.ndarray) -> np.ndarray:
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(norm, 1e-12)


def kmeans_plus_plus(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k seeds among the rows of x (unit vectors), each drawn in proportion to its cosine distance to the nearest
    seed so far (squared, as k-means++ weighs it)."""
    first = int(rng.integers(len(x)))
    seeds = [first]
    nearest = 1.0 - x @ x[first]
    for _ in range(1, k):
        weight = np.clip(nearest, 0, None) ** 2
        total = weight.sum()
        pick = int(rng.choice(len(x), p=weight / total)) if total > 0 else int(rng.integers(len(x)))
        seeds.append(pick)
        nearest = np.minimum(nearest, 1.0 - x @ x[pick])
    return x[seeds].copy()


def balanced_assignment(x: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """The cluster of each row of x minimising the total cosine distance with at most ceil(N/K) rows per
    cluster: a linear assignment of the rows to K*ceil(N/K) slots, ceil(N/K) per centroid."""
    n, k = len(x), len(centroids)
    cap = math.ceil(n / k)
    distance = 1.0 - x @ centroids.T  # (n, k)
    rows, slots = linear_sum_assignment(np.repeat(distance, cap, axis=1))
    labels = np.empty(n, dtype=np.int64)
    labels[rows] = slots // cap
    return labels


def balanced_kmeans(x: np.ndarray, k: int, *, seed: int = 0, max_rounds: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """(centroids (k, d) of unit length, labels (n,)) of Hungarian-balanced spherical k-means (module docstring)."""
    return _spherical_kmeans(x, k, balanced_assignment, seed, max_rounds)


def plain_kmeans(x: np.ndarray, k: int, *, seed: int = 0, max_rounds: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """(centroids, labels) of plain spherical k-means (Lloyd's: every point to its nearest centroid, no cap on
    a cluster's size), from the same k-means++ seeds: the paper's vanilla K-means, the baseline balancing
    is measured against."""
    return _spherical_kmeans(x, k, lambda points, centroids: (points @ centroids.T).argmax(axis=1), seed,
                             max_rounds)


def _spherical_kmeans(x: np.ndarray, k: int, assign, seed: int, max_rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Spherical k-means from k-means++ seeds: `assign(points, centroids)` labels the points, each centroid
    moves to its points' normalised mean (an empty one stays), until the labels repeat."""
    x = _unit(np.asarray(x, dtype=np.float64))
    if not 1 <= k <= len(x):
        raise ValueError(f"need 1 <= k <= points ({len(x)}), got k={k}")
    centroids = kmeans_plus_plus(x, k, np.random.default_rng(seed))
    labels = np.full(len(x), -1)
    for _ in range(max_rounds):
        new = assign(x, centroids)
        if np.array_equal(new, labels):
            break
        labels = new
        sums = np.zeros_like(centroids)
        np.add.at(sums, labels, x)
        centroids = np.where(np.linalg.norm(sums, axis=1, keepdims=True) > 0, _unit(sums), centroids)
    return centroids, labels


@dataclass(frozen=True)
class Centroids:
    """One fit: the centroids, how many calibration prompts each took, and what it was fitted from."""

    centroids: np.ndarray  # (k, d), unit rows
    sizes: np.ndarray  # (k,) calibration prompts per centroid
    calibration: int  # prompts fitted on
    seed: int
    source: str  # sha256 of the KNN index the embeddings came from

    @property
    def k(self) -> int:
        return len(self.centroids)


def calibration_sample(embeddings: np.ndarray, n: int, seed: int) -> np.ndarray:
    """Row indices of a seeded sample of n training prompts (all of them if there are no more)."""
    if n >= len(embeddings):
        return np.arange(len(embeddings))
    return np.sort(np.random.default_rng(seed).choice(len(embeddings), size=n, replace=False))


def fit(embeddings: np.ndarray, k: int, calibration: int = 2000, seed: int = 0, source: str = "") -> Centroids:
    """Balanced k-means centroids of a seeded calibration sample of the training prompts' embeddings."""
    rows = calibration_sample(embeddings, calibration, seed)
    centroids, labels = balanced_kmeans(embeddings[rows], k, seed=seed)
    return Centroids(centroids.astype(np.float32), np.bincount(labels, minlength=k), len(rows), seed, source)


def path_for(models_dir: Path, k: int, calibration: int, seed: int) -> Path:
    return Path(models_dir) / "eldr" / f"centroids-k{k}-n{calibration}-s{seed}.npz"


def save(fitted: Centroids, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, centroids=fitted.centroids, sizes=fitted.sizes, calibration=fitted.calibration, seed=fitted.seed,
             source=np.array(fitted.source), format=FORMAT)
    tmp.replace(path)  # atomic: sweep workers may fit the same file at once
    return path


def load(path: Path, source: str) -> Centroids | None:
    """The stored fit, or None if there is none, it is unreadable, or it came from another index."""
    try:
        with np.load(path, allow_pickle=False) as z:
            if int(z["format"]) != FORMAT or str(z["source"]) != source:
                return None
            return Centroids(z["centroids"], z["sizes"], int(z["calibration"]), int(z["seed"]), source)
    except (OSError, ValueError, KeyError):
        return None


def load_or_fit(models_dir: Path | None, embeddings, k: int, calibration: int, seed: int, source: str) -> Centroids:
    """The stored centroids for (k, calibration, seed) from this index, or a new fit (stored if there is a
    models_dir). `embeddings` is called only when a fit is needed (it returns the training embeddings)."""
    path = path_for(models_dir, k, calibration, seed) if models_dir is not None else None
    if path is not None:
        found = load(path, source)
        if found is not None:
            return found
    log.info("fitting ELDR's %d centroids (balanced k-means over %d training prompts)", k, calibration)
    fitted = fit(embeddings(), k, calibration, seed, source)
    if path is not None:
        try:
            save(fitted, path)
        except OSError as e:  # a read-only models dir: serve from memory
            log.warning("could not store the ELDR centroids in %s: %s", path, e)
    return fitted
