"""The continuous-batching instance model, in virtual time."""

from __future__ import annotations

import random
import statistics
from dataclasses import replace

import pytest

from gateway.config.store import default_config_path, load_config
from gateway.core.engine.engine import Engine
from gateway.core.engine.profiles import spec_for_instance as spec_of

TIERS = {}
for _inst in load_config(default_config_path()).instances:
    TIERS.setdefault(_inst.model, _inst)


def run_poisson(spec, rate: float, n: int, output_tokens: int, seed: int = 1):
    engine = Engine(spec)
    rng = random.Random(seed)
    t, done = 0.0, []
    for i in range(n):
        t += rng.expovariate(rate)
        done += engine.advance(t).finished
        engine.add(i, prompt_tokens=85, max_tokens=1024, output_tokens=output_tokens, now=t)
    done += engine.advance(t + 1e5).finished
    assert len(done) == n
    e2e = statistics.mean(s.finish_time - s.arrival for s in done)
    queue = statistics.mean(s.first_scheduled - s.arrival for s in done)
    throughput = n / (max(s.finish_time for s in done) - min(s.arrival for s in done))
    return e2e, queue, throughput


@pytest.mark.parametrize("model", sorted(TIERS))
def test_tpot_at_batch_one_equals_the_configured_prior(model):
    inst = TIERS[model]
    engine = Engine(spec_of(inst))
    engine.add("r", prompt_tokens=85, max_tokens=500, output_tokens=200, now=0.0)
    report = engine.advance(1e3)
    (seq,) = report.finished
    tpot = (seq.finish_time - seq.first_token_time) / (seq.generated - 1)
    assert seq.generated == 200 and seq.finish_reason == "stop"
    assert tpot == pytest.approx(inst.tpot_prior_ms / 1000, rel=0.005)
    assert 0 < seq.first_token_time < 0.2  # prefill of 85 tokens is one short step


def test_throughput_saturates_and_queueing_appears_as_load_rises():
    spec = spec_of(TIERS["Qwen/Qwen2.5-72B-Instruct"])
    results = {rate: run_poisson(spec, rate, 600, output_tokens=50) for rate in (1, 4, 16, 32)}
    e2e = {r: v[0] for r, v in results.items()}
    thr = {r: v[2] for r, v in results.items()}
    # Light load is served at near the batch-1 latency; latency grows with load.
    assert e2e[1] < 50 * 0.0474 * 1.3
    assert e2e[1] < e2e[4] < e2e[16] < e2e[32]
    # Throughput follows the offered rate until the ceiling, then stays flat.
    assert thr[4] == pytest.approx(4, rel=0.2)
    assert thr[32] < 16 and thr[32] == pytest.approx(thr[16], rel=0.15)
    # Past the ceiling, requests wait in the queue: max_num_seqs is full.
    assert results[32][1] > 5.0 and results[1][1] < 0.1


def test_kv_pressure_preempts_by_recompute_and_everything_still_finishes():
    spec = replace(spec_of(TIERS["Qwen/Qwen2.5-7B-Instruct"]), num_gpu_blocks=600)  # 9,600 tokens of KV
    engine = Engine(spec)
    for i in range(20):
        engine.add(i, prompt_tokens=400, max_tokens=1000, output_tokens=600, now=0.0)
    preemptions, finished, peak = 0, [], 0.0
    t = 0.0
    while engine.busy:
        t += 0.05
        report = engine.advance(t)
        preemptions += report.preemptions
        finished += report.finished
        peak = max(peak, engine.kv_usage())
        assert engine.blocks_used() <= spec.num_gpu_blocks
    assert preemptions > 0
    assert peak > 0.9
    assert sorted(s.rid for s in finished) == list(range(20))
    assert all(s.generated == 600 for s in finished)
    assert any(s.preemptions for s in finished)


def test_max_tokens_cuts_the_answer_with_finish_reason_length():
    engine = Engine(spec_of(TIERS["Qwen/Qwen2.5-3B-Instruct"]))
    engine.add("short", prompt_tokens=10, max_tokens=7, output_tokens=300, now=0.0)
    engine.add("full", prompt_tokens=10, max_tokens=300, output_tokens=12, now=0.0)
    done = {s.rid: s for s in engine.advance(100).finished}
    assert (done["short"].generated, done["short"].finish_reason) == (7, "length")
    assert (done["full"].generated, done["full"].finish_reason) == (12, "stop")


def test_abort_frees_the_slot_and_the_cache():
    engine = Engine(spec_of(TIERS["Qwen/Qwen2.5-14B-Instruct"]))
    engine.add("a", prompt_tokens=100, max_tokens=1000, output_tokens=1000, now=0.0)
    engine.advance(1.0)
    assert engine.num_running == 1 and engine.blocks_used() > 0
    seq = engine.abort("a", 1.0)
    assert seq.finish_reason == "abort"
    assert engine.num_running == 0 and engine.blocks_used() == 0 and not engine.busy
    assert engine.abort("a", 1.0) is None


def test_requests_longer_than_the_context_are_refused():
    engine = Engine(spec_of(TIERS["Qwen/Qwen2.5-3B-Instruct"]))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add("x", prompt_tokens=8000, max_tokens=500, output_tokens=10, now=0.0)


def test_arrivals_after_a_step_started_wait_for_the_next_step():
    engine = Engine(spec_of(TIERS["Qwen/Qwen2.5-72B-Instruct"]))
    engine.add("a", prompt_tokens=50, max_tokens=100, output_tokens=100, now=0.0)
    first_end = engine.next_step_end()
    engine.add("b", prompt_tokens=50, max_tokens=100, output_tokens=100, now=first_end / 2)
    engine.advance(first_end)
    assert engine.get("a").generated == 1 and engine.get("b").generated == 0



