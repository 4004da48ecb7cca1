"""Several models on one GPU (the simulator's model swapping and warm start)."""

from __future__ import annotations

import dataclasses
import math

import pytest

from gateway.config.store import default_config_path, load_config
from gateway.core.engine.engine import Engine
from gateway.core.engine.profiles import load_seconds, spec_for_instance
from gateway.core.engine.shared_gpu import SharedGpu

SEVEN_B = next(i for i in load_config(default_config_path()).instances if "7B" in i.model)
SPEC = spec_for_instance(SEVEN_B)
WARM, COLD = load_seconds(SEVEN_B.model)


def gpu(members: int = 2, host_slots: int = 2) -> SharedGpu:
    return SharedGpu({m: Engine(SPEC) for m in range(members)}, {m: (WARM, COLD) for m in range(members)},
                     host_slots)


def add(g: SharedGpu, member: int, rid, now: float, tokens: int = 50):
    g.advance(now)
    return g.engines[member].add(rid, prompt_tokens=100, max_tokens=500, output_tokens=tokens, now=now)


def test_load_times_follow_the_weights_and_the_links():
    warm, cold = load_seconds("Qwen/Qwen2.5-7B-Instruct")
    assert 0.4 < warm < 1.0 and 6.0 < cold < 10.0  # 15 GB over PCIe, and from storage first
    warm72, cold72 = load_seconds("Qwen/Qwen2.5-72B-Instruct", gpu_count=4)
    assert warm72 > warm and cold72 > cold  # 145 GB, even over four links


def test_one_member_runs_exactly_as_its_engine_alone():
    alone, shared = Engine(SPEC), gpu(1)
    for k in range(20):
        alone.advance(k * 0.3)
        alone.add(k, prompt_tokens=100, max_tokens=500, output_tokens=40 + k, now=k * 0.3)
        add(shared, 0, k, k * 0.3, 40 + k)
    alone.advance(math.inf)
    shared.advance(math.inf)
    assert shared.swaps == 0
    assert [alone.get(k) for k in range(20)] == [None] * 20
    # Both finished everything at the same times (the engine forgets finished sequences, so compare clocks).
    assert shared.engines[0].last_step_end == pytest.approx(alone.last_step_end)


def test_another_model_waits_for_the_drain_and_a_cold_load():
    g = gpu()
    a = add(g, 0, "a", 0.0, tokens=100)
    b = add(g, 1, "b", 0.1, tokens=10)
    g.advance(math.inf)
    assert g.swaps == 1 and g.swap_s == pytest.approx(COLD)
    assert b.first_scheduled == pytest.approx(a.finish_time + COLD)


def test_first_come_first_served_across_models_swaps_back_and_forth():
    g = gpu()
    a1 = add(g, 0, "a1", 0.0, tokens=100)
    b1 = add(g, 1, "b1", 0.1, tokens=10)
    a2 = add(g, 0, "a2", 0.2, tokens=10)  # arrived after b1: not admitted beside a1, though it would fit
    g.advance(math.inf)
    assert b1.first_scheduled > a1.finish_time
    assert a2.first_scheduled == pytest.approx(b1.finish_time + COLD)
    assert g.swaps == 2


def test_one_models_requests_in_a_row_swap_once():
    g = gpu()
    b = [add(g, 1, f"b{k}", 0.01 * k, tokens=10) for k in range(5)]
    g.advance(math.inf)
    assert g.swaps == 1
    assert max(s.first_scheduled for s in b) == pytest.approx(COLD)  # all five batched after the one load


def test_warm_start_loads_from_host_memory_once_the_read_is_done():
    g = gpu(3)
    g.warm([1], 0.0)  # read from storage in the background: in host memory at COLD - WARM
    b = add(g, 1, "b", COLD, tokens=10)
    g.advance(math.inf)
    assert g.swap_s == pytest.approx(WARM)
    assert b.first_scheduled == pytest.approx(COLD + WARM)


def test_a_load_waits_for_a_read_still_under_way_and_host_memory_is_bounded():
    g = gpu(3, host_slots=1)
    g.warm([1, 2], 0.0)  # only the first fits
    assert set(g.warm_at) == {1}
    add(g, 1, "b", 1.0, tokens=10)
    g.advance(math.inf)
    assert g.swap_s == pytest.approx(COLD - WARM - 1.0 + WARM)  # the rest of the read, then the copy
    g.warm([2], 100.0)  # 1 is dropped to make room
    assert set(g.warm_at) == {2}


def test_a_request_swapped_out_resumes_where_it_stopped_at_the_link_speed():
    assert SPEC.kv_swap_s_per_token < SPEC.prefill_s_per_token / 10  # on this pool, copying beats recomputing
    engine = Engine(SPEC)
    seq = engine.add("r", prompt_tokens=2000, max_tokens=500, output_tokens=100, now=0.0)
    engine.advance(1.0)
    done_tokens, context = seq.generated, seq.computed
    assert 0 < done_tokens < 100
    assert engine.swap_out("r", 1.0) is seq and engine.kv_usage() == 0.0 and not engine.busy
    engine.swap_in("r", 5.0)
    report = engine.advance(5.0 + SPEC.tpot_s * 2 + SPEC.kv_swap_s_per_token * context)
    assert report.prompt_tokens == 0  # nothing recomputed
    assert seq.generated == done_tokens + 1  # the next token of the same answer
    engine.advance(math.inf)
    assert seq.finish_reason == "stop" and seq.generated == 100


def test_host_memory_bounds_what_can_be_swapped_out():
    engine = Engine(SPEC)
    engine.add("big", prompt_tokens=4000, max_tokens=100, output_tokens=50, now=0.0)
    engine.advance(1.0)
    tight = Engine(dataclasses.replace(SPEC, host_kv_tokens=1000))
    tight.add("big", prompt_tokens=4000, max_tokens=100, output_tokens=50, now=0.0)
    tight.advance(1.0)
    assert engine.swap_out("big", 1.0) is not None
    assert tight.swap_out("big", 1.0) is None and tight.busy  # no room: left running, the caller aborts it
