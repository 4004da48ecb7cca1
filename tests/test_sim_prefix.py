"""The simulator on prompts that share prefixes: the Mooncake trace and the synthetic multi-turn mix, the gateway's
prefix modes, and `sim --trace FILE --json`."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from conftest import pool_config
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.prefixed_cells import PrefixSource, prefixed_rows
from gateway.lab.sim.simulator import CellSpec, Simulation
from gateway.lab.workload.prefixed import MOONCAKE_TRACE

pytestmark = pytest.mark.skipif(not MOONCAKE_TRACE.is_file(), reason=f"the Mooncake trace is not at {MOONCAKE_TRACE} "
                                "(../shared/data/prefix-traces/ beside the repository)")
SMALL = "Qwen/Qwen2.5-3B-Instruct"


TRACE = PrefixSource("trace")


_CELLS: dict = {}  # cells the tests share, run once


def _cell(small_sim, mode: str, policy: str = "routebalance", source: PrefixSource = TRACE, n: int = 300):
    key = (mode, policy, source, n)
    if key not in _CELLS:
        _CELLS[key] = _run(small_sim, mode, policy, source, n)
    return _CELLS[key]


def _run(small_sim, mode: str, policy: str, source: PrefixSource, n: int):
    cfg, est, ev = small_sim
    spec = CellSpec(policy, requests=n, arrivals=ArrivalSpec(rate=3.0), prefixed=source, prefix_cache=mode,
                    model=SMALL, seed=1)
    sim = Simulation(cfg, ev, spec, est)
    result = sim.run()
    return sim, result, summarise(result.outcomes, result.models)


def test_trace_rows_keep_their_lengths_answers_and_order(small_sim):
    cfg, _, ev = small_sim
    rows = prefixed_rows(PrefixSource("trace"), 400, 4.0, 0, 16, 8192)
    assert len(rows.times) == 400 and (rows.times[1:] >= rows.times[:-1]).all()
    assert rows.times[-1] == pytest.approx(400 / 4.0)  # the cell's mean rate
    assert (rows.prompt_tokens + rows.max_tokens == 8192).all() and (rows.output_tokens <= rows.max_tokens).all()
    # Equal leading trace blocks give equal leading hashes: every row shares the trace's first block.
    assert len({p[:4] for p in rows.prefix}) == 1 and 0.05 < rows.ceiling < 0.5  # reuse grows with the rows
    again = prefixed_rows(PrefixSource("trace"), 400, 4.0, 0, 16, 8192)
    other = prefixed_rows(PrefixSource("trace"), 400, 4.0, 1, 16, 8192)
    assert (again.borrowed == rows.borrowed).all() and (other.borrowed != rows.borrowed).any()


def test_an_agent_run_borrows_one_prompt_and_a_conversation_one_per_turn():
    """Live, the estimators see a chat's last user turn: an agent run's is its task at every step, a
    conversation's a new message each turn."""
    rows = prefixed_rows(PrefixSource("synthetic"), 600, 4.0, 0, 16, 8192)
    by_session: dict[str, list[int]] = {}
    for session, borrowed in zip(rows.session, rows.borrowed.tolist(), strict=True):
        by_session.setdefault(session, []).append(borrowed)
    agents = [b for s, b in by_session.items() if s.startswith("agent") and len(b) > 1]
    talks = [b for s, b in by_session.items() if s.startswith("conversation") and len(b) > 1]
    assert agents and talks
    assert all(len(set(b)) == 1 for b in agents) and all(len(set(b)) == len(b) for b in talks)
    assert len(set(rows.borrowed.tolist())) == len(by_session) + sum(len(b) - 1 for b in talks)


def test_the_cache_term_finds_the_prefixes_and_events_predict_them_exactly(small_sim):
    off_sim, off, off_row = _cell(small_sim, "off")
    approx_sim, approx, approx_row = _cell(small_sim, "approximate")
    events_sim, events, events_row = _cell(small_sim, "events")
    # The engines cache either way; the gateway's knowledge sends turns where their history is: most of what one
    # cache serving everything would hit (the first 300 rows' ceiling is about 9%; the issue asks for 75% of it),
    # where routing blind to the caches finds about 60% of it. (Not all: a turn whose instance has a long prompt
    # pending ahead of it may start sooner elsewhere, the prefill term's queue.)
    ceiling = prefixed_rows(TRACE, 300, 3.0, 1, 16, 8192).ceiling
    assert 0.02 < off_row["prefix_hit_rate"] < 0.8 * ceiling
    assert approx_row["prefix_hit_rate"] > 0.75 * ceiling
    assert approx_row["ttft_mean"] < off_row["ttft_mean"]
    # Predicted against reported cached tokens: the events' index is exact, the approximate one close. (Exact
    # but for races: a request sent right behind one with its prefix counts on blocks still being prefilled.)
    for sim, result, within in ((events_sim, events, 0.98), (approx_sim, approx, 0.9)):
        agree = [abs((t.decision.cached_tokens or 0) - o.cached_tokens) <= 16
                 for t, o in zip(sim.tickets, result.outcomes, strict=True)]
        assert sum(agree) / len(agree) >= within
    assert off_sim.tickets[0].decision.cached_tokens is None  # off: the paper's score, no prediction
    # Every request is the same labelled prompt in every mode: quality differs only by where it was served.
    assert [o.prompt_tokens for o in off.outcomes] == [o.prompt_tokens for o in approx.outcomes]


def test_the_synthetic_multi_turn_mix_runs_every_baseline(small_sim):
    rows = {p: _cell(small_sim, "approximate", p, PrefixSource("synthetic"), 200)[2]
            for p in ("cache_aware", "llmd", "session_affinity")}
    assert all(r["served"] == 200 and r["prefix_hit_rate"] > 0.3 for r in rows.values()), rows


def test_an_answer_cap_asks_for_no_more_and_cuts_every_answer(small_sim):
    """`sim --max-tokens N` replays what a live load test asks for: the trace's rows keep their prompts and
    arrivals, and no request asks for, or gets, more than N answer tokens."""
    cfg, est, ev = small_sim
    capped = Simulation(cfg, ev, CellSpec(requests=60, arrivals=ArrivalSpec(rate=3.0), prefixed=TRACE,
                                          model=SMALL, seed=1, answer_cap=16), est)
    capped.run()
    whole, _, _ = _cell(small_sim, "approximate")
    assert all(t.request.max_tokens == min(16, w.request.max_tokens)
               for t, w in zip(capped.tickets, whole.tickets, strict=False))
    assert max(seq.generated for _, seq in capped.sequences.values()) <= 16
    assert max(seq.generated for _, seq in whole.sequences.values()) > 16


def test_sim_trace_json_prints_one_object_with_the_trace_figures(tmp_path, built):
    config = pool_config(tmp_path, built[0].estimators.models_dir)
    run = subprocess.run([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "sim", "--config",
                          str(config), "--trace", str(MOONCAKE_TRACE), "--requests", "80", "--rate", "3",
                          "--prefix-cache", "approximate", "--json"],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    row = json.loads(run.stdout)  # one JSON object and nothing else
    for key in ("ttft_mean", "ttft_p99", "e2e_p99", "quality", "cost_mean", "prefix_hit_rate"):
        assert isinstance(row[key], float), key
    assert row["requests"] == 80 and row["prompts"] == "trace x0.125" and row["prefix_cache"] == "approximate"
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "sim", "--config", str(config), "--load", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--load needs --trace or --multi-turn" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "sim", "--config", str(config), "--trace",
                          str(MOONCAKE_TRACE), "--load", "0.5", "--max-tokens", "128"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "give --rate with --max-tokens" in bad.stderr


def test_replicas_share_what_they_sent_so_turns_through_another_replica_find_their_instance(small_sim):
    import math

    cfg, est, ev = small_sim

    def row(sync_s: float) -> dict:
        spec = CellSpec("routebalance", requests=500, arrivals=ArrivalSpec(rate=3.0), prefixed=PrefixSource("trace"),
                        model=SMALL, seed=1, replicas=2, sync_interval_s=sync_s)
        result = Simulation(cfg, ev, spec, est).run()
        return summarise(result.outcomes, result.models)

    shared, alone = row(0.25), row(math.inf)  # round robin: a conversation's turns alternate replicas
    one = _cell(small_sim, "approximate", n=500)[2]
    assert shared["prefix_hit_rate"] > alone["prefix_hit_rate"] + 0.02
    assert shared["prefix_hit_rate"] > 0.8 * one["prefix_hit_rate"]


def test_the_floor_is_under_every_served_request_and_its_ceiling_over_every_hit(small_sim):
    """prefix_floor's per-request floor (its gateway wait, then an idle engine holding its ceiling prefix) is never
    above the TTFT the request had, and the ceiling never below what its instance hit."""
    from gateway.lab.experiments.prefix_floor import ceiling_blocks, per_request

    assert ceiling_blocks(((1, 2, 3), (1, 2, 9), (1, 4), (7,))) == [0, 2, 1, 0]
    cfg, _, _ = small_sim
    _, result, summary = _cell(small_sim, "approximate", source=PrefixSource("synthetic"))
    rows = prefixed_rows(PrefixSource("synthetic"), 300, 3.0, 1, cfg.scheduler.prefix_block_tokens,
                         min(i.max_model_len for i in cfg.instances))
    got = per_request(cfg, rows, result)
    served = ~np.isnan(got["ttft"])
    assert served.sum() == summary["served"]
    assert (got["floor"][served] <= got["ttft"][served] + 1e-9).all()
    assert (got["hit"][served] <= got["ceiling"][served] + 1e-9).all()
    assert (got["floor"][served] < got["ttft"][served] - 1e-4).mean() > 0.5  # busy instances: mostly well above it
    assert 0 < np.nanmean(got["hit"]) == pytest.approx(summary["prefix_hit_rate"], rel=1e-6)
