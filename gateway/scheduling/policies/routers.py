"""Pipeline-mode model routers: one model name per request (None: no preference).

A router sees each request's usable candidate instances and answers with the
model of one of them, never a model the request cannot use, so the dispatcher
always has an instance to place it on. Estimates come in per instance column;
a model's prediction is the value at any of its instances.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

import numpy as np

from gateway.scheduling.request import Estimates, RouteRequest
from gateway.scheduling.view import PoolView


class Router(Protocol):
    name: str
    needs_estimates: bool

    def route(self, batch: Sequence[RouteRequest], usable: Sequence[Sequence[int]], estimates: Estimates | None,
              view: PoolView) -> list[str | None]:
        """One model (or None) per request; `usable[r]` are request r's usable candidate instances."""
        ...


class Passthrough:
    """No model choice: the dispatcher works over all of the request's candidates."""

    name = "passthrough"
    needs_estimates = False

    def route(self, batch, usable, estimates, view) -> list[str | None]:
        return [None] * len(batch)


class Avengers:
    """Avengers-Pro (Zhang et al. 2025): a per-cluster performance/cost ranking of the models.

    The training prompts are clustered once; each cluster scores each model by
    p_w * normalised mean quality + (1 - p_w) * (1 - normalised mean cost),
    both min-max normalised across the models within the cluster. A request
    takes the best-scoring model of its nearest cluster among those it can
    use. Cost is the mean answer length times the model's output price: the
    input side is the same prompt for every model, so it cannot rank them
    (a difference in input prices is ignored, as in the original).
    """

    name = "avengers"
    needs_estimates = True

    def __init__(self, knn, prices_out: Mapping[str, float], performance_weight: float = 0.7,
                 clusters: int = 64, seed: int = 0):
        """`knn`: the KNN estimator (estimators/knn.py): its index of training embeddings and their labels."""
        import faiss  # clustering is needed only to build this router
        # Only models with both labels and a price can be scored; the others are never picked.
        cols = [m for m, name in enumerate(knn.models) if name in prices_out]
        self.models = tuple(knn.models[m] for m in cols)
        x = knn.index.reconstruct_n(0, knn.index.ntotal)
        k = min(clusters, len(x))
        # min_points_per_centroid=1: small label sets are expected (tests, tiny pools), not worth a warning.
        kmeans = faiss.Kmeans(x.shape[1], k, niter=20, seed=seed, min_points_per_centroid=1)
        kmeans.train(x)
        self._centroids = kmeans.index  # exact L2 over the centroids
        label = self._centroids.search(x, 1)[1][:, 0]
        count = np.maximum(np.bincount(label, minlength=k), 1)[:, None]  # an empty cluster scores all models alike
        quality = _cluster_sums(label, knn.quality[:, cols], k) / count
        price = np.array([prices_out[m] for m in self.models])
        cost = _cluster_sums(label, knn.length[:, cols], k) / count * price
        self.scores = performance_weight * _min_max_rows(quality) + (1 - performance_weight) * (1 - _min_max_rows(cost))

    def route(self, batch, usable, estimates, view) -> list[str | None]:
        if estimates is None or estimates.embeddings is None:
            raise ValueError("avengers needs the batch's prompt embeddings")
        cluster = self._centroids.search(np.ascontiguousarray(estimates.embeddings, dtype=np.float32), 1)[1][:, 0]
        out: list[str | None] = []
        for r, cands in enumerate(usable):
            mine = {view.instances[i].model for i in cands}
            cols = [m for m, name in enumerate(self.models) if name in mine]
            # No labelled model among the candidates: no opinion, like passthrough.
            out.append(self.models[max(cols, key=lambda m: self.scores[cluster[r], m])] if cols else None)
        return out


class BestRoute:
    """BEST-Route (Ding et al. 2025): the cheapest model predicted within `threshold` of the best quality.

    Threshold 0 always takes the predicted-best model; a threshold past the
    quality range always takes the cheapest.
    """

    name = "best_route"
    needs_estimates = True

    def __init__(self, threshold: float = 0.02):
        self.threshold = threshold

    def route(self, batch, usable, estimates, view) -> list[str | None]:
        if estimates is None:
            raise ValueError("best_route needs the batch's estimates")
        out: list[str | None] = []
        for r, cands in enumerate(usable):
            q = estimates.quality[r]
            floor = max(q[i] for i in cands) - self.threshold
            good = [i for i in cands if q[i] >= floor]
            # Cheapest by output then input price; among equally priced, the better prediction.
            best = min(good, key=lambda i: (view.price_out[i], view.price_in[i], -q[i], i))
            out.append(view.instances[best].model)
        return out


def _cluster_sums(label: np.ndarray, values: np.ndarray, k: int) -> np.ndarray:
    """(k, models) sums of `values` rows by cluster."""
    sums = np.zeros((k, values.shape[1]))
    np.add.at(sums, label, values)
    return sums


def _min_max_rows(x: np.ndarray) -> np.ndarray:
    """Min-max normalise each row; a row with one value throughout becomes 0."""
    lo = x.min(axis=1, keepdims=True)
    span = x.max(axis=1, keepdims=True) - lo
    return np.divide(x - lo, span, out=np.zeros_like(x), where=span > 0)
