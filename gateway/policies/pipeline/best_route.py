"""BEST-Route (Ding et al. 2025) as a pipeline baseline: a learned scorer says when a cheaper model will do.

In the paper BEST-Route is its own learned scorer (a DeBERTa-v3 checkpoint),
fit on the same labels as the KNN estimator; it is not the KNN. Here the
scorer is a small classifier over the MiniLM prompt embedding the gateway
computes anyway, trained on the KNN's training set when the policy is built:
for each model cheaper than the reference (the most expensive by output
price) it predicts

    p_m = P(model m's answer falls short: q_m < q_ref - margin)

and a request goes to the cheapest model (by output, then input price) with
p_m <= threshold, else to the reference. Threshold 0 sends (almost)
everything to the reference; a high threshold floods the cheapest model.

Scoring cost. The paper deployed the scorer two ways, with identical routing:
serial, one forward per prompt through a single scorer (the published
pattern: a queue that collapses under load), and concurrent, the forwards of
a batch running in parallel in a thread pool (the paper's "enhanced"
variant). `compute_s` charges the simulated scheduler worker batch_size x
forward_ms or one forward_ms per batch; the live scheduler does not wait for
it (the classifier itself costs microseconds).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import PolicyContext
from gateway.core.request import Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.pipeline.policy import entries
from gateway.policies.pipeline.routers import model_prices, models_of, priced_label_columns


@section
class BestRouteOptions(Section):
    """[policies.best_route]: BEST-Route's routing threshold, label margin, scoring deployment and seed."""

    # A cheaper model is taken when its predicted shortfall probability is <= threshold (paper sweep:
    # 0, 0.3, 0.5, 0.6, 0.7, 0.8).
    threshold: float = option(0.5, ge=0, le=1)
    # A cheaper model "falls short" when its quality is below the reference's minus this. At 0 the threshold
    # reads as the probability that the cheaper model scores worse than the reference (0.5: even odds); a
    # margin mostly shifts every probability down alike (0.02 lowers them by ~0.03), which the sweep spans.
    margin: float = option(0.0, ge=0, le=1)
    # "concurrent": a batch's forwards run in parallel (one forward_ms per batch); "serial": one scorer,
    # one forward per prompt (batch_size x forward_ms). Charged by the simulator only.
    scoring: Literal["concurrent", "serial"] = "concurrent"
    # 55 ms: with the ~11 ms per prompt the simulator already charges for the MiniLM embedding the scorer
    # reads, a serial scorer serves ~15 prompts/s: it holds at 12 req/s and collapses from 18, and replays
    # the paper's serial residuals (measured: 42 s at 24 req/s, 57 s at 30; paper 49.5 s E2E at 24, 57.9 s
    # residual at 30). The paper's 431 ms is one single-threaded forward, not the deployed scorer's rate.
    forward_ms: float = option(55.0, ge=0)
    seed: int = 0  # the classifier's validation split


# L2 strengths tried on a held-out fifth of the training set; the best by log loss is refit on all of it.
L2_GRID = (1.0, 3.0, 10.0, 30.0, 100.0)
VALIDATION_SHARE = 0.2
MIN_VALIDATION = 20  # fewer held-out rows than this: no selection, the middle strength
MAX_STEPS = 200
TOLERANCE = 1e-5  # stop when no weight moves more than this (float32 data: steps bottom out near 1e-6)


@dataclass(frozen=True, slots=True)
class ShortfallClassifier:
    """Per cheaper model, P(its answer falls short of the reference's) from the prompt embedding.

    One L2-regularised logistic regression per cheaper model over the centred
    embedding (plus an unpenalised bias), all fit together by Boehning's
    quadratic-bound Newton iteration: the Hessian of the log loss is bounded
    by X'X / 4 (+ the L2 term), so that one matrix, inverted once, serves
    every step and every model, and each step only multiplies the data by
    the weights (monotone; a few dozen steps from the base rates).
    """

    models: tuple[str, ...]  # the cheaper models, one column each, cheapest first
    reference: str
    centre: np.ndarray  # (d,) mean training embedding
    weights: np.ndarray  # (d + 1, len(models)), the bias last
    l2: float  # the L2 strength the validation split chose

    @classmethod
    def fit(cls, x: np.ndarray, quality: np.ndarray, label_models: Sequence[str],
            prices: Mapping[str, tuple[float, float]], margin: float = 0.0, seed: int = 0) -> ShortfallClassifier:
        """Train on embeddings x (n, d) and raw quality labels (n, len(label_models)).

        Only labelled models with a price take part; ValueError if there are none.
        """
        cols = priced_label_columns(label_models, prices)
        if not cols:
            raise ValueError("best_route: no model of the pool has quality labels")
        by_price = sorted(cols, key=lambda m: (prices[label_models[m]][1], prices[label_models[m]][0]))
        ref, cheaper = by_price[-1], by_price[:-1]
        y = (quality[:, cheaper] < quality[:, [ref]] - margin).astype(np.float64)
        x = np.asarray(x, dtype=np.float32)
        centre = x.mean(axis=0)
        a = np.hstack([x - centre, np.ones((len(x), 1), dtype=np.float32)])
        gram = _gram(a)
        l2 = L2_GRID[len(L2_GRID) // 2]
        rng = np.random.default_rng(seed)
        held = rng.random(len(a)) < VALIDATION_SHARE
        if cheaper and MIN_VALIDATION <= held.sum() <= len(a) - MIN_VALIDATION:
            fit_gram = gram - _gram(a[held])
            losses = [_log_loss(_predict(a[held], _fit(a[~held], y[~held], fit_gram, lam)), y[held])
                      for lam in L2_GRID]
            l2 = L2_GRID[int(np.argmin(losses))]
        weights = _fit(a, y, gram, l2)
        return cls(tuple(label_models[m] for m in cheaper), label_models[ref], centre, weights, l2)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """(n, len(models)) shortfall probabilities for embeddings x (n, d)."""
        x = np.asarray(x, dtype=np.float32)
        a = np.hstack([x - self.centre, np.ones((len(x), 1), dtype=np.float32)])
        return _predict(a, self.weights)


def _gram(a: np.ndarray) -> np.ndarray:
    return (a.T @ a).astype(np.float64)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow warnings for large |z|


def _predict(a: np.ndarray, w: np.ndarray) -> np.ndarray:
    return _sigmoid(a @ w.astype(np.float32)).astype(np.float64)


def _log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def _fit(a: np.ndarray, y: np.ndarray, gram: np.ndarray, l2: float) -> np.ndarray:
    """Logistic regression weights (d + 1, k) for rows a (n, d + 1, bias column last) and 0/1 labels y (n, k)."""
    n, d1 = a.shape
    w = np.zeros((d1, y.shape[1]))
    if not y.shape[1]:
        return w
    rate = (y.sum(axis=0) + 1) / (n + 2)  # smoothed: a label that never varies still has a finite bias
    w[-1] = np.log(rate / (1 - rate))
    penalty = np.full(d1, l2)
    penalty[-1] = 0.0  # the bias is not shrunk
    bound = gram / 4 + np.diag(penalty)
    bound[-1, -1] += 1e-9 * n + 1e-9  # keep it positive definite even with no rows
    inverse = np.linalg.inv(bound)  # symmetric positive definite and small: inverted once, used every step
    for _ in range(MAX_STEPS):
        residual = (_predict(a, w) - y).astype(np.float32)
        grad = (a.T @ residual).astype(np.float64) + penalty[:, None] * w
        step = inverse @ grad
        w -= step
        if np.abs(step).max() < TOLERANCE:
            break
    return w


class BestRoute:
    """The cheapest model whose predicted shortfall probability is within the threshold, else the reference."""

    name = "best_route"
    needs_estimates = True

    def __init__(self, classifier: ShortfallClassifier, threshold: float = 0.5,
                 scoring: Literal["concurrent", "serial"] = "concurrent", forward_ms: float = 55.0):
        self.classifier = classifier  # trained once per policy object, kept here
        self.threshold = threshold
        self.scoring = scoring
        self.forward_s = forward_ms / 1000

    def route(self, batch: Sequence[RouteRequest], usable: Sequence[Sequence[int]], estimates: Estimates | None,
              view: PoolView) -> list[str | None]:
        if estimates is None or estimates.embeddings is None:
            raise ValueError("best_route needs the batch's prompt embeddings")
        clf = self.classifier
        p = clf.predict(estimates.embeddings) if len(batch) else np.zeros((0, len(clf.models)))
        out: list[str | None] = []
        for r, cands in enumerate(usable):
            mine = models_of(cands, view)
            ok = [k for k, m in enumerate(clf.models) if m in mine]
            choice = next((clf.models[k] for k in ok if p[r, k] <= self.threshold), None)
            if choice is None and clf.reference in mine:
                choice = clf.reference
            elif choice is None and ok:  # the reference is not usable: the least likely to fall short
                choice = clf.models[min(ok, key=lambda k: p[r, k])]
            out.append(choice)  # None: no labelled model among the candidates, like passthrough
        return out

    def compute_s(self, batch_size: int) -> float:
        if self.scoring == "serial":
            return batch_size * self.forward_s
        return self.forward_s if batch_size else 0.0


def make_router(context: PolicyContext) -> BestRoute:
    if context.estimators is None:
        raise ValueError("best_route needs the KNN estimator's training set, which is not built: "
                         "run `routebalance train`")
    knobs = context.options("best_route")
    knn = context.estimators.knn
    classifier = ShortfallClassifier.fit(knn.index.reconstruct_n(0, knn.index.ntotal), knn.quality, knn.models,
                                         model_prices(context.config.instances), knobs.margin, knobs.seed)
    return BestRoute(classifier, knobs.threshold, knobs.scoring, knobs.forward_ms)


OPTIONS = {"best_route": BestRouteOptions}
ENTRIES = entries("best_route", make_router,
                  "BEST-Route-style learned scorer: the cheapest model not predicted to fall short")
