"""Learned per-model heads on the prompt embedding: the alternatives to the KNN's neighbour means.

- Quality: one L2-regularised logistic regression per model, p(correct | embedding). Optionally on a
  low-rank projection of the embedding (the training prompts' top principal directions), which shares
  one projection among the models, as a matrix-factorisation router does, and needs fewer labels.
- Length: one ridge regression per model on log(1 + answer tokens); its prediction is exp(.) - 1, the
  geometric-mean-like typical length, which a long-tailed answer length needs (a mean on the raw scale
  is pulled by the few answers at the cap).

Fitting and predicting are plain numpy and scipy, so the same code trains offline (`routebalance
train`) and refits while serving. Which head, if any, routes is chosen by cross-validation on the
user's labels (estimators/crossfit.py); the choice and the arrays are stored beside the KNN index.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from gateway.artefacts import ArtefactError

HEADS_FILE = "heads.npz"


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * z))  # no overflow for large |z|


def fit_logistic(x: np.ndarray, y: np.ndarray, l2: float,
                 sample_weight: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Weights and bias of p = sigmoid(x @ w + b), minimising the (weighted) log-loss plus l2/2 |w|^2 (the bias
    is not penalised). Labels may be graded scores in [0, 1] (the cross-entropy takes them as they are)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    sw = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    d = x.shape[1]

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        w, b = theta[:d], theta[d]
        z = x @ w + b
        # log(1 + e^z) - y z, written so that neither large positive nor negative z overflows
        value = float((sw * (np.logaddexp(0.0, z) - y * z)).sum() + 0.5 * l2 * (w @ w))
        r = sw * (_sigmoid(z) - y)
        return value, np.concatenate([x.T @ r + l2 * w, [r.sum()]])

    start = np.zeros(d + 1)
    mean = float(np.clip(np.average(y, weights=sw), 1e-3, 1 - 1e-3))
    start[d] = np.log(mean / (1 - mean))
    theta = minimize(loss, start, jac=True, method="L-BFGS-B", options={"maxiter": 500}).x
    return theta[:d], float(theta[d])


def fit_ridge(x: np.ndarray, y: np.ndarray, l2: float,
              sample_weight: np.ndarray | None = None) -> tuple[np.ndarray, float]:
    """Weights and bias of y ~ x @ w + b, minimising (weighted) squared error plus l2 |w|^2 (closed form)."""
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    sw = np.ones(len(y)) if sample_weight is None else np.asarray(sample_weight, dtype=np.float64)
    centre = np.average(x, axis=0, weights=sw)
    y_mean = float(np.average(y, weights=sw))
    xc = x - centre
    w = np.linalg.solve(xc.T @ (xc * sw[:, None]) + l2 * np.eye(x.shape[1]), xc.T @ (sw * (y - y_mean)))
    return w, float(y_mean - centre @ w)


def principal_directions(x: np.ndarray, rank: int) -> np.ndarray:
    """(d, rank) orthonormal top principal directions of the rows of x (centred)."""
    x = np.asarray(x, dtype=np.float64)
    _, _, vt = np.linalg.svd(x - x.mean(axis=0), full_matrices=False)
    return vt[:rank].T.copy()


@dataclass(frozen=True, slots=True)
class QualityHeads:
    """p(correct) per model: sigmoid((x @ projection) @ weights + bias); projection None: the embedding."""

    models: tuple[str, ...]
    weights: np.ndarray  # (features, models)
    bias: np.ndarray  # (models,)
    projection: np.ndarray | None = None  # (d, rank)

    @classmethod
    def fit(cls, x: np.ndarray, quality: np.ndarray, models, l2: float, rank: int | None = None) -> QualityHeads:
        projection = principal_directions(x, rank) if rank else None
        features = x @ projection if projection is not None else x
        fitted = [fit_logistic(features, quality[:, j], l2) for j in range(quality.shape[1])]
        return cls(tuple(models), np.column_stack([w for w, _ in fitted]), np.array([b for _, b in fitted]),
                   projection)

    @property
    def features(self) -> int:
        """The embedding size the head reads."""
        return len(self.projection) if self.projection is not None else len(self.weights)

    def predict(self, x: np.ndarray) -> np.ndarray:
        features = x @ self.projection if self.projection is not None else x
        return _sigmoid(features @ self.weights + self.bias).astype(np.float32)


@dataclass(frozen=True, slots=True)
class LengthHeads:
    """Typical answer tokens per model: exp(x @ weights + bias) - 1, clipped to what was seen in training."""

    models: tuple[str, ...]
    weights: np.ndarray  # (d, models)
    bias: np.ndarray  # (models,)
    ceiling: np.ndarray  # (models,) the longest training answer: no prediction beyond it

    @classmethod
    def fit(cls, x: np.ndarray, length: np.ndarray, models, l2: float) -> LengthHeads:
        fitted = [fit_ridge(x, np.log1p(length[:, j]), l2) for j in range(length.shape[1])]
        return cls(tuple(models), np.column_stack([w for w, _ in fitted]), np.array([b for _, b in fitted]),
                   length.max(axis=0).astype(np.float64))

    @property
    def features(self) -> int:
        return len(self.weights)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return np.clip(np.expm1(x @ self.weights + self.bias), 1.0, self.ceiling).astype(np.float32)


def save_heads(directory: Path, quality: QualityHeads | None, length: LengthHeads | None) -> str:
    """Both heads (either may be None: the KNN serves that estimate) in one file; returns its name."""
    arrays: dict[str, np.ndarray] = {}
    if quality is not None:
        arrays |= {"quality_models": np.array(quality.models), "quality_weights": quality.weights,
                   "quality_bias": quality.bias}
        if quality.projection is not None:
            arrays["quality_projection"] = quality.projection
    if length is not None:
        arrays |= {"length_models": np.array(length.models), "length_weights": length.weights,
                   "length_bias": length.bias, "length_ceiling": length.ceiling}
    np.savez(Path(directory) / HEADS_FILE, **arrays)
    return HEADS_FILE


def load_heads(path: Path) -> tuple[QualityHeads | None, LengthHeads | None]:
    try:
        with np.load(path, allow_pickle=False) as z:
            quality = length = None
            if "quality_weights" in z:
                quality = QualityHeads(tuple(str(m) for m in z["quality_models"]), z["quality_weights"],
                                       z["quality_bias"], z["quality_projection"] if "quality_projection" in z
                                       else None)
            if "length_weights" in z:
                length = LengthHeads(tuple(str(m) for m in z["length_models"]), z["length_weights"],
                                     z["length_bias"], z["length_ceiling"])
    except (OSError, ValueError, KeyError) as e:
        raise ArtefactError(f"{path}: cannot read the learned heads: {e}") from None
    return quality, length
