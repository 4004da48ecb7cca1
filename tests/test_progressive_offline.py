"""The progressive study's offline figures (gateway/lab/experiments/progressive_offline.py): sketched share,
inequality (2) and the random / oracle / Eq. 3 picks' quality, on the plans the simulator makes."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.core.progressive import tiers
from gateway.lab.emulator.settings import engine_for
from gateway.lab.experiments.progressive_offline import FIGURES, _plans, offline_rows, per_request, rule_cells
from gateway.lab.experiments.sweeps import configured
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.simulator import run_cell

N = 80


def test_offline_figures_bound_each_other_and_match_the_simulated_cell(small_sim):
    cfg, est, ev = small_sim
    ev = ev.take(N)
    cells = rule_cells(N)
    values, c = per_request(cfg, ev, cells)
    assert 0 < c < 1
    default, anyl = values["default"], values["any length"]
    # Dropping the length test only adds sketches.
    assert np.all(anyl["sketched"] >= default["sketched"]) and anyl["sketched"].mean() > default["sketched"].mean()
    # Inequality (2) by hand for every prompt the any-length rule sketches: the sketch's tokens at most (1 - c) of
    # the 72B's predicted answer, c the slower small model's lone-step decode time over the 72B's.
    tpot = {inst.model: engine_for(cfg, inst).tpot_s for inst in cfg.instances}
    prices = {inst.model: (inst.price_output_per_mtok, inst.price_input_per_mtok) for inst in cfg.instances}
    large, small = tiers(prices, cfg.progressive.candidates)  # the sketching and the expanding models
    assert c == pytest.approx(max(tpot[m] for m in small) / tpot[large])
    col = next(k for k, inst in enumerate(cfg.instances) if inst.model == large)
    plans = _plans(cfg, ev, cells["any length"]).plans
    assert plans
    for r, plan in plans.items():
        assert anyl["ineq2_of_all"][r] == (plan.sketch_tokens <= (1 - c) * ev.length[r, col])
    assert np.isnan(default["ineq2_of_sketched"][default["sketched"] == 0]).all()
    cols = [next(k for k, inst in enumerate(cfg.instances) if inst.model == m) for m in small]
    labels = ev.label_score[:, cols]
    sketched = anyl["sketched"] == 1
    # A random pick's expectation lies between the candidates' labels; Eq. 3 never beats the oracle.
    assert np.all(anyl["quality_random"][sketched] >= labels[sketched].min(axis=1) - 1e-12)
    assert np.all(anyl["quality_random"][sketched] <= labels[sketched].max(axis=1) + 1e-12)
    for v in values.values():
        assert np.all(v["quality"] <= v["quality_oracle"] + 1e-12)
    # With every call served, the Eq. 3 and oracle picks are the simulated cell's own figures.
    for rule, cell in cells.items():
        result = run_cell(configured(cfg, cell.config_changes), ev, cell.spec, est)
        row = summarise(result.outcomes, result.models)
        assert row["refused"] == 0
        assert row["progressive_share"] == pytest.approx(values[rule]["sketched"].mean())
        assert row["quality"] == pytest.approx(values[rule]["quality"].mean())
        assert row["quality_oracle"] == pytest.approx(values[rule]["quality_oracle"].mean())


def test_a_row_per_rule_with_intervals_around_its_figures(small_sim):
    cfg, _, ev = small_sim
    rows = offline_rows(cfg, ev, n=40)
    assert [r["rule"] for r in rows] == ["default", "any length"]
    for row in rows:
        for f in FIGURES:
            assert row[f"{f}_lo"] <= row[f] + 1e-9 and row[f] <= row[f"{f}_hi"] + 1e-9
