"""BEST-Route's off-line routing on a labelled file: cross-fitted picks over the threshold grid, and their table."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.lab.experiments import best_route_offline
from gateway.policies.pipeline.best_route import MatchScorer

MODELS = ("small", "mid", "big")
PRICES = {"small": (1e-7, 2e-7), "mid": (5e-7, 1e-6), "big": (2e-6, 4e-6)}


def world(n: int = 200, seed: int = 0):
    """Two kinds of prompt (basis vectors 0 and 1): on kind A small ties big, on kind B only big is right."""
    rng = np.random.default_rng(seed)
    kind = np.arange(n) % 2
    x = np.zeros((n, 8), dtype=np.float32)
    x[np.arange(n), kind] = 1.0
    x += 0.05 * rng.standard_normal(x.shape).astype(np.float32)
    quality = np.zeros((n, 3))
    quality[:, 2] = 1.0
    quality[kind == 0, 0] = 1.0
    length = np.full((n, 3), 100.0)
    groups = np.array([f"p{i}" for i in range(n)])
    return x, quality, length, np.full(n, 50.0, dtype=np.float32), groups


def test_each_prompt_is_scored_by_a_scorer_that_never_saw_it(monkeypatch):
    x, quality, length, inputs, groups = world()
    fitted: list[set] = []
    real_fit = MatchScorer.fit.__func__

    def recording_fit(cls, xs, *args, **kw):
        fitted.append({bytes(row) for row in np.asarray(xs)})
        return real_fit(cls, xs, *args, **kw)

    monkeypatch.setattr(MatchScorer, "fit", classmethod(recording_fit))
    scored: list[set] = []
    real_predict = MatchScorer.predict

    def recording_predict(self, xs):
        scored.append({bytes(row) for row in np.asarray(xs, dtype=np.float32)})
        return real_predict(self, xs)

    monkeypatch.setattr(MatchScorer, "predict", recording_predict)
    best_route_offline.crossfit_picks(x, quality, length, inputs, MODELS, PRICES, groups, thresholds=(0.5,))
    assert len(fitted) == len(scored) == best_route_offline.FOLDS
    assert all(not (train & test) for train, test in zip(fitted, scored, strict=True))
    assert set().union(*scored) == {bytes(row) for row in x}  # every prompt scored once, in its own fold


def test_the_grid_runs_from_the_reference_to_the_cheapest_model():
    x, quality, length, inputs, groups = world()
    picks = best_route_offline.crossfit_picks(x, quality, length, inputs, MODELS, PRICES, groups,
                                              thresholds=(0.0, 0.5, 1.0))
    kind_a = np.arange(len(x)) % 2 == 0
    assert (picks[0.0] == 2).all()  # nothing but the reference clears a bar of 1
    assert (picks[0.5][kind_a] == 0).mean() > 0.9 and (picks[0.5][~kind_a] == 2).mean() > 0.9
    assert (picks[1.0] == 0).all()  # a bar of 0: the cheapest option


def test_the_table_gives_shares_quality_and_paired_differences():
    x, quality, length, inputs, groups = world()
    picks = best_route_offline.crossfit_picks(x, quality, length, inputs, MODELS, PRICES, groups,
                                              thresholds=(0.0, 0.5))
    cost = length * np.array([p[1] for p in PRICES.values()])
    rows = best_route_offline.rows(picks, quality, cost, MODELS)
    by = {r["threshold"]: r for r in rows}
    assert set(by) == {0.0, 0.5, "always small", "always mid", "always big"}
    assert sum(by[0.5][f"mix_{m}"] for m in MODELS) == pytest.approx(1.0)
    assert by[0.0]["quality"] == pytest.approx(1.0) and by[0.0]["quality_vs_big"] == pytest.approx(0.0)
    assert by[0.5]["quality"] > 0.9  # small only where it ties big
    assert by[0.5]["cost_mean"] < by[0.0]["cost_mean"]
    assert by[0.5]["quality_vs_small"] == pytest.approx(by[0.5]["quality"] - by["always small"]["quality"])
    assert by[0.5]["quality_vs_small_lo"] <= by[0.5]["quality_vs_small"] <= by[0.5]["quality_vs_small_hi"]
