"""Avengers-Pro (Zhang et al. 2025) as a pipeline baseline: a per-cluster performance/cost ranking of the models.

The training prompts are clustered once (k-means over their embeddings, when
the policy is built); each cluster scores each model by

    p_w * normalised mean quality + (1 - p_w) * (1 - normalised mean cost),

both min-max normalised across the models within the cluster. A prompt's
cost for a model is what it would be billed: its input tokens x the model's
input price + the model's answer length x its output price, averaged over
the cluster's training prompts. A request takes the best-scoring model of
its nearest cluster among those it can use.

Input tokens of the training prompts come with the KNN estimator
(`knn.input_tokens`, one per training row, from the labelled records).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import LIGHT_COMPUTE_S, PolicyContext
from gateway.core.request import Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.pipeline.policy import entries
from gateway.policies.pipeline.routers import model_prices, models_of, priced_label_columns


@section
class AvengersOptions(Section):
    """[policies.avengers]: Avengers-Pro's performance weight, number of embedding clusters and k-means seed."""

    # p_w: 1 ranks the models by quality alone, 0 by cost alone (paper sweep: 0.25, 0.39, 0.53, 0.70, 0.80).
    performance_weight: float = option(0.53, ge=0, le=1)
    clusters: int = option(64, ge=1)
    seed: int = 0


class Avengers:
    """Each request to the best-scoring model of its nearest cluster (module docstring)."""

    name = "avengers"
    needs_estimates = True

    def __init__(self, knn, prices: Mapping[str, tuple[float, float]], performance_weight: float = 0.53,
                 clusters: int = 64, seed: int = 0):
        """`knn`: the KNN estimator (estimators/knn.py): its index of training embeddings and their labels.

        `prices`: model -> (USD per input token, USD per output token).
        """
        import faiss  # clustering is needed only to build this router
        # Only models with both labels and a price can be scored; the others are never picked.
        cols = priced_label_columns(knn.models, prices)
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
        price_in = np.array([prices[m][0] for m in self.models])
        price_out = np.array([prices[m][1] for m in self.models])
        billed = knn.input_tokens.astype(np.float64)[:, None] * price_in + knn.length[:, cols] * price_out
        self.cost = _cluster_sums(label, billed, k) / count  # (clusters, models) mean USD per prompt
        self.quality = quality
        self.scores = performance_weight * _min_max_rows(quality) + (1 - performance_weight) * (
            1 - _min_max_rows(self.cost))

    def route(self, batch: Sequence[RouteRequest], usable: Sequence[Sequence[int]], estimates: Estimates | None,
              view: PoolView) -> list[str | None]:
        if estimates is None or estimates.embeddings is None:
            raise ValueError("avengers needs the batch's prompt embeddings")
        if not len(batch):
            return []
        cluster = self._centroids.search(np.ascontiguousarray(estimates.embeddings, dtype=np.float32), 1)[1][:, 0]
        out: list[str | None] = []
        for r, cands in enumerate(usable):
            mine = models_of(cands, view)
            cols = [m for m, name in enumerate(self.models) if name in mine]
            # No labelled model among the candidates: no opinion, like passthrough.
            out.append(self.models[max(cols, key=lambda m: self.scores[cluster[r], m])] if cols else None)
        return out

    def compute_s(self, batch_size: int) -> float:
        return LIGHT_COMPUTE_S  # one centroid search per batch


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


def make_router(context: PolicyContext) -> Avengers:
    if context.estimators is None:
        raise ValueError("avengers needs the KNN estimator, which is not built: run `routebalance train`")
    knobs = context.options("avengers")
    return Avengers(context.estimators.knn, model_prices(context.config.instances), knobs.performance_weight,
                    knobs.clusters, knobs.seed)


OPTIONS = {"avengers": AvengersOptions}
ENTRIES = entries("avengers", make_router, "Avengers-Pro-style cluster ranking picks the model")
