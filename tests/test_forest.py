"""The numpy walk of a TPOT head's trees predicts what XGBoost predicts, and refuses what it cannot walk."""

from __future__ import annotations

import numpy as np
import pytest
import xgboost as xgb

from gateway.artefacts import ArtefactError
from gateway.estimators.forest import Forest
from gateway.estimators.latency import FEATURES, WALK_ROWS, LatencyHeads, fit_head


def traces(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Feature rows on the scales a head sees (queue counts, KV share, token counts) and a TPOT that depends
    on them, with some values missing so that the trees learn default directions."""
    rng = np.random.default_rng(seed)
    x = rng.random((n, len(FEATURES))) * np.geomspace(1.0, 2048.0, len(FEATURES))
    tpot = 0.02 + 0.002 * x[:, 0] + 0.01 * x[:, 1] + 1e-6 * x[:, -1] + rng.normal(0, 0.001, n)
    x[rng.random(n) < 0.05, 2] = np.nan
    return x.astype(np.float32), tpot


@pytest.fixture(scope="module")
def booster() -> xgb.Booster:
    x, tpot = traces(3000, 0)
    return fit_head(x, tpot)


def test_the_walk_predicts_what_xgboost_predicts(booster):
    x, _ = traces(2000, 1)
    x[::7, 0] = np.nan  # a feature the head learned no default for is missing too
    ours, theirs = Forest(booster).predict(x), booster.inplace_predict(x)
    assert ours.dtype == np.float32
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert np.unique(theirs).size > 50  # the rows reach many leaves, not one
    for rows in (x[:1], x[:4], x[13:26]):  # the few rows of a decision
        np.testing.assert_allclose(Forest(booster).predict(rows), booster.inplace_predict(rows), rtol=1e-5)


def test_the_heads_answer_through_the_walk_and_keep_their_floor(booster):
    x, _ = traces(50, 2)
    # the floor: never below half the tier's unloaded TPOT, here above every prediction
    top = float(booster.inplace_predict(x).max()) / 1000
    heads = LatencyHeads({"t": booster}, {"t": 4 * top})
    assert np.all(heads.tpot("t", x) == np.float32(2 * top))
    heads = LatencyHeads({"t": booster}, {"t": 0.0})
    assert len(x[:13]) <= WALK_ROWS < len(x)  # the walk answers the few rows, XGBoost the many: the same
    for rows in (x[:13], x):
        np.testing.assert_allclose(heads.tpot("t", rows), booster.inplace_predict(rows) / 1000, rtol=1e-5)
    assert np.isnan(heads.tpot("unknown", x)).all()


def test_a_model_it_cannot_walk_is_refused_at_load():
    rng = np.random.default_rng(0)
    x = rng.random((200, 2))
    two_targets = xgb.train({"tree_method": "hist", "multi_strategy": "one_output_per_tree"},
                            xgb.DMatrix(x, label=np.column_stack([x[:, 0], x[:, 1]])), 3)
    with pytest.raises(ArtefactError, match="single-target"):
        Forest(two_targets)
    linear = xgb.train({"booster": "gblinear"}, xgb.DMatrix(x, label=x[:, 0]), 3)
    with pytest.raises(ArtefactError, match="single-target gbtree"):
        Forest(linear)
