"""QLM and its EDF baseline: the completion-time estimator, the plan generator against exhaustive
search, the policies in the simulator, and live through the openai SDK, eviction included."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import time
import types

import httpx
import numpy as np
import openai
import pytest

from conftest import Stack, pool_config, steady, wait_for
from gateway.config.store import default_config_path, load_config
from gateway.core.budget import per_token, predicted_cost
from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.profiles import spec_for_instance
from gateway.core.loop import SchedulingLoop
from gateway.core.pool_state import EngineSnapshot, PoolState
from gateway.core.request import Estimates, RouteRequest, Ticket
from gateway.core.view import tier_key
from gateway.estimators.latency import LatencyHeads, fit_head
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import load_evalset
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.simulator import CellSpec, named_models, run_cell
from gateway.lab.training.build import tier_lengths
from gateway.lab.training.traces import to_arrays, virtual_sweep
from gateway.policies import registry
from gateway.policies.qlm.heads_curve import heads_curve
from gateway.policies.qlm.plan import GroupView, Queues, greedy_plan, optimal_plan
from gateway.policies.qlm.policy import Running
from gateway.policies.qlm.rct import InstanceModel, Normal, QueueLoad, completion, length, wait

SPEC = EngineSpec(tpot_s=0.02, batch_slope=0.025, kv_read_per_token=0.0, prefill_s_per_token=1e-4,
                  max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=8192, block_size=16,
                  num_gpu_blocks=10_000)
FOURTEEN_B = "Qwen/Qwen2.5-14B-Instruct"
SEVEN_B = "Qwen/Qwen2.5-7B-Instruct"


# ---- the estimator and the plan ---------------------------------------------------------------

def test_the_cap_is_where_a_step_doubles_and_a_request_waits_only_when_it_is_full():
    model = InstanceModel.of(SPEC, slowdown=2.0)
    assert model.cap == 41 and model.step_s(41) == pytest.approx(0.04)
    answer = length(100, 0.5)
    assert wait(model, QueueLoad.empty(model, 40), answer) == Normal(0.0, 0.0)  # one slot free
    full = QueueLoad.empty(model, 41).plus(length(200, 0.0), 2)  # two queued ahead, none of the slots free
    w = wait(model, full, answer)
    assert w.mean == pytest.approx((400 + 50) / model.token_rate())  # their tokens + half an answer's tail
    c = completion(model, QueueLoad.empty(model, 0), answer, 1000)
    assert c.mean == pytest.approx(0.1 + 100 * 0.02) and c.p_at_most(c.mean) == pytest.approx(0.5)


def test_the_step_curve_read_from_tpot_heads_is_near_the_engine_it_learnt_and_absent_without_a_head():
    """A head trained on a rate sweep of the 7B's engine gives back a line near that engine's (how near is
    the estimator's error); a tier without a head keeps the engine's curve; without the heads at all the
    option is refused with what to run."""
    cfg = load_config(default_config_path())
    inst = next(i for i in cfg.instances if i.model == SEVEN_B)
    tier = tier_key(inst.model, inst.gpu)
    spec = spec_for_instance(inst)
    x, y = to_arrays(virtual_sweep(inst, tier_lengths([], inst.model, seed=1), requests_per_rate=300))
    heads = LatencyHeads({tier: fit_head(x, y)}, {tier: inst.tpot_prior_ms / 1000})
    lone, slope = heads_curve(heads, inst, spec, answer_tokens=150, slowdown=2.0)
    assert lone == pytest.approx(spec.tpot_s, rel=0.25) and slope == pytest.approx(spec.batch_slope, rel=0.35)
    learnt = InstanceModel.of(dataclasses.replace(spec, tpot_s=lone, batch_slope=slope), 2.0)
    assert learnt.cap == pytest.approx(InstanceModel.of(spec, 2.0).cap, rel=0.35)
    other = next(i for i in cfg.instances if i.model == FOURTEEN_B)
    assert heads_curve(heads, other, spec_for_instance(other), answer_tokens=90, slowdown=2.0) is None

    options = cfg.with_options("qlm", step_curve="heads")
    planned = registry.build("qlm", options, types.SimpleNamespace(heads=heads))
    engine_models = registry.build("qlm", cfg).models
    for k, i in enumerate(cfg.instances):
        if i.model == SEVEN_B:
            assert planned.models[k].tpot_s == pytest.approx(lone) and planned.models[k] != engine_models[k]
        else:
            assert planned.models[k] == engine_models[k]
    with pytest.raises(ValueError, match="routebalance train"):
        registry.build("qlm", options)


def test_what_a_running_answer_has_left_counts_its_stream_or_the_time_since_dispatch():
    exact = Running(0, answer_tokens=300.0, deadline=600.0, started=10.0, cv=0.0)  # it runs to its max_tokens
    assert exact.left(11.0, 0.02) == pytest.approx(250.0)  # nothing streamed (not a stream): 1 s at 0.02 s a token
    exact.streamed = 120
    assert exact.left(11.0, 0.02) == pytest.approx(180.0)  # it streamed more than the time alone says
    assert exact.left(30.0, 0.02) == 1.0  # at its length: it ends now
    spread = Running(0, answer_tokens=300.0, deadline=600.0, started=10.0, cv=0.5)
    assert spread.left(10.0, 0.02) == pytest.approx(300.0, rel=0.05)  # at dispatch: about its predicted length
    at_mean = spread.left(16.0, 0.02)  # 300 made: half the lengths are longer, by 0.8 spreads in the mean
    assert at_mean == pytest.approx(150.0 * 0.7979, rel=1e-3)
    assert 1.0 < spread.left(30.0, 0.02) < at_mean  # far past its prediction: still some left, less and less


def _group(key, slack, size, tokens, quality=(0.5, 0.5), candidates=(0, 1)):
    return GroupView(key, candidates, slack, size, np.array(tokens, float), np.array(quality, float), 50.0)


def test_a_group_that_cannot_be_saved_waits_behind_one_that_can_where_edf_serves_it_first():
    model = InstanceModel.of(SPEC, slowdown=1.1)  # cap 5: the queue matters
    running = np.array([5.0])
    hopeless = _group("late", 1.0, 5, [400.0], (0.5,), (0,))  # due in 1 s, needs far more
    savable = _group("ok", 30.0, 5, [100.0], (0.5,), (0,))
    queues = Queues.dedicated([model], running)
    plan = greedy_plan([hopeless, savable], [model], queues, np.array([True]), 0.9, 0.05)
    edf = greedy_plan([hopeless, savable], [model], queues, np.array([True]), 0.9, 0.0, order="edf")
    assert plan.queues[0] == [1, 0] and edf.queues[0] == [0, 1]
    assert plan.p_meet[1] > edf.p_meet[1]


def test_the_plan_prefers_the_better_model_that_still_meets_the_slo():
    fast = InstanceModel.of(SPEC, 2.0)
    slow = InstanceModel.of(dataclasses.replace(SPEC, tpot_s=0.1), 2.0)  # 100 tokens: 10 s at least
    usable = np.array([True, True])
    loose = _group("loose", 60.0, 1, [100.0, 100.0], quality=(0.3, 0.6))
    idle = Queues.dedicated([fast, slow], np.zeros(2))
    assert greedy_plan([loose], [fast, slow], idle, usable, 0.9, 0.05).placed[0] == 1  # both meet: the better
    tight = _group("tight", 8.0, 1, [100.0, 100.0], quality=(0.3, 0.6))
    assert greedy_plan([tight], [fast, slow], idle, usable, 0.9, 0.05).placed[0] == 0  # only the fast meets


def test_the_greedy_plan_generator_is_measured_against_exhaustive_search():
    rng = np.random.default_rng(7)
    models = [InstanceModel.of(SPEC, 1.2), InstanceModel.of(SPEC, 1.5)]  # caps 9 and 21
    greedy_met = best_met = 0
    for _ in range(40):
        groups = [_group(k, float(rng.uniform(2, 40)), int(rng.integers(1, 9)), rng.uniform(50, 400, 2).tolist())
                  for k in range(int(rng.integers(2, 6)))]
        queues = Queues.dedicated(models, rng.integers(0, 22, 2).astype(float))
        usable = np.array([True, True])
        greedy = greedy_plan(groups, models, queues, usable, 0.9, 0.05)
        best = optimal_plan(groups, models, queues, 0.9)
        assert greedy.met(groups, 0.9) <= best.met(groups, 0.9)  # the search is the optimum
        greedy_met += greedy.met(groups, 0.9)
        best_met += best.met(groups, 0.9)
    assert best_met > 0 and greedy_met >= 0.9 * best_met, (greedy_met, best_met)


def _two_models_on_one_gpu(swap_s: float, running: float = 0.0, rest: tuple[float, ...] = ()):
    """Instances 0 and 1: two models on one GPU (model 0 loaded, running `running` requests)."""
    models = [InstanceModel.of(SPEC, 2.0, swap_s), InstanceModel.of(SPEC, 2.0, swap_s)]
    return models, Queues((0, 0), {0: QueueLoad.empty(models[0], running, rest, member=0)})


def test_a_request_for_the_other_model_waits_for_the_drain_and_the_swap():
    models, queues = _two_models_on_one_gpu(8.0, running=2, rest=(300.0, 300.0))
    load = queues.start[0]
    assert load.toward(0, models[0]) is load  # the loaded model: no swap
    swapped = load.toward(1, models[1])
    drain = 300.0 * models[0].step_s(2)  # the running pair's answers, at the batch they run
    assert swapped.start.mean == pytest.approx(drain + 8.0)
    answer = length(100.0, 0.0)
    assert completion(models[1], swapped, answer, 50).mean == pytest.approx(
        drain + 8.0 + completion(models[1], QueueLoad.empty(models[1], 0), answer, 50).mean)


def test_groups_of_one_model_gather_on_the_gpu_that_has_it_loaded():
    """Two GPUs, each able to serve both models: the plan keeps each model on the GPU that holds it
    rather than alternating models (and swaps) on both, as deadline order alone would."""
    m = InstanceModel.of(SPEC, 2.0, swap_s=8.0)
    models = [m] * 4  # instances 0, 1 on GPU 0 (model A, model B); 2, 3 on GPU 1 (A, B)
    queues = Queues((0, 0, 1, 1), {0: QueueLoad.empty(m, 0, member=0), 1: QueueLoad.empty(m, 0, member=3)})
    a = [_group(f"a{k}", 20.0 + k, 4, [150.0] * 4, (0.5,) * 4, candidates=(0, 2)) for k in range(3)]
    b = [_group(f"b{k}", 20.5 + k, 4, [150.0] * 4, (0.5,) * 4, candidates=(1, 3)) for k in range(3)]
    groups = [g for pair in zip(a, b, strict=True) for g in pair]  # deadlines alternate A, B, A, B, ...
    plan = greedy_plan(groups, models, queues, np.ones(4, bool), 0.9, 0.05)
    assert {plan.placed[g] for g in range(0, 6, 2)} == {0} and {plan.placed[g] for g in range(1, 6, 2)} == {3}
    assert plan.met(groups, 0.9) == 24


def test_the_greedy_plan_generator_is_measured_against_exhaustive_search_on_shared_gpus():
    rng = np.random.default_rng(11)
    greedy_met = best_met = 0
    for _ in range(30):
        models, queues = _two_models_on_one_gpu(float(rng.uniform(1, 10)), float(rng.integers(0, 5)),
                                                tuple(rng.uniform(50, 300, 2)))
        groups = [_group(k, float(rng.uniform(5, 60)), int(rng.integers(1, 6)), rng.uniform(50, 300, 2).tolist(),
                         candidates=(int(rng.integers(0, 2)),)) for k in range(int(rng.integers(2, 6)))]
        greedy = greedy_plan(groups, models, queues, np.ones(2, bool), 0.9, 0.05)
        best = optimal_plan(groups, models, queues, 0.9)
        assert greedy.met(groups, 0.9) <= best.met(groups, 0.9)
        greedy_met += greedy.met(groups, 0.9)
        best_met += best.met(groups, 0.9)
    assert best_met > 0 and greedy_met >= 0.85 * best_met, (greedy_met, best_met)


def test_a_held_request_takes_one_victim_until_the_pool_view_catches_up():
    """An aborted request frees its slot in the pool view only at the next scrape; meanwhile every wake-up
    of the scheduler asks for evictions again, and the same held request must not take a second victim."""
    cfg = load_config(default_config_path())
    cfg = dataclasses.replace(cfg, instances=tuple(i for i in cfg.instances if i.model == FOURTEEN_B)[:1],
                              scheduler=dataclasses.replace(cfg.scheduler, policy="qlm"))
    cfg = cfg.with_options("qlm", slowdown=1.05)  # a cap of 2 running requests
    scheduling = SchedulingLoop(registry, PoolState(), max_queue=16, resolve=lambda _cfg, _model: (0,),
                                estimators=object())

    def enter(slo_s: float, now: float, answer_tokens: float) -> list[Ticket]:
        tickets = [Ticket(RouteRequest((0,), "p", 50, 1024, (1 / 3, 1 / 3, 1 / 3), policy="qlm", slo_s=slo_s),
                          "auto", False, cfg, arrived=now) for _ in range(2 if slo_s > 60 else 1)]
        for t in tickets:
            scheduling.submit(t, now)
        batch, _ = scheduling.take(cfg, None, now)
        decided = scheduling.decide(
            cfg, batch, scheduling.view(cfg, now),
            lambda ts, blind: Estimates(np.full((len(ts), 1), 0.5), np.full((len(ts), 1), answer_tokens)))
        return scheduling.settle(batch, decided, now)

    jobs = enter(600.0, 0.0, 300.0)  # two batch jobs fill the two slots
    assert len(jobs) == 2
    for t in jobs:
        scheduling.dispatched(t, next(scheduling.plans(t, 0.0)), 0.0)
    # The last scrape saw a request waiting in the instance's own queue: no slot, whatever the count.
    scheduling.pool_state.of(cfg.instances[0].name).scraped(EngineSnapshot(2, 1, 0.2, 0, 0), 0.9)
    assert enter(2.0, 1.0, 60.0) == [] and len(scheduling.held) == 1  # a short, tight one waits for a slot ...
    victims = scheduling.evictions(cfg, 1.0)  # ... that only an eviction frees in time
    assert len(victims) == 1 and victims[0] in jobs
    scheduling.requeue(victims[0], 1.0)
    # the same head, before a scrape shows the freed slot: no second victim
    assert scheduling.evictions(cfg, 1.01) == []


# ---- simulated --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sim(built):
    cfg, _, est = built
    return cfg, est, steady(load_evalset(cfg, 1500, estimators=est))


def _cell(policy: str, **kw) -> CellSpec:
    # Long enough (1,500 requests at 40 req/s) for a backlog to build on the 7B tier.
    base = dict(arrivals=ArrivalSpec("gamma", 40.0, shape=0.5), requests=1500, slos=((25.0, 0.5), (300.0, 0.5)),
                stream_below_s=60.0, model=SEVEN_B, mega_share=0.05)
    return CellSpec(policy, (1 / 3, 1 / 3, 1 / 3), **{**base, **kw})


def test_qlm_meets_more_slos_than_vllms_own_queue_under_bursty_load_with_mega_prompts(sim):
    cfg, est, ev = sim
    rows = {p: summarise(run_cell(cfg, ev, _cell(p), est).outcomes, [i.model for i in cfg.instances])
            for p in ("qlm", "passthrough+round_robin")}
    qlm, fcfs = rows["qlm"], rows["passthrough+round_robin"]
    assert qlm["slo_by_class"]["interactive"] > fcfs["slo_by_class"]["interactive"] + 0.05, (qlm, fcfs)
    assert qlm["slo_attainment"] > fcfs["slo_attainment"]
    assert qlm["served"] + round(qlm["refused"] * qlm["requests"]) == qlm["requests"]


def test_eviction_aborts_batch_jobs_for_tight_slos_and_serves_each_request_once(sim):
    cfg, est, ev = sim
    # Small caps and many mega prompts (1,000-token answers): slots run out for long, tight requests need eviction.
    tight = cfg.with_options("qlm", slowdown=1.05, on_infeasible="serve")  # a mega prompt's 10 s SLO: late, not refused
    spec = _cell("qlm", arrivals=ArrivalSpec("gamma", 5.0, shape=0.5), requests=400, slos=((10.0, 0.5), (600.0, 0.5)),
                 mega_share=0.3)
    result = run_cell(tight, ev, spec, est)
    evicted = [o for o in result.outcomes if o.evictions]
    assert evicted, "no request was evicted"
    assert all(o.instance >= 0 and o.completion_tokens > 0 for o in evicted)  # each served in the end, once
    served = [o for o in result.outcomes if o.instance >= 0]
    assert len(served) == len(result.outcomes)  # nothing lost on the way out and back
    # Whether eviction pays off is the ablation's question (README); here: it is only used when asked.
    quiet = run_cell(tight.with_options("qlm", eviction=False), ev, spec, est)
    assert not any(o.evictions for o in quiet.outcomes)

    def extra_paid(outcome) -> float:
        """What an evicted request cost beyond its prompt and answer paid once."""
        inst = tight.instances[outcome.instance]
        return outcome.cost_usd - float(predicted_cost(outcome.prompt_tokens, outcome.completion_tokens,
                                                       per_token(inst.price_input_per_mtok),
                                                       per_token(inst.price_output_per_mtok)))

    # GPU-CPU state swap (on by default): a victim's KV cache waits in host memory and it resumes where it
    # stopped, its prompt read once; without it every victim's prompt is read (and paid) again.
    assert min(extra_paid(o) for o in evicted) == pytest.approx(0.0, abs=1e-12)
    recomputed = [o for o in run_cell(tight.with_options("qlm", state_swap=False), ev, spec, est).outcomes
                  if o.evictions]
    assert recomputed and all(extra_paid(o) > 0 for o in recomputed)


def test_only_a_request_whose_client_has_seen_nothing_and_that_has_no_budget_may_be_evicted():
    def ticket(streaming: bool, budget: float | None = None) -> Ticket:
        return Ticket(RouteRequest((0,), "p", 10, 100, (1.0, 0.0, 0.0), budget_usd=budget), SEVEN_B, streaming, None)

    waiting_stream, whole, budgeted, streaming = ticket(True), ticket(False), ticket(False, 0.01), ticket(True)
    whole.first_token_at = streaming.first_token_at = 1.0  # the whole answer is sent at its end: nothing seen yet
    assert waiting_stream.evictable and whole.evictable
    assert not streaming.evictable and not budgeted.evictable


def test_edf_and_qlm_hold_requests_without_losing_any(sim):
    cfg, est, ev = sim
    for policy in ("edf", "qlm"):
        result = run_cell(cfg, ev, _cell(policy, requests=300, mega_share=0.0), est)
        assert all(o.instance >= 0 for o in result.outcomes)  # nothing lost while held


def test_on_gpus_shared_by_several_models_qlm_swaps_rarely_and_meets_the_slos_edf_misses(sim):
    """The paper's W_A: four GPUs time-share five models. EDF releases requests in deadline order, so the
    models interleave and the GPUs swap all the time; QLM gathers each model's requests and warm-starts
    the models next in its queues."""
    from gateway.lab.experiments.slo_sweeps import w_a_mix
    from gateway.lab.sim.pools import w_a

    cfg, est, ev = sim
    pool_cfg, pool_ev = w_a(cfg, ev)
    assert len(pool_cfg.instances) == 20 and len({i.gpu_id for i in pool_cfg.instances}) == 4
    spec = _cell("qlm", arrivals=ArrivalSpec("gamma", 6.0, shape=0.5), requests=600, model=None, mega_share=0.0,
                 models=w_a_mix(0.3))
    results = {p: run_cell(pool_cfg, pool_ev, dataclasses.replace(spec, policy=p), est) for p in ("qlm", "edf")}
    rows = {p: summarise(r.outcomes, r.models) for p, r in results.items()}
    qlm, edf = results["qlm"], results["edf"]
    assert qlm.swaps < edf.swaps / 2, (qlm.swaps, edf.swaps)
    assert qlm.swap_s / qlm.swaps < edf.swap_s / edf.swaps  # warm starts: swaps from host memory
    assert rows["qlm"]["slo_attainment"] > rows["edf"]["slo_attainment"] + 0.1, rows
    assert all(o.instance >= 0 for o in qlm.outcomes)
    asked = named_models(spec, 600)
    assert len(set(asked)) == 5  # every model, the tail ones too
    assert all(pool_cfg.instances[o.instance].model == m for o, m in zip(qlm.outcomes, asked, strict=True))
    cold = run_cell(pool_cfg.with_options("qlm", warm_start=False), pool_ev, spec, est)
    assert cold.swap_s / cold.swaps > qlm.swap_s / qlm.swaps  # no warm start: every swap from storage


# ---- live --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qlm_stack(tmp_path_factory, built):
    # Small caps (a 14B instance takes 2 requests at once) so that a test fills them. QLM is chosen by
    # the default preset ("slo"), not as the gateway's policy: a request of another preset is RouteBalance's.
    path = pool_config(tmp_path_factory.mktemp("qlm"), built[0].estimators.models_dir,
                       scheduler={"policy": "routebalance", "preset": "slo",
                                  "presets": {"slo": {"quality": 1.0, "latency": 1.0, "cost": 1.0}},
                                  "preset_policies": {"slo": "qlm"}},
                       policies={"qlm": {"slowdown": 1.05}})
    s = Stack(path)
    s.wait_routable()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(qlm_stack):
    c = openai.OpenAI(base_url=qlm_stack.base_url, api_key="unused", timeout=60, max_retries=0)
    yield c
    c.close()


def test_qlm_serves_through_the_sdk_streamed_and_not(client):
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Name a prime."}], max_tokens=8,
        extra_body={"routing": {"slo_s": 20}})
    assert raw.parse().choices[0].message.content and raw.headers["X-Route-SLO-Met"] == "true"
    chunks = list(client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "Count to four."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"routing": {"slo_s": 20}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices).strip()
    assert chunks[-1].usage.model_extra["slo_met"] is True


def _slo_requests(stack, policy: str) -> float:
    """Requests with an end-to-end SLO the gateway has judged, for one policy (from /metrics)."""
    total = 0.0
    for line in httpx.get(stack.root + "/metrics", timeout=10).text.splitlines():
        if line.startswith("routebalance_slo_requests_total{") and f'policy="{policy}"' in line:
            total += float(line.split()[-1])
    return total


def test_a_preset_chooses_its_policy(client, qlm_stack):
    before = {p: _slo_requests(qlm_stack, p) for p in ("qlm", "routebalance")}
    prompt = [{"role": "user", "content": "Name a colour."}]
    client.chat.completions.create(model="auto", messages=prompt, max_tokens=4, extra_body={"routing": {"slo_s": 20}})
    client.chat.completions.create(model="auto", messages=prompt, max_tokens=4,
                                   extra_body={"routing": {"slo_s": 20, "preset": "uniform"}})
    client.chat.completions.create(model="auto", messages=prompt, max_tokens=4,
                                   extra_body={"routing": {"slo_s": 20, "preset": "uniform", "policy": "qlm"}})
    # The handler counts a verdict as it returns: wait for it rather than race it.
    wait_for(lambda: _slo_requests(qlm_stack, "qlm") == before["qlm"] + 2, timeout=5,
             what="qlm's two verdicts: the default preset's request and the one naming it")
    assert _slo_requests(qlm_stack, "routebalance") == before["routebalance"] + 1  # uniform has none of its own


def test_an_slo_no_instance_can_meet_is_refused_with_the_reason_once(client):
    retrying = client.with_options(max_retries=2)  # the SDK's default: it would retry a plain 503 twice
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as e:
        retrying.chat.completions.create(model="auto", messages=[{"role": "user", "content": "Write an essay."}],
                                         max_tokens=500, extra_body={"routing": {"slo_s": 0.01}})
    assert e.value.status_code == 503
    assert e.value.body["code"] == "slo_infeasible" and e.value.body["param"] == "routing.slo_s"
    assert e.value.response.headers["x-should-retry"] == "false"
    assert time.monotonic() - started < 0.5  # not retried: the SDK's back-off alone is 0.5 s or more


def _evictions(stack) -> float:
    for line in httpx.get(stack.root + "/metrics", timeout=10).text.splitlines():
        if line.startswith("routebalance_evictions_total "):
            return float(line.split()[1])
    return 0.0


def test_a_tight_slo_evicts_a_batch_job_and_every_client_gets_one_answer(client, qlm_stack):
    before = _evictions(qlm_stack)

    ends: list[float] = []

    def batch_job(k: int):
        # ignore_eos: each answer runs to its 300 tokens, and the gateway knows it.
        answer = client.chat.completions.create(
            model=FOURTEEN_B, messages=[{"role": "user", "content": f"Summarise report {k} at length."}],
            max_tokens=300, extra_body={"ignore_eos": True, "routing": {"slo_s": 600}})
        ends.append(time.monotonic())
        return answer

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        jobs = [pool.submit(batch_job, k) for k in range(6)]  # three 14B instances x 2 slots: all full
        time.sleep(1.5)
        started = time.monotonic()
        urgent = client.chat.completions.create(
            model=FOURTEEN_B, messages=[{"role": "user", "content": "Quick: yes or no?"}], max_tokens=20,
            extra_body={"routing": {"slo_s": 4}})
        done = time.monotonic()
        answers = [j.result(timeout=120) for j in jobs]
    assert urgent.choices[0].message.content and done - started < 4.0
    assert done < min(ends)  # it did not wait for a slot to free: it took one
    assert _evictions(qlm_stack) >= before + 1
    for a in answers:  # the evicted job went again: one whole answer each, nothing doubled
        assert a.usage.completion_tokens == 300 and len(a.choices[0].message.content.split()) == 300


@pytest.mark.parametrize("name", ["qlm", "qlm_cap", "qlm_multi", "qos"])
def test_each_paired_comparison_of_the_slo_sweeps_names_exactly_one_cell_a_side(name):
    from gateway.lab.experiments.catalog import PAIRS, SWEEPS
    from gateway.lab.experiments.sweeps import _identity, _matches

    cells = SWEEPS[name](100)
    rows = [_identity(c) for c in cells]
    assert len({tuple(sorted((k, str(v)) for k, v in r.items())) for r in rows}) == len(rows)  # cells differ
    pairs = PAIRS[name](cells)
    assert pairs
    for pair in pairs:
        for side in (pair.a, pair.b):
            assert sum(_matches(r, side) for r in rows) == 1, (pair.name, side)
