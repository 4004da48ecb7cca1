"""Progressive mode (PICE) in the simulator: each progressive request is a sketch on the largest tier whose
expansions arrive when it ends, every call through the scheduling loop and paid; the fallback rule sends the
rest through normal routing (gateway/lab/sim/progressive.py)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from gateway.core.progressive import fallback_reason, tiers
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.progressive import PROGRESSIVE
from gateway.lab.sim.simulator import CellSpec, Simulation, run_cell
from gateway.lab.workload.progressive import sketch_points

M72 = "Qwen/Qwen2.5-72B-Instruct"
N = 200


def any_length(cfg):
    """The config with the length rule off: every prompt but code and short facts is sketched."""
    return dataclasses.replace(cfg, progressive=dataclasses.replace(cfg.progressive, min_answer_tokens=0))


def spec(progressive: bool, rate: float = 1.0, model: str | None = M72) -> CellSpec:
    return CellSpec("routebalance", arrivals=ArrivalSpec(rate=rate), requests=N, seed=2, model=model,
                    progressive=progressive)


def test_a_sketch_sends_its_expansions_when_it_ends_and_the_request_ends_with_its_last_point(small_sim):
    cfg, est, ev = small_sim
    cfg = any_length(cfg)
    sim = Simulation(cfg, ev, spec(True), est)
    result = sim.run()
    plans = sim.plans
    assert plans is not None and plans.large == M72 and len(plans.plans) > N // 2
    models = [inst.model for inst in cfg.instances]
    for r, plan in plans.plans.items():
        sketch = sim.sequences[r][1]
        assert models[sim.sequences[r][0]] == M72
        assert len(plan.expansions) == plan.points * cfg.progressive.candidates
        ends = []
        for e in plan.expansions:
            i, seq = sim.sequences[e.row]
            assert models[i] == e.model and e.model in plans.small  # on the cheapest models
            assert sim.outcomes[e.row].arrival == sketch.finish_time  # sent when the sketch ended
            assert seq.arrival >= sketch.finish_time
            ends.append(seq.finish_time)
        out = result.outcomes[r]
        assert out.mode == PROGRESSIVE and out.finished == max(ends)  # the last point ends the answer
        assert out.first_token <= out.finished and out.first_token > sketch.finish_time
    assert len(result.outcomes) == N  # one outcome per client request, whatever its calls


def test_every_call_is_paid_and_the_fallbacks_are_the_rules(small_sim):
    cfg, est, ev = small_sim
    sim = Simulation(cfg, ev, spec(True), est)
    result = sim.run()
    plans = sim.plans
    column = next(k for k, inst in enumerate(cfg.instances) if inst.model == M72)
    for r, mode in enumerate(plans.modes):
        reason = fallback_reason(ev.prompts[r], float(ev.length[r, column]), cfg.progressive.rule())
        points = sketch_points(int(ev.label_length[r, column]), cfg.progressive.max_points)
        expected = reason.value if reason else "few_points" if points < cfg.progressive.min_points else PROGRESSIVE
        assert mode == expected
    by_row = sim.outcomes  # every row's, costed: client requests (sketches) and expansions
    for r, plan in plans.plans.items():
        calls = [by_row[e.row].cost_usd for e in plan.expansions]
        assert all(c > 0 for c in calls)
        assert result.outcomes[r].cost_usd > sum(calls)  # and the sketch
    row = summarise(result.outcomes, result.models)
    assert row["progressive_share"] == pytest.approx(len(plans.plans) / N)
    assert row["progressive_share"] + sum(v for k, v in row.items() if k.startswith("fallback_")) == pytest.approx(1)


def test_progressive_answers_sooner_than_the_72b_alone_and_costs_more(small_sim):
    """At light load, long answers split over parallel small-model calls end sooner than the 72B writing them;
    the calls cost more in all (the sketch, and two candidates per point)."""
    cfg, est, ev = small_sim
    cfg = any_length(cfg)
    cloud = run_cell(cfg, ev, spec(False), est)
    prog = run_cell(cfg, ev, spec(True), est)
    sketched = [r for r, o in enumerate(prog.outcomes) if o.mode == PROGRESSIVE]
    e2e = np.array([[o.finished - o.arrival for o in (cloud.outcomes[r], prog.outcomes[r])] for r in sketched])
    assert np.mean(e2e[:, 1]) < 0.7 * np.mean(e2e[:, 0])
    assert sum(prog.outcomes[r].cost_usd for r in sketched) > sum(cloud.outcomes[r].cost_usd for r in sketched)
    # quality: the labels of the expansions Eq. 3 kept, between the small models' labels; quality_oracle: the
    # oracle pick, the better small model's label; the confidence misses the oracle on some requests
    _, expanders = tiers({i.model: (i.price_output_per_mtok, i.price_input_per_mtok) for i in cfg.instances}, 2)
    small = [next(k for k, inst in enumerate(cfg.instances) if inst.model == m) for m in expanders]
    labels = ev.label_score[:, small]
    for r in sketched:
        q, oracle = prog.outcomes[r].quality, prog.outcomes[r].quality_oracle
        assert labels[r].min() - 1e-12 <= q <= oracle + 1e-12
        assert oracle == pytest.approx(labels[r].max())
    assert any(prog.outcomes[r].quality < prog.outcomes[r].quality_oracle - 1e-9 for r in sketched)
    whole = [r for r, o in enumerate(prog.outcomes) if o.mode != PROGRESSIVE]
    assert whole and all(prog.outcomes[r].quality == cloud.outcomes[r].quality for r in whole)  # the 72B's


@pytest.mark.parametrize(("requests", "rate", "replicas"), [(1, 1.0, 1), (5, 50.0, 1), (40, 50.0, 1), (60, 4.0, 2)])
def test_every_sketch_is_expanded_once_whatever_the_arrivals(small_sim, requests, rate, replicas):
    """Expansions still arrive once every client request has (their rows follow the client requests'), and
    with replicas each goes to its request's replica: every call runs once, none is lost."""
    cfg, est, ev = small_sim
    cell = CellSpec("routebalance", arrivals=ArrivalSpec(rate=rate), requests=requests, seed=1, model=M72,
                    progressive=True, replicas=replicas)
    sim = Simulation(any_length(cfg), ev, cell, est)
    result = sim.run()
    assert sim.plans.plans
    assert set(sim.sequences) == set(range(sim.plans.rows))  # every row ran, each once
    assert not sim.sketching and not sim.spawned
    for r in sim.plans.plans:
        out = result.outcomes[r]
        assert out.mode == PROGRESSIVE and out.instance >= 0 and out.finished >= out.first_token > out.arrival


def test_progressive_cells_refuse_what_they_do_not_model(small_sim):
    with pytest.raises(ValueError, match="progressive"):
        CellSpec("routebalance", budget_share=0.5, progressive=True)
    from gateway.lab.sim.pools import named

    cfg, est, ev = small_sim
    pool_cfg, pool_ev = named("W_A")(cfg, ev)  # models time-sharing GPUs
    with pytest.raises(ValueError, match="GPU per instance"):
        Simulation(pool_cfg, pool_ev, CellSpec("routebalance", requests=20, progressive=True), est)
