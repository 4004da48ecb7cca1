"""The simulator: arrival processes, cell figures, determinism, agreement with the live stack, sweeps."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import tomllib

import httpx
import numpy as np
import pytest

from conftest import Stack, dump_toml, pool_config, steady, wait_for
from gateway.lab.experiments.plots import plot_sweep
from gateway.lab.experiments.sweeps import (
    _WORKER,
    Cell,
    Pair,
    frontier,
    run_one,
    run_seeded,
    run_sweep,
    write_rows,
    write_sweep,
)
from gateway.lab.sim import evalset
from gateway.lab.sim.arrivals import ArrivalSpec, arrival_times
from gateway.lab.sim.evalset import ComputeCost, cached_cost, load_evalset
from gateway.lab.sim.metrics import HEADLINE, RequestArrays, request_figures, summarise
from gateway.lab.sim.replay import replay
from gateway.lab.sim.simulator import CellSpec, Outcome, run_cell, with_batching
from gateway.lab.sim.stats import bootstrap_many

MODEL_72B = "Qwen/Qwen2.5-72B-Instruct"


# ---- arrivals ------------------------------------------------------------------

def test_poisson_and_gamma_keep_the_mean_rate_and_gamma_is_burstier():
    poisson = np.diff(arrival_times(ArrivalSpec("poisson", 10.0), 20000, seed=1), prepend=0)
    gamma = np.diff(arrival_times(ArrivalSpec("gamma", 10.0, shape=0.25), 20000, seed=1), prepend=0)
    assert poisson.mean() == pytest.approx(0.1, rel=0.03) and gamma.mean() == pytest.approx(0.1, rel=0.05)
    # Coefficient of variation: 1 for exponential gaps, 1/sqrt(k) = 2 for gamma with k = 0.25.
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)
    assert gamma.std() / gamma.mean() == pytest.approx(2.0, rel=0.1)


def test_square_wave_alternates_phase_rates_around_the_mean():
    spec = ArrivalSpec("square", 12.0, low_high=(0.5, 1.5), period_s=10.0)
    t = arrival_times(spec, 12000, seed=3)
    assert len(t) / t[-1] == pytest.approx(12.0, rel=0.05)
    low = np.sum((t % 10.0) < 5.0)
    assert (len(t) - low) / low == pytest.approx(3.0, rel=0.1)  # high phase: three times the low rate


def test_arrivals_repeat_for_a_seed_and_bad_specs_are_refused():
    spec = ArrivalSpec("gamma", 5.0, shape=0.5)
    assert np.array_equal(arrival_times(spec, 100, 7), arrival_times(spec, 100, 7))
    assert not np.array_equal(arrival_times(spec, 100, 7), arrival_times(spec, 100, 8))
    with pytest.raises(ValueError):
        ArrivalSpec("weibull")
    with pytest.raises(ValueError):
        ArrivalSpec(rate=0)


# ---- figures of a cell --------------------------------------------------------------

def test_the_scheduler_compute_is_timed_again_when_the_timed_code_changes(tmp_path, monkeypatch):
    """The simulator charges the compute it timed; kept per build and pool, it must not outlive the code it timed
    (a faster scorer would be charged at the old speed)."""
    timed = []

    def measure(estimators, cfg, prompts):
        timed.append(len(timed))
        return ComputeCost(*(0.001 * (len(timed) + k) for k in range(6)))

    monkeypatch.setattr(evalset, "measure_cost", measure)
    path = tmp_path / "cost-build.json"
    first = cached_cost(path, lambda: None, None, [])
    assert cached_cost(path, lambda: None, None, []) == first and len(timed) == 1  # kept
    monkeypatch.setattr(evalset, "timed_code_digest", lambda: "another-scorer")
    again = cached_cost(path, lambda: None, None, [])
    assert len(timed) == 2 and again != first and len(list(tmp_path.glob("cost-build-*.json"))) == 2


def test_summary_of_hand_made_outcomes():
    models = ("big", "small")
    outcomes = [
        Outcome(0.0, 0, dispatched=0.1, first_token=0.5, finished=2.0, quality=0.6, cost_usd=3e-5),
        Outcome(1.0, 1, dispatched=1.02, first_token=1.2, finished=2.0, quality=0.4, cost_usd=1e-5,
                budget_usd=2e-5, budget_cut=True),
        Outcome(1.5, -1, finished=1.5, budget_usd=1e-9),  # refused: counts as quality 0, no latency
        Outcome(3.0, 1, dispatched=3.03, first_token=3.1, finished=4.0, quality=0.5, cost_usd=1e-5),
    ]
    row = summarise(outcomes, models)
    assert row["served"] == 3 and row["requests"] == 4
    assert row["quality"] == pytest.approx((0.6 + 0.4 + 0 + 0.5) / 4)
    assert row["e2e_mean"] == pytest.approx((2.0 + 1.0 + 1.0) / 3)
    assert row["ttft_mean"] == pytest.approx((0.5 + 0.2 + 0.1) / 3)
    assert row["residual_mean"] == pytest.approx((0.1 + 0.02 + 0.03) / 3)
    assert row["throughput"] == pytest.approx(3 / 4.0)  # 3 served from t=0 to the last answer at 4.0
    assert row["cost_mean"] == pytest.approx(5e-5 / 4)
    assert row["budget_exhaustion"] == 1.0  # one cut short, one refused
    assert row["mix"] == {"big": 0.25, "small": 0.5}
    assert row["e2e_p50"] == pytest.approx(1.0)


# ---- the simulator --------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim(built):
    cfg, _, est = built
    return cfg, est, load_evalset(cfg, 300, estimators=est)


@pytest.mark.parametrize("mode", ["eager", "window"])
def test_a_cell_repeats_exactly_for_its_seed(sim, mode):
    cfg, est, ev = sim
    cfg = with_batching(cfg, mode=mode)
    spec = CellSpec("routebalance", (1 / 3, 1 / 3, 1 / 3), ArrivalSpec(rate=18), 300, seed=4, budget_share=0.3)
    a, b = (run_cell(cfg, ev, spec, est) for _ in range(2))
    assert a.outcomes == b.outcomes and a.batches == b.batches
    other = run_cell(cfg, ev, dataclasses.replace(spec, seed=5), est)
    assert [o.arrival for o in other.outcomes] != [o.arrival for o in a.outcomes]
    assert all(not math.isnan(o.finished) for o in a.outcomes)  # every request ends


def test_presets_and_a_quality_only_router_behave_as_the_paper_says(sim):
    cfg, est, ev = sim

    def cell(policy, weights=(1 / 3, 1 / 3, 1 / 3), model=None):
        r = run_cell(cfg, ev, CellSpec(policy, weights, ArrivalSpec(rate=24.0), 300, model=model), est)
        return summarise(r.outcomes, r.models)

    quality, cost = cell("routebalance", (0.8, 0.1, 0.1)), cell("routebalance", (0.1, 0.1, 0.8))
    assert quality["quality"] > cost["quality"] and quality["cost_mean"] > cost["cost_mean"]
    assert cost["mix"]["Qwen/Qwen2.5-3B-Instruct"] > 0.5
    # Every request on the 72B tier (a quality-only router) queues there; RouteBalance's
    # uniform preset prices that latency in and stays fast.
    always_72b = cell("passthrough+shortest_queue", model=MODEL_72B)
    assert always_72b["mix"][MODEL_72B] == 1.0
    assert cell("routebalance")["e2e_mean"] < 0.5 * always_72b["e2e_mean"]


def test_losing_the_72b_tier_serves_every_request_from_the_rest(sim):
    cfg, est, ev = sim
    r = run_cell(cfg, ev, CellSpec("routebalance", (0.8, 0.1, 0.1), ArrivalSpec(rate=18), 300,
                                   down=(MODEL_72B,)), est)
    row = summarise(r.outcomes, r.models)
    assert row["served"] == 300 and row["mix"][MODEL_72B] == 0.0
    # The policy itself saw the tier down (scrapes mark it): it never ranked a 72B instance first.
    assert r.ranked_down == ()


def test_simulated_and_live_stacks_agree(sim, tmp_path):
    """RouteBalance over one 3B, one 7B and one 14B instance at a load that queues: the
    simulator and the real gateway over the emulator make the same kind of choices and see
    the same decode speed and latency for the same arrivals."""
    cfg, est, _ = sim
    path = pool_config(tmp_path, cfg.estimators.models_dir)
    data = tomllib.loads(path.read_text())
    keep = ("qwen3b-a30-0", "qwen7b-a30-0", "qwen14b-v100-0")
    data["instances"] = [i for i in data["instances"] if i["name"] in keep]
    path.write_text(dump_toml(data))
    stack = Stack(path)
    try:
        live_cfg = stack.store.current
        n, rate = 90, 8.0
        ev = steady(load_evalset(live_cfg, n, estimators=est))  # label columns follow this pool's instances
        spec = CellSpec("routebalance", (1 / 3, 1 / 3, 1 / 3), ArrivalSpec(rate=rate), n, seed=2)
        times = arrival_times(spec.arrivals, n, spec.seed)
        names = {inst.name: k for k, inst in enumerate(live_cfg.instances)}
        outcomes = stack.call(replay(stack.root, ev.prompts, times, "uniform", names), timeout=120)
    finally:
        stack.stop()
    simulated = run_cell(live_cfg, ev, spec, est).outcomes
    for o in outcomes:
        o.quality = 0.0  # not compared here

    def tpot(os):
        return np.mean([(o.finished - o.first_token) / (o.completion_tokens - 1)
                        for o in os if o.completion_tokens > 1])

    models = tuple(i.model for i in live_cfg.instances)
    live_row, sim_row = summarise(outcomes, models), summarise(simulated, models)
    # The tier shares agree within a few requests.
    assert sum(share > 0.1 for share in sim_row["mix"].values()) >= 2  # a real choice was made
    for model, share in sim_row["mix"].items():
        assert live_row["mix"][model] == pytest.approx(share, abs=0.15), model
    assert tpot(outcomes) == pytest.approx(tpot(simulated), rel=0.15)
    # Throughput while the load lasts (completions by the last arrival): the whole run's
    # figure on 90 requests would be decided by whichever long answer finishes last.
    last = float(times[-1])

    def completed(os):
        return sum(o.finished <= last for o in os) / last

    assert completed(outcomes) == pytest.approx(completed(simulated), rel=0.1)
    assert live_row["e2e_mean"] == pytest.approx(sim_row["e2e_mean"], rel=0.25)
    # The same prompt on the same model gives the same answer length, live or simulated.
    same = [(o.completion_tokens, s.completion_tokens) for o, s in zip(outcomes, simulated, strict=True)
            if o.instance == s.instance]
    assert len(same) > n // 3 and all(a == b for a, b in same)


@pytest.mark.parametrize(("policy", "preset"), [("routebalance", "uniform"), ("routebalance", "quality"),
                                                ("passthrough+round_robin", "uniform")])
def test_both_drivers_of_the_loop_make_the_same_decisions(sim, tmp_path, policy, preset):
    """The same prompts, one at a time on an idle pool, through the live server (real time, sockets,
    the emulator) and the simulator (virtual time, the engine model): the same instance every time.
    RouteBalance runs its static-prior arm, whose score depends on the estimates and the pool's
    queues only, so both drivers see the same inputs."""
    cfg, est, _ = sim
    # The cache term off: every prompt shares the chat template's default system turn, so with it each would go
    # where the first went, and the tie-breaks among a tier's idle instances, compared here, would not show.
    path = pool_config(tmp_path, cfg.estimators.models_dir, scheduler={"policy": policy, "prefix_cache": "off"},
                       policies={"routebalance": {"latency_term": "prior"}})
    stack = Stack(path)
    n = 16
    try:
        live_cfg = stack.store.current
        ev = load_evalset(live_cfg, n, estimators=est)
        w = live_cfg.weights(preset)

        def idle() -> bool:
            view = stack.run(stack.gateway.scheduler.scheduling_loop.view, live_cfg, stack.call(_now()))
            return not view.active.any() and not view.in_flight.any()

        live = []
        with httpx.Client(base_url=stack.root, timeout=60) as http:
            for prompt in ev.prompts:
                wait_for(idle, what="an idle pool (completions booked out, fresh scrapes)")
                r = http.post("/v1/chat/completions", headers={"X-Route-Preset": preset}, json={
                    "model": "auto", "messages": [{"role": "user", "content": prompt}], "max_tokens": 16})
                assert r.status_code == 200, r.text
                live.append(r.headers["X-Route-Instance"])
    finally:
        stack.stop()
    # Arrivals 1000 s apart on average: every request finds the simulated pool idle too.
    spec = CellSpec(policy, (w.quality, w.latency, w.cost), ArrivalSpec(rate=0.001), n, seed=3, max_tokens=16)
    simulated = run_cell(live_cfg, ev, spec, est)
    assert [live_cfg.instances[o.instance].name for o in simulated.outcomes] == live
    assert len(set(live)) > 1  # a real choice was made


async def _now() -> float:
    return asyncio.get_running_loop().time()


def test_sweep_workers_reproduce_a_single_process(built, tmp_path):
    """Cells run in spawned worker processes give the very same figures as in this one."""
    cfg = built[0]
    path = pool_config(tmp_path, cfg.estimators.models_dir)
    cells = [c for c in frontier(80, rates=(18,), curve=()) if c.label in ("uniform", "p_w=0.53+round_robin")]
    one = run_sweep(cells, str(path), 80, workers=1)
    two = run_sweep(cells, str(path), 80, workers=2)
    assert json.dumps(one) == json.dumps(two) and len(one) == 2  # dumps: NaN equals NaN there


def test_a_short_sweep_writes_its_table_and_plots(sim, tmp_path):
    cfg, est, ev = sim
    _WORKER.update(cfg=cfg, world=[(ev, est)])  # what run_sweep's worker loading would hold
    try:
        rows = [run_one(c) for c in frontier(120, rates=(12,), curve=())]
    finally:
        _WORKER.clear()
    json_path, csv_path = write_rows(rows, tmp_path, "frontier")
    [png] = plot_sweep("frontier", rows, tmp_path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert len(csv_path.read_text().splitlines()) == len(rows) + 1
    systems = {r["system"] for r in rows}
    assert systems == {"routebalance", "avengers", "best_route", "passthrough", "single_model"}
    by_label = {r["label"]: r for r in rows if r["system"] == "routebalance"}
    assert by_label["quality"]["quality"] > by_label["cost"]["quality"]
    assert all(r["served"] == 120 for r in rows)


# ---- several seeds: means, intervals, paired comparisons ------------------------------------------

def test_per_request_arrays_read_the_figures_summarise_reads(sim):
    """The intervals are taken from compact per-request arrays: their point is the row's own figure."""
    cfg, est, ev = sim
    r = run_cell(cfg, ev, CellSpec("routebalance", (1 / 3, 1 / 3, 1 / 3), ArrivalSpec(rate=24), 300, seed=1,
                                   budget_share=0.5), est)
    row = summarise(r.outcomes, r.models)
    arrays = RequestArrays.of(r.outcomes, r.models)
    assert row["budget_exhaustion"] > 0 and set(arrays.tiers) == set(row["mix"])
    for name, interval in bootstrap_many(request_figures([arrays]), replicates=100).items():
        assert interval.mean == pytest.approx(row[name]), name


def test_a_multi_seed_sweep_writes_intervals_and_paired_differences(built, tmp_path):
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    arr, n = ArrivalSpec(rate=18), 200
    cells = [Cell("routebalance", "uniform", CellSpec("routebalance", (1 / 3, 1 / 3, 1 / 3), arr, n)),
             Cell("routebalance", "quality", CellSpec("routebalance", (0.8, 0.1, 0.1), arr, n)),
             Cell("passthrough", "round_robin", CellSpec("passthrough+round_robin", arrivals=arr, requests=n))]
    pairs = [Pair("quality vs uniform", {"label": "quality"}, {"label": "uniform"}),
             Pair("best RouteBalance vs passthrough", {"system": "routebalance"}, {"system": "passthrough"})]
    result = run_seeded(cells, str(path), 300, seeds=2, workers=1, pairs=pairs)  # 300: the `sim` fixture's cache

    assert [(r["system"], r["label"], r["seeds"]) for r in result.rows] == [(c.system, c.label, 2) for c in cells]
    for row in result.rows:
        for name in HEADLINE:
            if name in ("slo_attainment", "qos"):  # no SLOs in these cells: no figure, no interval
                assert math.isnan(row[name]) and f"{name}_lo" not in row
                continue
            assert row[f"{name}_lo"] <= row[name] <= row[f"{name}_hi"], (row["label"], name)
        assert row["refused"] == 0.0 and row["served"] == n
    # Each row is the mean of its two runs, and the seeds really differ.
    seeds = [r for r in result.seed_rows if r["label"] == "uniform"]
    assert [r["seed"] for r in seeds] == [0, 1] and seeds[0]["e2e_mean"] != seeds[1]["e2e_mean"]
    assert result.rows[0]["e2e_mean"] == pytest.approx((seeds[0]["e2e_mean"] + seeds[1]["e2e_mean"]) / 2)

    by_name = {p["pair"]: p for p in result.pairs}
    assert by_name["best RouteBalance vs passthrough"]["a"] == "routebalance quality"  # the family's best
    for p in result.pairs:
        for name in ("quality", "e2e_mean"):
            assert p[f"{name}_diff"] == pytest.approx(p[f"a_{name}"] - p[f"b_{name}"])
            assert p[f"{name}_diff_lo"] <= p[f"{name}_diff"] <= p[f"{name}_diff_hi"]
    assert by_name["quality vs uniform"]["quality_diff_lo"] > 0  # the quality preset buys quality

    paths = {p.name: p for p in write_sweep(result, tmp_path, "mini")}
    assert set(paths) == {"mini.json", "mini.csv", "mini_pairs.json", "mini_pairs.csv", "mini_seeds.csv"}
    assert len(paths["mini.csv"].read_text().splitlines()) == len(cells) + 1
    assert len(paths["mini_pairs.csv"].read_text().splitlines()) == len(pairs) + 1
    assert len(paths["mini_seeds.csv"].read_text().splitlines()) == 2 * len(cells) + 1
    assert "quality_lo" in paths["mini.csv"].read_text().splitlines()[0]


def test_a_pair_must_compare_cells_on_the_same_arrivals(built, tmp_path):
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    cells = [Cell("passthrough", "round_robin", CellSpec("passthrough+round_robin", arrivals=ArrivalSpec(rate=r),
                                                         requests=40)) for r in (6, 12)]
    with pytest.raises(ValueError, match="different arrivals"):
        run_seeded(cells, str(path), 300, workers=1, pairs=[Pair("6 vs 12", {"rate": 6}, {"rate": 12})])


def test_the_printed_table_tells_apart_cells_that_share_a_label():
    from gateway.lab.experiments import qos_eval, slo_sweeps
    from gateway.lab.experiments.sweeps import _identity
    from gateway.lab.experiments.tables import format_rows

    fields = {"quality": 0.4, "e2e_mean": 2.0, "e2e_p99": 9.0, "throughput": 4.0, "cost_mean": 1e-5,
              "residual_mean": 0.02}
    for cells in (qos_eval.qos_cells(100), slo_sweeps.qlm(100), slo_sweeps.qlm_multi(100)):
        rows = [{**_identity(c), **fields} for c in cells]
        shown = [line[13:64] for line in format_rows(rows).split("\n")[1:]]
        keyed = {(r["label"], r.get("workload"), r.get("n"), r.get("tpot_slo_ms"), r.get("tail"), r["arrivals"],
                  r["rate"]) for r in rows}
        # Every distinct cell gets a distinct (label, rate) line: no two rows print alike.
        assert len({(s, r["rate"]) for s, r in zip(shown, rows, strict=True)}) == len(keyed), shown
