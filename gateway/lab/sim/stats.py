"""Confidence intervals for the sweeps: a bootstrap over seeds and requests, and paired differences.

A sweep runs every cell on arrival seeds 0..S-1. For one figure of one cell
the per-request values form a (seeds x requests) array: row s is the run on
seed s, column i the i-th held-out prompt, the same prompt in every row (the
seed changes the arrivals and which requests carry a budget, not the prompts). NaN marks
a request that does not count for the figure (a refused request has no E2E,
a request without a budget no budget outcome). A figure known only per run
(throughput) is a (seeds x 1) array.

A cell's figure is the mean over its seeds of the per-seed figure (the mean,
or a percentile, of that seed's counted requests). One bootstrap replicate
draws S seeds with replacement and n request indices with replacement, and
takes the figure over the drawn requests of each drawn seed, averaged over
the drawn seeds. The request indices are drawn once per replicate and shared
by its seeds: every seed replays the same prompts, so they are one sample of
prompts, not S (drawing them afresh per seed would shrink the prompt part of
the interval by the number of seeds). With one seed this is the plain
per-request bootstrap. How it behaves on synthetic data (tests/test_stats.py):
about nominal when the prompts make most of the spread; conservative (wider)
when independent per-request noise does, since the seed draw and the request
draw both carry it; somewhat narrow when the seeds make most of it, as five
seeds resample to 4/5 of their variance.

Two cells run on the same seeds pair request by request (same prompt, same
arrival time). A paired difference applies the very same draws to both, so
what the cells share (which prompts are hard, when the bursts come) cancels
out of the difference instead of widening its interval.

Pure numpy and seeded: the same inputs give the same interval. A chunk of
replicates is one matrix of draw counts (replicates x requests); every
figure of the chunk is read from it by a matrix product (means) or a
cumulative sum over the seed's sorted values (percentiles), with no Python
loop over replicates or requests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import numpy as np

REPLICATES = 2000
LEVEL = 0.95
CHUNK = 250  # replicates drawn at a time: bounds memory at CHUNK x requests counts

Statistic = str | float  # "mean", or a percentile in [0, 100]
Figures = Mapping[str, tuple[object, Statistic]]  # name -> ((seeds x requests) values, statistic)


@dataclass(frozen=True, slots=True)
class Interval:
    """A figure and its confidence interval (percentile bootstrap)."""

    mean: float
    lo: float
    hi: float


def bootstrap(values, statistic: Statistic = "mean", **kw) -> Interval:
    """The figure of a (seeds x requests) array (NaN not counted) with its bootstrap interval.

    `statistic` is "mean" or a percentile in [0, 100]; keywords: replicates, level, seed.
    """
    return bootstrap_many({"figure": (values, statistic)}, **kw)["figure"]


def bootstrap_mean(values, **kw) -> Interval:
    return bootstrap(values, "mean", **kw)


def bootstrap_percentile(values, q: float, **kw) -> Interval:
    return bootstrap(values, float(q), **kw)


def bootstrap_many(figures: Figures, *, replicates: int = REPLICATES, level: float = LEVEL,
                   seed: int = 0) -> dict[str, Interval]:
    """Several figures of one cell (arrays of one shape), all read from the same draws."""
    prepared = _prepare(figures)
    reps = _replicates(prepared, _shape_of(prepared), replicates, seed)
    return {name: _interval(f.point, reps[name], level) for name, f in prepared.items()}


def difference(a, b, statistic: Statistic = "mean", **kw) -> Interval:
    """Figure of cell A minus figure of cell B, with its interval (see `differences`)."""
    return differences({"figure": (a, statistic)}, {"figure": (b, statistic)}, **kw)["figure"]


def differences(a: Figures, b: Figures, *, paired: bool = True, relative: bool = False,
                replicates: int = REPLICATES, level: float = LEVEL, seed: int = 0) -> dict[str, Interval]:
    """Per figure, cell A's minus cell B's, with its interval.

    Paired (the default): A and B ran on the same seeds and prompts, and each
    replicate takes the same seeds and requests from both. Unpaired: each cell
    is resampled on its own, as if the two had nothing in common. Relative:
    A's over B's, minus 1 (each replicate's ratio, so the interval is the ratio's).
    """
    if a.keys() != b.keys():
        raise ValueError("both cells need the same figures")
    prep_a, prep_b = _prepare(a), _prepare(b)
    shape = _shape_of(prep_a)
    if _shape_of(prep_b) != shape:
        raise ValueError(f"paired cells need the same seeds and requests, got {shape} and {_shape_of(prep_b)}")
    reps_a = _replicates(prep_a, shape, replicates, seed)
    reps_b = _replicates(prep_b, shape, replicates, seed if paired else seed + 1)
    if relative:
        with np.errstate(invalid="ignore", divide="ignore"):
            return {name: _interval(prep_a[name].point / prep_b[name].point - 1, reps_a[name] / reps_b[name] - 1,
                                    level) for name in a}
    return {name: _interval(prep_a[name].point - prep_b[name].point, reps_a[name] - reps_b[name], level)
            for name in a}


# ---- the resampling -----------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Prepared:
    """One figure's data, arranged once for every chunk of replicates."""

    values: np.ndarray  # (seeds, requests), NaN not counted
    statistic: Statistic
    # Percentiles only, per seed: the counted requests from the largest value down, and those values.
    descending: tuple[np.ndarray, ...] = ()
    descending_values: tuple[np.ndarray, ...] = ()

    @property
    def counted(self) -> np.ndarray:
        return ~np.isnan(self.values)

    @property
    def point(self) -> float:
        """The figure on the data as it is: every request drawn once."""
        return _combine(_resampled_per_seed(self, np.ones((1, self.values.shape[1])))[0])


def _prepare(figures: Figures) -> dict[str, _Prepared]:
    prepared = {}
    for name, (values, statistic) in figures.items():
        x = _layout(values)
        if statistic == "mean":
            prepared[name] = _Prepared(x, statistic)
            continue
        if not 0 <= float(statistic) <= 100:
            raise ValueError(f"percentile {statistic} outside [0, 100]")
        orders = [np.argsort(-row[~np.isnan(row)], kind="stable") for row in x]
        indices = tuple(np.flatnonzero(~np.isnan(row))[o] for row, o in zip(x, orders, strict=True))
        prepared[name] = _Prepared(x, float(statistic), indices, tuple(row[i] for row, i in zip(x, indices,
                                                                                                 strict=True)))
    return prepared


def _layout(values) -> np.ndarray:
    """(seeds x requests) float array; a 1-D array is one seed."""
    x = np.asarray(values, dtype=float)
    if x.ndim == 1:
        x = x[None, :]
    if x.ndim != 2 or x.size == 0:
        raise ValueError(f"expected a non-empty (seeds x requests) array, got shape {x.shape}")
    return x


def _shape_of(prepared: dict[str, _Prepared]) -> tuple[int, int]:
    shapes = {f.values.shape for f in prepared.values()}
    if len(shapes) != 1:
        raise ValueError(f"figures resampled together need one shape, got {sorted(shapes)}")
    return shapes.pop()


def _replicates(prepared: dict[str, _Prepared], shape: tuple[int, int], replicates: int,
                seed: int) -> dict[str, np.ndarray]:
    means = {name: f for name, f in prepared.items() if f.statistic == "mean"}
    stacked = _MeanStack(means) if means else None
    chunks: dict[str, list[np.ndarray]] = {name: [] for name in prepared}
    for seed_weights, times in _draws(shape, replicates, seed):
        per_seed = stacked.per_seed(times) if stacked else {}
        per_seed |= {name: _resampled_per_seed(f, times) for name, f in prepared.items() if name not in means}
        for name, values in per_seed.items():
            chunks[name].append(_weighted(values, seed_weights))
    return {name: np.concatenate(c) for name, c in chunks.items()}


class _MeanStack:
    """Every mean figure of a cell side by side, so a chunk of replicates reads them all in one product."""

    def __init__(self, means: dict[str, _Prepared]):
        self.names = list(means)
        self.seeds = next(iter(means.values())).values.shape[0]
        counted = np.concatenate([f.counted for f in means.values()])  # (figures x seeds, requests)
        self.sums = np.where(counted, np.concatenate([f.values for f in means.values()]), 0.0).T
        self.counted = counted.T.astype(float)

    def per_seed(self, times: np.ndarray) -> dict[str, np.ndarray]:
        with np.errstate(invalid="ignore", divide="ignore"):
            means = (times @ self.sums) / (times @ self.counted)  # (replicates, figures x seeds)
        return {name: means[:, i * self.seeds:(i + 1) * self.seeds] for i, name in enumerate(self.names)}


def _draws(shape: tuple[int, int], replicates: int, seed: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Chunks of replicates, each (seed weights, request draw counts); the same arguments give the same draws.

    seed weights (replicates x seeds): times each seed was drawn over the number of seeds;
    request counts (replicates x requests): times each request was drawn.
    """
    seeds, requests = shape
    rng = np.random.default_rng(seed)
    for start in range(0, replicates, CHUNK):
        size = min(CHUNK, replicates - start)
        seed_weights = _counts(rng.integers(0, seeds, (size, seeds)), seeds) / seeds
        yield seed_weights, _counts(rng.integers(0, requests, (size, requests)), requests)


def _counts(indices: np.ndarray, width: int) -> np.ndarray:
    """Row-wise histogram: how many times each of 0..width-1 occurs in each row of `indices`."""
    rows = indices.shape[0]
    flat = (indices + width * np.arange(rows)[:, None]).ravel()
    return np.bincount(flat, minlength=rows * width).reshape(rows, width).astype(float)


def _resampled_per_seed(f: _Prepared, times: np.ndarray) -> np.ndarray:
    """(replicates x seeds): the figure of each seed over the drawn requests (drawn `times` times each)."""
    if f.statistic == "mean":
        return _MeanStack({"figure": f}).per_seed(times)["figure"]
    return np.stack([_percentile_of_counts(times, counted, descending, values, float(f.statistic))
                     for counted, descending, values in zip(f.counted, f.descending, f.descending_values,
                                                            strict=True)], axis=1)


def _percentile_of_counts(times: np.ndarray, counted: np.ndarray, descending: np.ndarray, values: np.ndarray,
                          q: float) -> np.ndarray:
    """numpy's default (linear) percentile of each resample of one seed, NaN skipped.

    `descending` lists the seed's counted requests from the largest value down
    (`values` are theirs) and `times` how often each resample drew each
    request: the value t places from the top of a resample is the first whose
    running count from the top exceeds t. Only the top of the order is read:
    a resample draws each request about once, so twice the deepest wanted
    rank plus some slack holds it (and the whole order is read when not).
    """
    if not len(descending):
        return np.full(len(times), np.nan)  # nothing of this seed counts
    k = times @ counted  # counted requests drawn, per resample
    position = (k - 1) * (q / 100.0)
    below = np.floor(position)
    frac = position - below
    from_top = np.clip(k - 1 - below, 0, None)  # the value at rank `below`, counted from the top (0: the largest)
    deepest = float(from_top.max(initial=0.0))
    width = min(len(descending), int(2 * deepest + 8 * np.sqrt(deepest) + 32))
    running = np.cumsum(times[:, descending[:width]], axis=1)
    if width < len(descending) and (running[:, -1] <= from_top).any():
        width = len(descending)
        running = np.cumsum(times[:, descending], axis=1)
    at = values[(running > from_top[:, None]).argmax(axis=1)]
    above = values[(running > np.clip(from_top - 1, 0, None)[:, None]).argmax(axis=1)]  # rank `below` + 1
    with np.errstate(invalid="ignore"):
        return np.where(k > 0, at + frac * (above - at), np.nan)


def _combine(per_seed: np.ndarray) -> float:
    """Mean over the seeds that have a figure (NaN if none has)."""
    finite = per_seed[np.isfinite(per_seed)]
    return float(finite.mean()) if len(finite) else float("nan")


def _weighted(per_seed: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """Weighted mean over seeds per replicate, leaving out a drawn seed whose draw counted no request."""
    has = np.isfinite(per_seed)
    w = np.where(has, weights, 0.0)
    total = w.sum(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(total > 0, (w * np.where(has, per_seed, 0.0)).sum(axis=1) / total, np.nan)


def _interval(point: float, reps: np.ndarray, level: float) -> Interval:
    """Percentile interval of the replicates.

    For a skewed figure (a p99 from few requests) the interval can sit just
    beside its own point estimate; it is widened to include it, so a table
    never shows a figure outside its own interval.
    """
    reps = reps[np.isfinite(reps)]
    if not np.isfinite(point) or not len(reps):
        return Interval(point, float("nan"), float("nan"))
    tail = 100 * (1 - level) / 2
    lo, hi = np.percentile(reps, [tail, 100 - tail])
    return Interval(point, float(min(lo, point)), float(max(hi, point)))
