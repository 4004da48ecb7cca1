"""Folding labels from traffic into the estimators, and the check that decides whether the refit may serve.

Traffic labels are partial: a feedback or a judged answer labels one model's answer to one prompt, a
length one model's answer length. They do not replace the estimators `train` built; they correct them:

- a model the built labels cover keeps its built estimate (the KNN or a head, as `train` chose), and
  traffic fits a correction on top, per model, on the prompt embedding: a logistic correction of the
  quality's log-odds and a ridge correction of log(1 + length). Both are L2-penalised towards zero, the
  bias included, so no traffic means no change and a few labels move the estimate a little; each label
  counts with its source's weight (a user's thumbs and a judge's score are not one scale);
- a model the built labels do not cover (added to the pool since) gets its own heads (estimators/heads.py)
  from its traffic labels alone, once it has `min_labels` quality labels; until then the gateway routes it
  on a pessimistic prior and explores it (serving/explore.py).

A censored length (the answer was cut: at least that long) only pushes the correction up: its residual
over the built estimate counts where it is above it, and not at all below.

The check: k-fold over the built rows (subsampled to `check_rows`); each fold's prompts routed by Eq. 1 at
the quality:cost mixes and scored by their own labels (crossfit.above_hull), once by the built procedure
refitted on the other folds, once by that plus the correction fitted on every traffic label whose prompt is
not in the fold (a prompt never finds itself). A refit that routes worse by more than `tolerance` is refused.

Pure numpy: the serving shell runs it in a thread and swaps the result in.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from gateway.artefacts import ArtefactError
from gateway.estimators.crossfit import EstimatorCandidate, Pricing, above_hull, folds
from gateway.estimators.heads import LengthHeads, QualityHeads, fit_logistic, fit_ridge

EPS = 1e-4  # quality is kept in [EPS, 1 - EPS] before its log-odds are taken
# The built estimate at given prompts: (quality, length) over the built models.
BuiltEstimate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True, slots=True)
class TrafficLabels:
    """Labels from traffic, one row each: the prompt's embedding, the model's column, the value."""

    x: np.ndarray  # (t, d) unit embeddings
    model: np.ndarray  # (t,) column in the refit's models
    value: np.ndarray  # (t,) score in [0, 1], or tokens for a length
    weight: np.ndarray  # (t,) the source's weight (lengths: 1)
    censored: np.ndarray  # (t,) bool; lengths only
    prompt: np.ndarray  # (t,) prompt hash, to keep a test fold's prompts out of its training rows

    @classmethod
    def empty(cls, d: int) -> TrafficLabels:
        return cls(np.zeros((0, d), np.float32), np.zeros(0, np.int64), np.zeros(0), np.zeros(0), np.zeros(0, bool),
                   np.zeros(0, dtype=object))

    def __len__(self) -> int:
        return len(self.model)

    def without(self, prompts: set) -> TrafficLabels:
        return self._rows(np.array([p not in prompts for p in self.prompt], dtype=bool))

    def of(self, j: int) -> TrafficLabels:
        return self._rows(self.model == j)

    def _rows(self, keep: np.ndarray) -> TrafficLabels:
        return TrafficLabels(self.x[keep], self.model[keep], self.value[keep], self.weight[keep],
                             self.censored[keep], self.prompt[keep])


@dataclass(frozen=True, slots=True)
class Base:
    """The built estimators' labelled rows; `models` may be fewer than the refit's (a model added since)."""

    x: np.ndarray  # (n, d)
    quality: np.ndarray  # (n, m)
    length: np.ndarray  # (n, m)
    prompt: np.ndarray  # (n,) prompt hashes ("" where unknown)
    pricing: Pricing  # prices of the base models, prompts' lengths and real costs, for the check
    pool_columns: tuple[int, ...] | None = None  # the base models the pool serves (None: all): what the check routes


@dataclass(frozen=True, slots=True)
class RefitSettings:
    l2_quality: float = 1.0  # the correction's penalty (weights and bias): larger moves the built estimate less
    l2_length: float = 1.0
    l2_head: float = 1.0  # a new model's own heads
    min_labels: int = 20  # quality labels a new model needs for its own head
    folds: int = 5
    check_rows: int = 2000
    tolerance: float = 0.01  # above-hull points a refit may lose against the built estimators
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Correction:
    """Per model: what traffic adds to the built estimate, on the log-odds of quality or on log(1 + length)."""

    models: tuple[str, ...]
    weights: np.ndarray  # (d, k)
    bias: np.ndarray  # (k,)

    def quality(self, x: np.ndarray, built: np.ndarray) -> np.ndarray:
        """`built` (n, k) quality of `models` at x, corrected."""
        q = np.clip(built, EPS, 1 - EPS)
        return _sigmoid(np.log(q / (1 - q)) + x @ self.weights + self.bias).astype(np.float32)

    def length(self, x: np.ndarray, built: np.ndarray) -> np.ndarray:
        return np.maximum(np.expm1(np.log1p(built) + x @ self.weights + self.bias), 1.0).astype(np.float32)


@dataclass(frozen=True, slots=True)
class TrafficFit:
    """What a refresh serves on top of the built estimators."""

    quality_correction: Correction | None  # built models with traffic quality labels
    length_correction: Correction | None
    quality_heads: QualityHeads | None  # new models with at least min_labels quality labels
    length_heads: LengthHeads | None  # new models with any length labels

    def apply(self, x: np.ndarray, models: tuple[str, ...], quality: np.ndarray, length: np.ndarray) -> None:
        """Correct and complete (quality, length) over `models` at x, in place (a model it knows that `models`
        lacks is left out)."""
        for part, out, kind in ((self.quality_correction, quality, "quality"), (self.length_correction, length, "")):
            if part is not None:
                mine = [k for k, m in enumerate(part.models) if m in models]
                cols = [models.index(part.models[k]) for k in mine]
                sub = Correction(tuple(part.models[k] for k in mine), part.weights[:, mine], part.bias[mine])
                out[:, cols] = sub.quality(x, out[:, cols]) if kind else sub.length(x, out[:, cols])
        for heads, out in ((self.quality_heads, quality), (self.length_heads, length)):
            if heads is not None:
                mine = [k for k, m in enumerate(heads.models) if m in models]
                out[:, [models.index(heads.models[k]) for k in mine]] = heads.predict(x)[:, mine]

    @property
    def models(self) -> tuple[str, ...]:
        """The models it estimates that the built estimators may not."""
        return tuple(dict.fromkeys(m for h in (self.quality_heads, self.length_heads) if h is not None
                                   for m in h.models))

    @property
    def headed(self) -> tuple[str, ...]:
        return self.quality_heads.models if self.quality_heads is not None else ()


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))


def fit_quality_correction(x: np.ndarray, y: np.ndarray, built: np.ndarray, weight: np.ndarray,
                           l2: float) -> tuple[np.ndarray, float]:
    """w, b of sigmoid(logit(built) + x @ w + b) by weighted log-loss, l2/2 (|w|^2 + b^2) penalised."""
    q = np.clip(built.astype(np.float64), EPS, 1 - EPS)
    offset = np.log(q / (1 - q))
    d = x.shape[1]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = offset + x @ theta[:d] + theta[d]
        value = float((weight * (np.logaddexp(0.0, z) - y * z)).sum() + 0.5 * l2 * (theta @ theta))
        r = weight * (_sigmoid(z) - y)
        return value, np.concatenate([x.T @ r, [r.sum()]]) + l2 * theta

    theta = minimize(loss, np.zeros(d + 1), jac=True, method="L-BFGS-B", options={"maxiter": 300}).x
    return theta[:d], float(theta[d])


def fit_length_correction(x: np.ndarray, tokens: np.ndarray, built: np.ndarray, censored: np.ndarray,
                          weight: np.ndarray, l2: float) -> tuple[np.ndarray, float]:
    """w, b of log(1 + length) = log(1 + built) + x @ w + b, ridge with the bias penalised too. A censored
    length counts only where it is above the built estimate (it says "at least", never "shorter")."""
    residual = np.log1p(tokens) - np.log1p(built.astype(np.float64))
    residual = np.where(censored, np.maximum(residual, 0.0), residual)
    xb = np.hstack([x.astype(np.float64), np.ones((len(x), 1))])
    theta = np.linalg.solve(xb.T @ (xb * weight[:, None]) + l2 * np.eye(xb.shape[1]), xb.T @ (weight * residual))
    return theta[:-1], float(theta[-1])


def fit_traffic(built: BuiltEstimate | None, built_models: tuple[str, ...], quality: TrafficLabels,
                length: TrafficLabels, models: tuple[str, ...], settings: RefitSettings) -> TrafficFit:
    """Corrections for the built models, heads for the others (`models` starts with `built_models`, in order)."""
    q_corr: list[tuple[str, np.ndarray, float]] = []
    l_corr: list[tuple[str, np.ndarray, float]] = []
    q_heads: list[tuple[str, np.ndarray, float]] = []
    l_heads: list[tuple[str, np.ndarray, float, float]] = []
    for j, model in enumerate(models):
        q, ln = quality.of(j), length.of(j)
        if j < len(built_models):
            assert built is not None
            if len(q):
                w, b = fit_quality_correction(q.x, q.value, built(q.x)[0][:, j], q.weight, settings.l2_quality)
                q_corr.append((model, w, b))
            if len(ln):
                w, b = fit_length_correction(ln.x, ln.value, built(ln.x)[1][:, j], ln.censored, ln.weight,
                                             settings.l2_length)
                l_corr.append((model, w, b))
            continue
        if len(q) >= settings.min_labels:
            w, b = fit_logistic(q.x, q.value, settings.l2_head, sample_weight=q.weight)
            q_heads.append((model, w, b))
        whole = ~ln.censored
        if whole.sum() >= 2:  # a cut answer's length alone says little of the typical one
            w, b = fit_ridge(ln.x[whole], np.log1p(ln.value[whole]), settings.l2_head, sample_weight=ln.weight[whole])
            l_heads.append((model, w, b, float(ln.value.max())))
    return TrafficFit(
        _correction(q_corr), _correction(l_corr),
        QualityHeads(tuple(m for m, _, _ in q_heads), np.column_stack([w for _, w, _ in q_heads]),
                     np.array([b for _, _, b in q_heads])) if q_heads else None,
        LengthHeads(tuple(m for m, _, _, _ in l_heads), np.column_stack([w for _, w, _, _ in l_heads]),
                    np.array([b for _, _, b, _ in l_heads]), np.array([c for _, _, _, c in l_heads]))
        if l_heads else None)


def _correction(rows: list[tuple[str, np.ndarray, float]]) -> Correction | None:
    if not rows:
        return None
    return Correction(tuple(m for m, _, _ in rows), np.column_stack([w for _, w, _ in rows]),
                      np.array([b for _, _, b in rows]))


@dataclass(frozen=True, slots=True)
class Refit:
    fit: TrafficFit
    traffic: dict[str, tuple[int, float]]  # model -> (traffic quality labels, their summed score)
    check_built: float | None  # the check's criterion for the built estimators and for the refit
    check_refit: float | None  # (None: too few built rows to check)
    tolerance: float

    @property
    def accepted(self) -> bool:
        return (self.check_built is None or self.check_refit is None
                or self.check_refit >= self.check_built - self.tolerance)


def refit(base: Base, built: BuiltEstimate, procedure: Callable[[np.ndarray], BuiltEstimate],
          built_models: tuple[str, ...], quality: TrafficLabels, length: TrafficLabels, models: tuple[str, ...],
          settings: RefitSettings) -> Refit:
    """The traffic fit on top of the served built estimate, and the check's verdict. `procedure(train_rows)`
    is the built procedure refitted on those base rows."""
    fit = fit_traffic(built, built_models, quality, length, models, settings)
    checked = check(base, procedure, built_models, quality, length, models, settings)
    now, new = checked if checked is not None else (None, None)
    mine = [quality.model == j for j in range(len(models))]
    traffic = {m: (int(rows.sum()), float(quality.value[rows].sum())) for m, rows in zip(models, mine, strict=True)}
    return Refit(fit, traffic, now, new, settings.tolerance)


def check(base: Base, procedure: Callable[[np.ndarray], BuiltEstimate], built_models: tuple[str, ...],
          quality: TrafficLabels, length: TrafficLabels, models: tuple[str, ...], settings: RefitSettings
          ) -> tuple[float, float] | None:
    """(built, refit) routing criterion out of fold on the built rows; None with too few rows to check."""
    n, m = base.quality.shape
    if n < 4 * settings.folds or base.pool_columns == ():  # too few rows, or no built model the pool serves
        return None
    rng = np.random.default_rng(settings.seed)
    sample = np.sort(rng.choice(n, size=min(n, settings.check_rows), replace=False))
    built_scores, refit_scores = [], []
    for test in folds(len(sample), settings.folds, settings.seed, base.prompt[sample]):
        test_rows = sample[test]
        built = procedure(np.setdiff1d(sample, test_rows))
        held = set(base.prompt[test_rows].tolist()) - {""}
        fit = fit_traffic(built, built_models, quality.without(held), length.without(held), models, settings)
        q, ln = built(base.x[test_rows])
        q_new, ln_new = q.astype(np.float32).copy(), ln.astype(np.float32).copy()
        fit.apply(base.x[test_rows], built_models, q_new, ln_new)
        built_scores.append(above_hull(q, ln, base.quality, base.pricing, test_rows, base.pool_columns))
        refit_scores.append(above_hull(q_new, ln_new, base.quality, base.pricing, test_rows, base.pool_columns))
    return float(np.mean(built_scores)), float(np.mean(refit_scores))


def built_procedure(base: Base, quality_choice: EstimatorCandidate, length_choice: EstimatorCandidate,
                    models: tuple[str, ...]) -> Callable[[np.ndarray], BuiltEstimate]:
    """The procedures `train` chose, refitted on given base rows (for `check`)."""

    def fitted_on(train_rows: np.ndarray) -> BuiltEstimate:
        x, q, ln = base.x[train_rows], base.quality[train_rows], base.length[train_rows]
        quality, length = quality_choice.fit(x, q, ln, models), length_choice.fit(x, q, ln, models)

        def estimate(at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
            est_q, est_l = quality.predict(at)[0], length.predict(at)[1]
            assert est_q is not None and est_l is not None
            return est_q, est_l

        return estimate

    return fitted_on


# ---- on disk ---------------------------------------------------------------------------------------------------


def save_traffic_fit(path: Path, fit: TrafficFit) -> None:
    arrays: dict[str, np.ndarray] = {}
    for name, part in (("quality_correction", fit.quality_correction), ("length_correction", fit.length_correction)):
        if part is not None:
            arrays |= {f"{name}_models": np.array(part.models), f"{name}_weights": part.weights,
                       f"{name}_bias": part.bias}
    if fit.quality_heads is not None:
        h = fit.quality_heads
        arrays |= {"quality_heads_models": np.array(h.models), "quality_heads_weights": h.weights,
                   "quality_heads_bias": h.bias}
    if fit.length_heads is not None:
        h2 = fit.length_heads
        arrays |= {"length_heads_models": np.array(h2.models), "length_heads_weights": h2.weights,
                   "length_heads_bias": h2.bias, "length_heads_ceiling": h2.ceiling}
    with Path(path).open("wb") as f:  # np.savez would add ".npz" to a name without it
        np.savez(f, **arrays)


def load_traffic_fit(path: Path) -> TrafficFit:
    try:
        with np.load(path, allow_pickle=False) as z:
            def names(key: str) -> tuple[str, ...]:
                return tuple(str(m) for m in z[key])

            corrections = [Correction(names(f"{n}_models"), z[f"{n}_weights"], z[f"{n}_bias"])
                           if f"{n}_models" in z else None for n in ("quality_correction", "length_correction")]
            quality = (QualityHeads(names("quality_heads_models"), z["quality_heads_weights"], z["quality_heads_bias"])
                       if "quality_heads_models" in z else None)
            length = (LengthHeads(names("length_heads_models"), z["length_heads_weights"], z["length_heads_bias"],
                                  z["length_heads_ceiling"]) if "length_heads_models" in z else None)
    except (OSError, ValueError, KeyError) as e:
        raise ArtefactError(f"{path}: cannot read the refreshed estimators: {e}") from None
    return TrafficFit(corrections[0], corrections[1], quality, length)
