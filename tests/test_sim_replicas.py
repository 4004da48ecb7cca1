"""Scale-out in the simulator (gateway/lab/sim/replicas.py): gateway replicas behind a round-robin balancer that
share their in-flight accounting through a backend, late; one replica is the plain cell."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.core.pool_state import PoolState, Share
from gateway.lab.experiments.plots import plot_sweep
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.replicas import SharedState, replica_of, sharing_mode
from gateway.lab.sim.simulator import CellSpec, Simulation, run_cell

UNIFORM = (1 / 3, 1 / 3, 1 / 3)
INSTANT, NEVER = 0.0, math.inf  # sync intervals: every decision reads the others as they are; never
INSTANCE = (SimpleNamespace(name="a", tpot_prior_ms=20.0),)  # what PoolState.shares reads of a pool's instances


def spec(replicas: int = 3, sync_s: float = 0.25, staleness_s: float = 0.0, rate: float = 24.0, seed: int = 2,
         **kw) -> CellSpec:
    return CellSpec("routebalance", UNIFORM, ArrivalSpec(rate=rate), 300, seed=seed, replicas=replicas,
                    sync_interval_s=sync_s, staleness_s=staleness_s, **kw)


class Probe(Simulation):
    """A cell that notes, at every decision, the view the deciding replica used, what the engines really
    hold, and how old the others' work it counted was."""

    def __init__(self, *args):
        super().__init__(*args)
        self.seen: list[tuple[np.ndarray, np.ndarray, float]] = []

    def view(self, rep, t):
        view = super().view(rep, t)
        truth = np.array([e.num_running + e.num_waiting for e in self.engines], dtype=float)
        self.seen.append((view.in_flight.copy(), truth, self.shared.age(rep.index, t)))
        return view


def probe(small_sim, cell: CellSpec) -> Probe:
    cfg, est, ev = small_sim
    p = Probe(cfg, ev, cell, est)
    p.run()
    return p


# ---- the backend, alone ---------------------------------------------------------------------------

def test_a_publication_reaches_the_others_only_after_the_delay_and_the_latest_replaces_the_last():
    shared = SharedState(3, 0.25, 0.5)
    assert shared.next_tick == [0.0, 0.25 / 3, 0.5 / 3]  # ticks spread over the period
    writer, reader = PoolState(), PoolState()
    writer.of("a").dispatched("r1", 100, 40.0, now=0.0)
    shared.publish(1, writer, INSTANCE, 0.0)
    shared.read(0, reader, 0.49)
    assert reader.of("a").others == Share()  # not there yet
    shared.read(0, reader, 0.5)
    assert reader.of("a").others == Share(1, 100, 40.0)
    assert reader.of("a").state(0.5)[4] == 1  # the view's in-flight column counts it
    assert shared.age(0, 0.7) == pytest.approx(0.7)
    writer.of("a").done("r1")
    shared.publish(1, writer, INSTANCE, 1.0)
    shared.read(0, reader, 1.2)
    assert reader.of("a").others == Share(1, 100, 40.0)  # the newer one is still on its way
    shared.read(0, reader, 1.5)
    assert reader.of("a").others == Share()  # it replaced the last read: nothing there any more


def test_a_replica_that_saw_an_instance_fail_cools_it_down_for_the_others():
    class Rules:
        failure_threshold, cooldown_s, max_cooldown_s = 1, 10.0, 60.0

    shared = SharedState(2, 0.25, 1.0)
    seer, other = PoolState(), PoolState()
    seer.unreachable("a", 0.0, Rules())
    shared.publish(0, seer, INSTANCE, 0.0)
    shared.read(1, other, 1.0)
    assert not other.routable("a", 1.0) and other.routable("a", 10.0)  # cooling until 10 s, as the seer has it
    assert other.of("a").cooling_until == pytest.approx(10.0)


def test_impossible_sharing_is_refused_and_the_balancer_takes_turns():
    with pytest.raises(ValueError):
        spec(sync_s=INSTANT, staleness_s=0.1)  # instant reads have no delay
    with pytest.raises(ValueError):
        spec(replicas=0)
    assert [replica_of(r, 3) for r in range(6)] == [0, 1, 2, 0, 1, 2]
    assert [sharing_mode(r, s) for r, s in ((1, 0.25), (3, 0.0), (3, 0.25), (3, NEVER))] == [
        "single", "instant", "periodic", "none"]


# ---- cells ------------------------------------------------------------------------------------------

def test_one_replica_is_the_single_gateway_cell_whatever_the_sync_settings(small_sim):
    """R = 1 takes no sync tick: the sync knobs change nothing, and it decides as the plain cell does."""
    cfg, est, ev = small_sim
    plain = run_cell(cfg, ev, CellSpec("routebalance", UNIFORM, ArrivalSpec(rate=24.0), 300, seed=2), est)
    for sync_s, staleness_s in ((INSTANT, 0.0), (0.05, 2.0), (NEVER, 0.0)):
        one = run_cell(cfg, ev, spec(1, sync_s, staleness_s), est)
        assert one.outcomes == plain.outcomes and one.batches == plain.batches
        assert math.isnan(one.info_age_s)
    three = run_cell(cfg, ev, spec(3, INSTANT), est)
    assert three.outcomes != plain.outcomes  # three replicas do decide otherwise (three batchers, three scrapes)


def test_with_instant_sharing_every_replica_sees_the_whole_fleets_work_and_without_only_its_own(small_sim):
    shared = probe(small_sim, spec(sync_s=INSTANT))
    assert len(shared.seen) > 250
    for view, truth, age in shared.seen:
        assert np.array_equal(view, truth) and age == 0.0  # what every replica has on each instance, now
    alone = probe(small_sim, spec(sync_s=NEVER))
    views = np.array([v for v, _, _ in alone.seen])
    truths = np.array([t for _, t, _ in alone.seen])
    assert (views <= truths).all()  # its own requests only
    assert 0.2 < views.sum() / truths.sum() < 0.5  # about a third of the fleet's


def test_stale_sharing_counts_the_others_work_as_it_was_delta_to_delta_plus_two_periods_ago(small_sim):
    period, delay = 0.25, 0.5
    p = probe(small_sim, spec(sync_s=period, staleness_s=delay))
    ages = np.array([age for _, _, age in p.seen if not math.isnan(age)])
    assert len(ages) > 0.9 * len(p.seen)  # only the first decisions come before any read
    assert ages.min() >= delay - 1e-9 and ages.max() <= delay + 2 * period + 1e-9
    assert ages.mean() == pytest.approx(delay + period, abs=0.05)
    gaps = [np.abs(v - t).sum() for v, t, _ in p.seen]
    assert np.mean(gaps) > 0  # it is not the fleet as it is


def test_a_delay_longer_than_the_cell_is_no_sharing_at_all(small_sim):
    cfg, est, ev = small_sim
    late = run_cell(cfg, ev, spec(staleness_s=1e6), est)
    none = run_cell(cfg, ev, spec(sync_s=NEVER), est)
    assert late.outcomes == none.outcomes and late.batches == none.batches
    shared = run_cell(cfg, ev, spec(staleness_s=0.0), est)
    assert shared.outcomes != none.outcomes


def test_without_sharing_latency_is_worse_where_requests_queue(small_sim):
    """A small loaded cell: 20% of the prompts are long (3,000 prompt and 1,000 answer tokens) and fill the
    KV caches, so requests wait on their instance and its pending work is what the latency term prices;
    each replica that counts only its own third of it sends too much to the busy instances."""
    cfg, est, ev = small_sim

    def e2e(sync_s: float) -> float:  # the paper's score (the cache term off): what the staleness study measured
        runs = [run_cell(cfg, ev, spec(sync_s=sync_s, rate=12.0, seed=s, mega_share=0.2, prefix_cache="off"), est)
                for s in (0, 1)]
        return float(np.mean([summarise(r.outcomes, r.models)["e2e_mean"] for r in runs]))

    assert e2e(NEVER) > 1.02 * e2e(INSTANT)


# ---- the sweep ----------------------------------------------------------------------------------------

def test_each_staleness_pair_names_one_cell_a_side_and_the_plot_draws_them(tmp_path):
    from gateway.lab.experiments.catalog import PAIRS, SWEEPS
    from gateway.lab.experiments.sweeps import ONE_REPLICA, _identity, _matches

    cells = SWEEPS["staleness"](100)
    rows = [_identity(c) for c in cells]
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    pairs = PAIRS["staleness"](cells)
    assert len(pairs) == sum(c.spec.replicas > 1 for c in cells)
    for pair in pairs:
        assert pair.relative and pair.b["label"] == ONE_REPLICA
        for side in (pair.a, pair.b):
            assert sum(_matches(r, side) for r in rows) == 1, (pair.name, side)
    fake = [{**pair.at, "rate": pair.a["rate"], **{f"{f}_rel{end}": 0.01 * k for f in pair.figures
                                                    for end in ("", "_lo", "_hi")}}
            for k, pair in enumerate(pairs)]
    [png] = plot_sweep("staleness", [], tmp_path, pairs=fake)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
