"""Per-tier TPOT heads (XGBoost) with the static prior as fallback.

A tier is a (served model, GPU) pair: instances of a tier share one head.
Features are what the gateway can see without a forked vLLM: the last scrape
of the instance's /metrics, its own accounting of what it dispatched there,
and the request itself. The heads predict seconds per output token; the
scheduler turns that into latency with the instance's pending decode work.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import xgboost as xgb

from gateway.artefacts import ArtefactError
from gateway.core.view import STATE_FEATURES
from gateway.estimators.forest import Forest

# A head's features: the instance's state as the scheduler tracks it, then the request itself.
FEATURES = (
    *STATE_FEATURES,
    "prompt_tokens",  # the request's prompt
    "output_tokens",  # the request's predicted answer length
)

# What the gateway itself has sent to an instance is current, and more of it never makes the instance faster,
# so a head never predicts a lower TPOT for more of it: without this, a head fitted on few nearly idle rows
# priced an idle instance slower than a busy one and Eq. 1 piled a tier's traffic on one instance. The
# scrape's counts are left free: they are up to a scrape old, and at a given in-flight count a higher one can
# mean an instance that is draining (constraining them too cost 15-20% of held-out MAE).
RISING = ("in_flight", "pending_prefill_tokens", "pending_decode_tokens")

# Paper's settings (papers/README.md): squared error, depth 6, eta 0.1,
# subsample and column sample 0.8, up to 500 rounds with early stopping.
PARAMS = {
    "objective": "reg:squarederror",
    "max_depth": 6,
    "eta": 0.1,
    "subsample": 0.8,
    "colsample_bytree": 0.8,
    "monotone_constraints": "(" + ",".join("1" if f in RISING else "0" for f in FEATURES) + ")",
    "nthread": 1,  # one thread: OpenMP spin-waits badly when cores are shared with onnxruntime
}
ROUNDS = 500
EARLY_STOP = 30
# How a head is fitted, beside its traces: a head fitted otherwise is stale (`train --if-stale` refits it).
FIT = {"params": {k: v for k, v in PARAMS.items() if k != "nthread"}, "rounds": ROUNDS, "early_stop": EARLY_STOP}
# Up to this many rows a call walks the trees with numpy (estimators/forest.py), above it XGBoost predicts: the
# walk costs about 80 us for one row and 1 ms for 52, XGBoost 0.6-0.9 ms whatever the rows (`routebalance bench`).
WALK_ROWS = 32


def fit_head(x: np.ndarray, tpot_s: np.ndarray, seed: int = 0) -> xgb.Booster:
    """Fit one tier's head; a stable-hash 10% of rows is the early-stopping set."""
    if len(x) < 20:
        raise ValueError(f"need at least 20 traces to fit a head, got {len(x)}")
    rng = np.random.default_rng(seed)
    valid = rng.random(len(x)) < 0.1
    dtrain = xgb.DMatrix(x[~valid], label=tpot_s[~valid] * 1000, feature_names=list(FEATURES))
    dvalid = xgb.DMatrix(x[valid], label=tpot_s[valid] * 1000, feature_names=list(FEATURES))
    return xgb.train({**PARAMS, "seed": seed}, dtrain, ROUNDS, evals=[(dvalid, "valid")],
                     early_stopping_rounds=EARLY_STOP, verbose_eval=False)


def head_file(tier: str) -> str:
    """A tier's own file name, so heads can be added to a build one tier at a time: readable, and a digest
    tells apart tier names that read alike once made safe for a file name."""
    readable = re.sub(r"[^A-Za-z0-9.-]+", "_", tier)
    return f"tpot_head_{readable}_{hashlib.sha256(tier.encode()).hexdigest()[:8]}.json"


def save_head(booster: xgb.Booster, directory: Path, tier: str) -> str:
    directory.mkdir(parents=True, exist_ok=True)
    name = head_file(tier)
    booster.save_model(directory / name)
    return name


class LatencyHeads:
    """TPOT per tier: the tier's booster if there is one, else its static prior."""

    def __init__(self, boosters: Mapping[str, xgb.Booster], priors_s: Mapping[str, float],
                 errors: Mapping[str, float] | None = None):
        self.boosters = dict(boosters)  # what is saved and refitted
        self.forests = {tier: Forest(b) for tier, b in self.boosters.items()}  # few rows: forest.py says why
        self.priors_s = dict(priors_s)
        self.errors = dict(errors or {})  # a head's mean relative error on its held-out traces (the build's report)

    def tpot(self, tier: str, x: np.ndarray) -> np.ndarray:
        """Seconds per output token for each feature row (n, len(FEATURES))."""
        booster = self.boosters.get(tier)
        if booster is None:  # no head; NaN if the tier is unknown altogether (the caller knows its prior)
            return np.full(len(x), self.priors_s.get(tier, np.nan))
        x = np.asarray(x, dtype=np.float32)
        # The two agree to float32 rounding; each is the faster one on its side of WALK_ROWS.
        pred = (self.forests[tier].predict(x) if len(x) <= WALK_ROWS else booster.inplace_predict(x)) / 1000
        # A head never predicts faster than the tier's unloaded decode: that floor is physics.
        return np.maximum(pred, self.priors_s.get(tier, 0.0) * 0.5)

    def save(self, directory: Path) -> dict[str, str]:
        """Write one JSON booster per tier; returns tier -> file name."""
        return {tier: save_head(booster, directory, tier) for tier, booster in self.boosters.items()}

    @classmethod
    def load(cls, directory: Path, files: Mapping[str, str], priors_s: Mapping[str, float],
             errors: Mapping[str, float] | None = None) -> LatencyHeads:
        boosters = {}
        for tier, name in files.items():
            path = directory / name
            booster = xgb.Booster()
            try:
                booster.load_model(path)
            except (xgb.core.XGBoostError, OSError, json.JSONDecodeError) as e:
                raise ArtefactError(f"{path}: cannot load TPOT head for {tier}: {str(e).splitlines()[0]}") from None
            if booster.feature_names != list(FEATURES):
                raise ArtefactError(f"{path}: TPOT head has features {booster.feature_names}, "
                                    f"expected {list(FEATURES)}")
            booster.set_param({"nthread": 1})
            boosters[tier] = booster
        return cls(boosters, priors_s, errors)
