"""QoS-aware routing (papers/qos-aware-edge-routing.txt): the action-impact estimator, the `qos` heuristic's
choices and drops, a simulated cell against round robin, and live requests through the openai SDK."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import openai
import pytest

from conftest import three_tier_qos_cell
from gateway.config.store import default_config_path, load_config
from gateway.core.engine.engine import Engine, EngineSpec
from gateway.core.loop import SchedulingLoop
from gateway.core.pool_state import PoolState
from gateway.core.request import Completion, DispatchPlan, Estimates, RouteRequest, Ticket
from gateway.lab.experiments.qos_eval import bench_decisions, qos_cells, qos_pairs
from gateway.lab.sim.pools import pool_names
from gateway.policies import registry
from gateway.policies.qos.impact import Load, RunningArrays, StepCurves, added_seconds, assess, impact_per_token
from gateway.policies.qos.policy import Qos, QosOptions

SPEC = EngineSpec(tpot_s=0.02, batch_slope=0.05, kv_read_per_token=1e-4, prefill_s_per_token=1e-3, max_num_seqs=8,
                  max_num_batched_tokens=2048, max_model_len=4096, block_size=16, num_gpu_blocks=1000)


# ---- the action-impact estimator ---------------------------------------------------------------

def test_impact_of_one_admission_on_a_hand_checked_case():
    curves = StepCurves.of([SPEC])
    idx = np.array([0, 0])
    # New request: 100 prompt tokens, 50 answer tokens. RunningArrays: one with 30 tokens to go (of 60), one with 80
    # (of 100). The first shares its 30 remaining steps with it, the second all 50 of the new one's.
    added = added_seconds(curves, idx, 100.0, 50.0, np.array([30.0, 80.0]))
    by_hand = [1e-3 * 100 + 0.02 * (30 * 0.05 + 1e-4 * (30 * 100 + 30 * 31 / 2)),  # 0.1 + 0.03693
               1e-3 * 100 + 0.02 * (50 * 0.05 + 1e-4 * (50 * 100 + 50 * 51 / 2))]  # 0.1 + 0.06255
    assert added == pytest.approx(by_hand)
    assert added == pytest.approx([0.13693, 0.16255])
    per_token = impact_per_token(curves, idx, 100.0, 50.0, np.array([30.0, 80.0]), np.array([60.0, 100.0]))
    assert per_token == pytest.approx([0.13693 / 60, 0.16255 / 100])


def _run_to(engine: Engine, rid, tokens: int) -> float:
    """Advance the engine step by step until request `rid` has `tokens` answer tokens; the time then."""
    while engine.get(rid).generated < tokens:
        engine.advance(engine.next_step_end())
    return engine.clock


def _finish(engine: Engine, rid) -> float:
    seq = engine.get(rid)
    engine.advance(math.inf)
    return seq.finish_time


def test_the_estimate_agrees_with_the_engine_model_it_is_drawn_from():
    alone, shared = Engine(SPEC), Engine(SPEC)
    for e in (alone, shared):
        e.add("i", prompt_tokens=50, max_tokens=60, output_tokens=60, now=0.0)
    t = _run_to(alone, "i", 30)
    assert _run_to(shared, "i", 30) == t
    shared.add("j", prompt_tokens=100, max_tokens=50, output_tokens=50, now=t)
    slowdown = _finish(shared, "i") - _finish(alone, "i")
    estimate = added_seconds(StepCurves.of([SPEC]), np.array([0]), 100.0, 50.0, np.array([30.0]))[0]
    assert slowdown > 0.1  # the prefill alone costs 0.1 s
    assert estimate == pytest.approx(slowdown, rel=0.01)  # the estimate counts j's context one token ahead


def test_assess_sees_who_would_cross_their_bound():
    curves = StepCurves.of([SPEC, SPEC])
    # Two requests on instance 0, 40 tokens out of 100 after 0.85 s: at 5 sequences' step time each would end
    # at (0.85 + 60 x step) / 100; the bound sits just above that, so the new request pushes them over.
    load = Load(running=np.array([5.0, 0.0]), waiting=np.zeros(2), kv_tokens=np.array([500.0, 0.0]))
    step0 = curves.step_s(np.array([5.0]), np.array([500.0]))[0]
    projected = (0.85 + 60 * step0) / 100
    bound = projected * 1.01
    running = RunningArrays(np.array([0, 0]), np.array([50.0, 50.0]), np.array([100.0, 100.0]), np.array([40.0, 40.0]),
                      np.array([0.85, 0.85]), np.array([0.5, 0.4]), np.array([bound, bound]))
    a = assess(curves, load, running, 200.0, np.array([100.0, 100.0]), bound, width=0.05)
    assert a.projected_s == pytest.approx([projected, projected])
    assert (a.projected_s + a.impact_s > bound).all()
    assert a.violations == pytest.approx([0.9, 0.0]) and a.flips == pytest.approx([0.9, 0.0])
    assert a.loss[0] > 0.2 and a.loss[1] == 0.0
    assert a.tpot_s[1] < a.tpot_s[0]  # the idle instance is faster for the new request too


# ---- the heuristic's choices -------------------------------------------------------------------------

MODEL_7B = "Qwen/Qwen2.5-7B-Instruct"


@pytest.fixture(scope="module")
def two_7b():
    """The default config cut to two 7B instances (same tier: only their load and the estimates differ)."""
    cfg = load_config(default_config_path())
    pair = tuple(i for i in cfg.instances if i.model == MODEL_7B)[:2]
    return dataclasses.replace(cfg, instances=pair)


def _request(tpot_slo_s: float, candidates=(0, 1), prompt_tokens: int = 50) -> RouteRequest:
    return RouteRequest(candidates, "a prompt", prompt_tokens, 1024, (1 / 3, 1 / 3, 1 / 3), policy="qos",
                        tpot_slo_s=tpot_slo_s)


def _estimates(quality, length, rows: int = 1) -> Estimates:
    return Estimates(np.tile(np.array(quality, dtype=float), (rows, 1)),
                     np.tile(np.array(length, dtype=float), (rows, 1)))


def _load_instance_0(policy: Qos, cfg, pool_state: PoolState, bound: float, now: float) -> None:
    """Ten requests on instance 0 (only candidate), sent at 0, half of their 200 tokens back at `now`."""
    batch = [_request(bound, candidates=(0,)) for _ in range(10)]
    view = pool_state.snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
    for req, d in zip(batch, policy.assign(batch, _estimates([0.6, 0.5], [200, 200], 10), view), strict=True):
        assert d.ranked == (0,)
        ticket = Ticket(req, "", True, cfg, arrived=0.0)
        policy.on_dispatch(ticket, DispatchPlan(0, 1024, False), 0.0)
        policy.on_first_token(ticket, 0.1)
        policy.on_progress(ticket, 100, now)
        pool_state.of(cfg.instances[0].name).dispatched(ticket, 50, 200.0, 0.0)


def test_qos_prefers_an_idle_instance_over_one_whose_running_requests_would_cross_their_bound(two_7b):
    cfg = two_7b
    bound = 0.030
    # Instance 0 is predicted the better answer (0.6 vs 0.5): on an idle pool it wins.
    fresh = Qos(QosOptions())
    idle = PoolState().snapshot(cfg.instances, 3.0, cfg.telemetry.stale_after_s)
    assert fresh.assign([_request(bound)], _estimates([0.6, 0.5], [200, 200]), idle)[0].ranked == (0, 1)
    # Ten requests already run there, due to end just under the aimed-at bound (95% of 30 ms per token:
    # (3.1 s + 100 tokens at ~25 ms) / 200). The new one would meet its own bound there too, but would push
    # them over theirs: it goes to the idle instance.
    policy, pool_state = Qos(QosOptions()), PoolState()
    _load_instance_0(policy, cfg, pool_state, bound, now=3.1)
    view = pool_state.snapshot(cfg.instances, 3.1, cfg.telemetry.stale_after_s)
    assert view.running[0] == 10 and view.running[1] == 0
    d = policy.assign([_request(bound)], _estimates([0.6, 0.5], [200, 200]), view)[0]
    assert d.refused is None and d.ranked == (1, 0)
    assert len(policy.tracker) == 11
    # Early in their answers (less waited so far) the same ten have room to spare: the better instance wins.
    policy, pool_state = Qos(QosOptions()), PoolState()
    _load_instance_0(policy, cfg, pool_state, bound, now=1.0)
    view = pool_state.snapshot(cfg.instances, 1.0, cfg.telemetry.stale_after_s)
    assert policy.assign([_request(bound)], _estimates([0.6, 0.5], [200, 200]), view)[0].ranked[0] == 0


def test_qos_drops_what_no_instance_can_serve_within_its_bound(two_7b):
    cfg = two_7b
    view = PoolState().snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
    policy = Qos(QosOptions())
    # 10 ms per token is below the 7B tier's lone-sequence TPOT (20.6 ms): nowhere in time.
    d = policy.assign([_request(0.010)], _estimates([0.6, 0.5], [200, 200]), view)[0]
    assert d.ranked == () and d.refused is not None
    assert (d.refused.status, d.refused.reason, d.refused.code) == (503, "qos_drop", "qos_drop")
    assert "10 ms" in d.refused.message and len(policy.tracker) == 0
    # A request with no bound of its own gets the table's (50 ms): served.
    served = policy.assign([_request(None)], _estimates([0.6, 0.5], [200, 200]), view)[0]  # type: ignore[arg-type]
    assert served.refused is None and served.ranked[0] == 0
    # With dropping off it is served anyway, on the instance closest to its bound.
    keep = Qos(QosOptions(drop=False))
    assert keep.assign([_request(0.010)], _estimates([0.6, 0.5], [200, 200]), view)[0].refused is None


def test_the_tracker_follows_the_lifecycle_and_forgets_completed_requests(two_7b):
    cfg = two_7b
    policy = Qos(QosOptions())
    view = PoolState().snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
    req = _request(0.05)
    d = policy.assign([req], _estimates([0.6, 0.5], [120, 80]), view)[0]
    ticket = Ticket(req, "", True, cfg, arrived=0.0)
    other = 1 - d.ranked[0]
    policy.on_dispatch(ticket, DispatchPlan(other, 1024, False), 0.01)  # the first choice failed: a retry
    entry = policy.tracker.get(id(req))
    assert entry.instance == other and entry.total == [120, 80][other]
    policy.on_progress(ticket, 7, 0.5)
    assert entry.generated == 7
    policy.on_complete(ticket, Completion(True, other, 9), 0.6)
    assert len(policy.tracker) == 0


def test_a_request_abandoned_while_its_batch_was_decided_leaves_no_trace(two_7b):
    """Its client left (or its wait ran out) while `assign` ran: never settled, the policy still hears it is
    over, so the tracker does not count it as running for the next hour."""
    cfg = dataclasses.replace(two_7b, scheduler=dataclasses.replace(two_7b.scheduler, policy="qos"))
    # The batch's estimates come from the test, so the loop needs no estimators of its own (only some).
    scheduling = SchedulingLoop(registry, PoolState(), max_queue=8, resolve=lambda _cfg, _model: (0, 1),
                                estimators=object())
    tickets = [Ticket(_request(0.05), "auto", True, cfg) for _ in range(3)]
    for k, t in enumerate(tickets):
        scheduling.submit(t, float(k))
    batch, _ = scheduling.take(cfg, None, 3.0)
    decided = scheduling.decide(cfg, batch, scheduling.view(cfg, 3.0),
                                lambda ts, blind: _estimates([0.6, 0.5], [200, 200], len(ts)))
    policy = decided[0][1]
    assert isinstance(policy, Qos) and len(policy.tracker) == 3
    for ticket, (_, by) in zip(batch, decided, strict=True):
        scheduling.withdraw(ticket, 3.5)  # what the live scheduler does when the client leaves mid-decision ...
        scheduling.abandoned(ticket, by, 4.0)  # ... and, once the batch is back, for each such ticket
    assert len(policy.tracker) == 0 and not scheduling.held


def test_the_registry_builds_qos_from_its_table(two_7b):
    cfg = two_7b.with_options("qos", tpot_slo_ms=80.0, headroom=0.0)
    policy = registry.build("qos", cfg)
    assert isinstance(policy, Qos) and policy.default_bound_s == pytest.approx(0.08) and policy.needs_estimates
    with pytest.raises(Exception, match="width"):
        cfg.with_options("qos", width=0.0)


# ---- in the simulator -----------------------------------------------------------------------------------

def test_a_simulated_cell_qos_beats_round_robin_where_it_matters(small_sim):
    """Three instances (72B, 14B, 7B) at 12 req/s and L = 50 ms: round robin sends a third of the
    requests to the 72B tier, whose time per token (47.4 ms alone) crosses L under load."""
    qos, rr = three_tier_qos_cell(small_sim, "qos"), three_tier_qos_cell(small_sim, "passthrough+round_robin")
    assert qos["qos"] > rr["qos"] + 0.05, (qos["qos"], rr["qos"])
    assert qos["tpot_mean"] < rr["tpot_mean"]
    assert qos["served"] >= 0.9 * qos["requests"]  # it wins by placing requests well, not by dropping them


def test_the_comparison_cells_and_pairs(built):
    cfg = built[0]
    assert pool_names(cfg.instances, 3) == ("qwen72b-a100-0", "qwen14b-v100-0", "qwen7b-a30-0")
    assert len(set(pool_names(cfg.instances, 12))) == 12
    cells = qos_cells(100, cfg, sizes=(3, 6), bounds_ms=(30.0, 50.0))
    systems = {c.spec.policy for c in cells}
    assert {"qos", "qos-rl", "passthrough+round_robin", "passthrough+shortest_queue", "routebalance"} == systems
    assert {c.spec.arrivals.kind for c in cells} == {"poisson", "gamma"}
    assert {c.tags["n"] for c in cells} == {3, 6}
    pairs = qos_pairs(cells)
    assert any(p.name.startswith("qos vs round_robin, N=3") for p in pairs)
    assert any(p.name.startswith("qos-rl vs qos") for p in pairs)


def test_bench_decisions_times_the_policy(small_sim):
    cfg, _, ev = small_sim
    row = bench_decisions(registry.build("qos", cfg), cfg, ev, tracked=30, batches=20)
    assert 0 < row["per_request_s"] < 0.05  # the target is 5 ms; this is only a sanity bound


# ---- live, through the openai SDK ---------------------------------------------------------------------

@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0)
    yield c
    c.close()


def _qos_policy(stack):
    cfg = stack.store.current
    return stack.run(lambda: stack.gateway.scheduler.scheduling_loop.policies(cfg).get("qos"))


def test_live_requests_choose_qos_streaming_and_not(client, stack):
    prompt = [{"role": "user", "content": "Name three rivers in Europe."}]
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=prompt, max_tokens=12, extra_body={"routing": {"policy": "qos", "tpot_slo_ms": 200}})
    resp = raw.parse()
    assert resp.choices[0].message.content and resp.usage.completion_tokens <= 12
    assert raw.headers["X-Route-Model"] == resp.model
    assert resp.usage.model_extra.get("tpot_slo_met") in (True, False)
    stream = client.chat.completions.create(
        model="auto", messages=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True},
        extra_body={"routing": {"policy": "qos"}})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    policy = _qos_policy(stack)
    assert isinstance(policy, Qos)
    # Both answers are over: the policy heard their completions and holds nothing.
    assert stack.run(lambda: len(policy.tracker)) == 0


def test_live_a_request_no_instance_can_serve_in_time_is_dropped_with_503(client):
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Hi."}], max_tokens=8,
                                       extra_body={"routing": {"policy": "qos", "tpot_slo_ms": 1}})
    assert err.value.status_code == 503
    assert err.value.body["code"] == "qos_drop" and "time per output token" in err.value.body["message"]
    assert err.value.response.headers["x-should-retry"] == "false"  # the OpenAI SDKs do not retry it
