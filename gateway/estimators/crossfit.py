"""Choosing the quality and length estimators on a user's own labels, by cross-validation.

Labels are scarce, so every record both trains the served estimator and, out of fold, tests it:
repeated k-fold with seeds fixed in advance, each prompt predicted by estimators that never saw it.
A choice among candidates (the KNN as the paper has it, wider neighbourhoods, logistic heads at
several strengths, a low-rank head) is part of what is tested: inside each outer fold an inner k-fold
picks the candidate, which is then fitted on the outer fold's training part (nested cross-validation),
so the out-of-fold figures are not flattered by the choice.

Candidates are judged by what they change, the routing: the mean over quality:cost mixes of how far
Eq. 1's picks (latency weight 0) lie above the upper convex hull of the single models on the
cost-quality plane, scored with the held-out prompts' own labels and real answer costs. (A candidate
with the best log-loss can route worse: what matters is the ordering between models per prompt.)
Lengths are chosen by mean absolute error, since the cost and latency terms and the budget filter use
them directly.

Pure numpy apart from FAISS (the KNN): the same code chooses at `train` and at a refresh.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.core.budget import predicted_cost, price_arrays
from gateway.core.scoring import eq1
from gateway.estimators.heads import LengthHeads, QualityHeads
from gateway.estimators.knn import K, KnnEstimator

# The router's trade-off curve: quality:cost weights with the latency weight at 0.
MIXES: tuple[tuple[float, float, float], ...] = ((0.8, 0.0, 0.2), (0.5, 0.0, 0.5), (0.2, 0.0, 0.8))
FOLDS = 5
REPEATS = 3
INNER_FOLDS = 4


@dataclass(frozen=True, slots=True)
class EstimatorCandidate:
    """One way to estimate quality (or length) per model from a prompt's embedding."""

    name: str
    kind: str  # "knn" | "logistic" | "ridge"
    params: dict = field(default_factory=dict)

    def fit(self, x: np.ndarray, quality: np.ndarray, length: np.ndarray, models: tuple[str, ...]) -> Predictor:
        if self.kind == "knn":
            knn = KnnEstimator.build(x, quality, length, models, k=self.params.get("k", 10))
            return _KnnPredictor(knn, self.params.get("shrink", True))
        if self.kind == "logistic":
            return _HeadPredictor(QualityHeads.fit(x, quality, models, self.params["l2"], self.params.get("rank")))
        if self.kind == "ridge":
            return _HeadPredictor(LengthHeads.fit(x, length, models, self.params["l2"]))
        raise ValueError(f"unknown candidate kind {self.kind!r}")


class Predictor:
    def predict(self, x: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """(quality, length) per model, (n, models) each; None for the one a head does not estimate."""
        raise NotImplementedError


class _KnnPredictor(Predictor):
    def __init__(self, knn: KnnEstimator, shrink: bool):
        self.knn, self.shrink = knn, shrink

    def predict(self, x):
        est = self.knn.estimate(x, shrink=self.shrink)
        return est.quality, est.length


class _HeadPredictor(Predictor):
    def __init__(self, head: QualityHeads | LengthHeads):
        self.head = head

    def predict(self, x):
        out = self.head.predict(x)
        return (out, None) if isinstance(self.head, QualityHeads) else (None, out)


QUALITY_CANDIDATES: tuple[EstimatorCandidate, ...] = (
    EstimatorCandidate("knn k=10 shrunk", "knn", {"k": 10, "shrink": True}),  # what the gateway served before
    EstimatorCandidate("knn k=10 raw", "knn", {"k": 10, "shrink": False}),  # the paper's neighbour means
    EstimatorCandidate("knn k=40 shrunk", "knn", {"k": 40, "shrink": True}),
    EstimatorCandidate("logistic l2=0.3", "logistic", {"l2": 0.3}),
    EstimatorCandidate("logistic l2=1", "logistic", {"l2": 1.0}),
    EstimatorCandidate("logistic l2=3", "logistic", {"l2": 3.0}),
    EstimatorCandidate("low-rank logistic r=32", "logistic", {"l2": 1.0, "rank": 32}),
)
LENGTH_CANDIDATES: tuple[EstimatorCandidate, ...] = (
    EstimatorCandidate("knn k=10", "knn", {"k": 10}),
    EstimatorCandidate("ridge log l2=1", "ridge", {"l2": 1.0}),
    EstimatorCandidate("ridge log l2=10", "ridge", {"l2": 10.0}),
)


def folds(n: int, k: int, seed: int, groups: np.ndarray | None = None) -> list[np.ndarray]:
    """k disjoint test folds covering 0..n-1, from a seeded permutation. With `groups` (a key per row, e.g. the
    prompt's hash; "" for none), rows of one group fall in one fold: a prompt that appears twice never predicts
    itself."""
    if groups is None:
        order = np.random.default_rng(seed).permutation(n)
        return [np.sort(order[i::k]) for i in range(k)]
    keys = np.array([g if g else f"row {r}" for r, g in enumerate(groups)])
    unique, group_of = np.unique(keys, return_inverse=True)
    fold_of_group = np.empty(len(unique), np.int64)
    fold_of_group[np.random.default_rng(seed).permutation(len(unique))] = np.arange(len(unique)) % k
    fold = fold_of_group[group_of]
    return [np.flatnonzero(fold == i) for i in range(k)]


@dataclass(frozen=True, slots=True)
class Pricing:
    """What Eq. 1 needs per model to price and time a prompt, and the labels it is scored with."""

    price_in: np.ndarray  # (models,) USD per token
    price_out: np.ndarray
    input_len: np.ndarray  # (n,) prompt tokens
    cost: np.ndarray  # (n, models) USD of each model's real answer (unclipped lengths)


def pool_columns(instances, models: Sequence[str]) -> tuple[list[int], list]:
    """The columns of `models` the pool serves, and one instance of each (the first in the config)."""
    first = {i.model: i for i in reversed(instances)}
    cols = [j for j, m in enumerate(models) if m in first]
    return cols, [first[models[j]] for j in cols]


def model_prices(instances, models: Sequence[str]) -> tuple[list[int], np.ndarray, np.ndarray]:
    """The columns the pool serves and each model's USD per prompt and answer token (its first instance's;
    0 for a model the pool lacks, which the callers keep out of the picks)."""
    cols, pool = pool_columns(instances, models)
    price_in, price_out = np.zeros(len(models)), np.zeros(len(models))
    if cols:
        price_in[cols], price_out[cols] = price_arrays(pool)
    return cols, price_in, price_out


def eq1_picks(quality: np.ndarray, length: np.ndarray, pricing: Pricing, rows: np.ndarray,
              weights: tuple[float, float, float], tpot_s: np.ndarray | None = None) -> np.ndarray:
    """The model column Eq. 1 picks for each prompt (rows index the pricing's prompts) at these weights on an
    idle pool (latency: tpot x predicted length; without tpot the latency term is equal for all)."""
    out = np.empty(len(rows), dtype=np.int64)
    tpot = np.zeros(quality.shape[1]) if tpot_s is None else tpot_s
    for r, row in enumerate(rows):
        cost = predicted_cost(float(pricing.input_len[row]), length[r], pricing.price_in, pricing.price_out)
        out[r] = int(np.argmax(eq1(weights, quality[r], cost, tpot * length[r])))
    return out


def upper_hull(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper convex hull of (cost, quality) points, cheapest first, rising in quality."""
    hull: list[tuple[float, float]] = []
    for p in sorted(points):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:  # hull[-1] is on or under the chord
                hull.pop()
            else:
                break
        if not hull or p[1] > hull[-1][1]:
            hull.append(p)
    return hull


def hull_quality(hull: Sequence[tuple[float, float]], cost: float) -> float:
    """The quality the hull reaches at `cost` (its best point past its most expensive one). Mixing two single
    models at random reaches any point of the hull, so a router is worth its keep above it."""
    if cost <= hull[0][0]:
        return hull[0][1]
    for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
        if x1 <= cost <= x2:
            return y1 + (y2 - y1) * (cost - x1) / (x2 - x1)
    return hull[-1][1]


def above_hull(quality: np.ndarray, length: np.ndarray, labels: np.ndarray, pricing: Pricing,
               rows: np.ndarray, columns: Sequence[int] | None = None) -> float:
    """Routing criterion: mean over MIXES of (quality of the picks - the single models' hull at their cost),
    over the models of `columns` only when given (the ones the pool serves)."""
    if columns is not None:
        cols = list(columns)
        quality, length, labels = quality[:, cols], length[:, cols], labels[:, cols]
        pricing = Pricing(pricing.price_in[cols], pricing.price_out[cols], pricing.input_len, pricing.cost[:, cols])
    points = [(float(pricing.cost[rows, j].mean()), float(labels[rows, j].mean())) for j in range(labels.shape[1])]
    hull = upper_hull(points)
    gaps = []
    for weights in MIXES:
        chosen = eq1_picks(quality, length, pricing, rows, weights)
        q = float(labels[rows, chosen].mean())
        c = float(pricing.cost[rows, chosen].mean())
        gaps.append(q - hull_quality(hull, c))
    return float(np.mean(gaps))


@dataclass(frozen=True, slots=True)
class Choice:
    quality: EstimatorCandidate
    length: EstimatorCandidate
    scores: dict[str, float]  # candidate name -> its criterion (quality: above hull; length: -MAE)

    @property
    def knn_k(self) -> int:
        """The served index's k: the chosen KNN's, or the paper's when a head estimates quality."""
        return self.quality.params.get("k", K) if self.quality.kind == "knn" else K

    @property
    def shrink(self) -> bool:
        return self.quality.params.get("shrink", True)

    def heads(self, x: np.ndarray, quality: np.ndarray, length: np.ndarray,
              models: tuple[str, ...]) -> tuple[QualityHeads | None, LengthHeads | None]:
        """The chosen learned heads fitted on these records (None where the KNN's estimate was chosen)."""
        q = (QualityHeads.fit(x, quality, models, self.quality.params["l2"], self.quality.params.get("rank"))
             if self.quality.kind == "logistic" else None)
        ln = LengthHeads.fit(x, length, models, self.length.params["l2"]) if self.length.kind == "ridge" else None
        return q, ln


def choose(x: np.ndarray, quality: np.ndarray, length: np.ndarray, pricing: Pricing, models: tuple[str, ...],
           rows: np.ndarray, k: int = INNER_FOLDS, seed: int = 0,
           quality_candidates: Sequence[EstimatorCandidate] = QUALITY_CANDIDATES,
           length_candidates: Sequence[EstimatorCandidate] = LENGTH_CANDIDATES,
           groups: np.ndarray | None = None) -> Choice:
    """The candidates that do best in a k-fold over `rows` (ties: the earlier, simpler candidate); `groups`
    (one key per record) keeps a repeated prompt in one fold."""
    q_oof = {c.name: np.zeros((len(rows), quality.shape[1]), dtype=np.float32) for c in quality_candidates}
    l_oof = {c.name: np.zeros((len(rows), quality.shape[1]), dtype=np.float32) for c in length_candidates}
    for test in folds(len(rows), k, seed, None if groups is None else groups[rows]):
        train = np.setdiff1d(np.arange(len(rows)), test)
        tr, te = rows[train], rows[test]
        for c in quality_candidates:
            q_oof[c.name][test] = c.fit(x[tr], quality[tr], length[tr], models).predict(x[te])[0]
        for c in length_candidates:
            l_oof[c.name][test] = c.fit(x[tr], quality[tr], length[tr], models).predict(x[te])[1]
    scores = {f"length: {c.name}": -float(np.abs(l_oof[c.name] - length[rows]).mean()) for c in length_candidates}
    best_length = max(length_candidates, key=lambda c: scores[f"length: {c.name}"])
    for c in quality_candidates:
        scores[f"quality: {c.name}"] = above_hull(q_oof[c.name], l_oof[best_length.name], quality, pricing, rows)
    best_quality = max(quality_candidates, key=lambda c: scores[f"quality: {c.name}"])
    return Choice(best_quality, best_length, scores)


@dataclass
class OutOfFold:
    """Each repeat's out-of-fold estimates of every record, and what each outer fold chose."""

    quality: np.ndarray  # (repeats, n, models)
    length: np.ndarray
    chosen: list[tuple[str, str]]  # (quality, length) candidate names, one per outer fold
    # candidate name -> (repeats, n, models), each candidate fitted in every outer fold (no choice made)
    quality_candidates: dict[str, np.ndarray]
    length_candidates: dict[str, np.ndarray]
    # Each prompt's task's mean label per model on the other folds (None without tasks): the baseline of a
    # router that knows the task and nothing else about the prompt.
    task_means: np.ndarray | None = None


def out_of_fold(x: np.ndarray, quality: np.ndarray, length: np.ndarray, pricing: Pricing,
                models: tuple[str, ...], folds_k: int = FOLDS, repeats: int = REPEATS, inner_k: int = INNER_FOLDS,
                quality_candidates: Sequence[EstimatorCandidate] = QUALITY_CANDIDATES,
                length_candidates: Sequence[EstimatorCandidate] = LENGTH_CANDIDATES,
                kinds: np.ndarray | None = None, progress: Callable[[int, int], None] | None = None,
                groups: np.ndarray | None = None) -> OutOfFold:
    """Nested, repeated k-fold: repeat r uses seed r for its folds; inside each outer fold `choose` picks the
    candidates on the training part, which are then fitted there and predict the fold. `kinds`: each record's
    task, for the task-means baseline (None, or a single task: no baseline); `groups`: each record's prompt
    key, so that a repeated prompt stays in one fold."""
    n, m = quality.shape
    with_tasks = kinds is not None and len(set(kinds.tolist())) > 1
    def empty() -> np.ndarray:
        return np.zeros((repeats, n, m), dtype=np.float32)

    out = OutOfFold(empty(), empty(), [], {c.name: empty() for c in quality_candidates},
                    {c.name: empty() for c in length_candidates}, empty() if with_tasks else None)
    total, done = repeats * folds_k, 0
    for r in range(repeats):
        for test in folds(n, folds_k, seed=r, groups=groups):
            train = np.setdiff1d(np.arange(n), test)
            choice = choose(x, quality, length, pricing, models, train, inner_k, seed=1000 + r,
                            quality_candidates=quality_candidates, length_candidates=length_candidates,
                            groups=groups)
            for c in quality_candidates:
                out.quality_candidates[c.name][r, test] = c.fit(x[train], quality[train], length[train],
                                                                models).predict(x[test])[0]
            for c in length_candidates:
                out.length_candidates[c.name][r, test] = c.fit(x[train], quality[train], length[train],
                                                               models).predict(x[test])[1]
            out.quality[r, test] = out.quality_candidates[choice.quality.name][r, test]
            out.length[r, test] = out.length_candidates[choice.length.name][r, test]
            out.chosen.append((choice.quality.name, choice.length.name))
            if out.task_means is not None:
                everyone = quality[train].mean(axis=0)
                for kind in set(kinds[test].tolist()):
                    same = train[kinds[train] == kind]
                    out.task_means[r, test[kinds[test] == kind]] = quality[same].mean(axis=0) if len(same) else everyone
            done += 1
            if progress is not None:
                progress(done, total)
    return out
