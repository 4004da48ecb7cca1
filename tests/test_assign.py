"""RouteBalance's assignment core: Eq. 1, Eq. 2, LPT, dead reckoning, presets, budgets, tier loss."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import numpy as np
import pytest

from gateway.config.store import default_config_path, load_config
from gateway.core.budget import predicted_cost
from gateway.core.pool_state import PoolState
from gateway.core.request import Estimates, RouteRequest
from gateway.core.scoring import KV_FULL, eq1, expected_latency
from gateway.lab.workload.synthetic import generate
from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch, budget_filter, lpt_order
from gateway.records import split

RNG = np.random.default_rng  # a fresh seeded tie-break stream per call

CFG = load_config(default_config_path())
UNIFORM = (1 / 3, 1 / 3, 1 / 3)


def idle_view(cfg=CFG):
    return PoolState().snapshot(cfg.instances, now=0.0, stale_after_s=3.0)


def request(candidates=None, weights=UNIFORM, budget=None, input_tokens=100, text="x"):
    return RouteRequest(tuple(range(len(CFG.instances))) if candidates is None else tuple(candidates), text,
                        input_tokens, None, weights, budget)


def flat_estimates(n, quality, length):
    """n requests, every instance's column set from per-model values."""
    q = np.array([[quality[i.model] for i in CFG.instances]] * n, dtype=float)
    ln = np.array([[length[i.model] for i in CFG.instances]] * n, dtype=float)
    return Estimates(q, ln)


MODELS = {m.split("-")[1].lower(): m for m in CFG.models()}  # "3b" -> "Qwen/Qwen2.5-3B-Instruct"


def test_eq1_against_a_hand_computed_case():
    # weights are (quality, latency, cost)
    scores = eq1((0.5, 0.25, 0.25), np.array([0.4, 0.6]), np.array([1.0, 4.0]), np.array([2.0, 1.0]))
    # 0.5*0.4 + 0.25*(1 - 1/4) + 0.25*(1 - 2/2) = 0.3875; 0.5*0.6 + 0.25*(1 - 4/4) + 0.25*(1 - 1/2) = 0.425
    assert scores == pytest.approx([0.3875, 0.425])
    # A term whose maximum is 0 scores the same for everyone instead of dividing by zero.
    assert eq1((0.0, 0.0, 1.0), np.array([0.1, 0.9]), np.zeros(2), np.ones(2)) == pytest.approx([1.0, 1.0])


def test_eq2_costs_and_the_budget_filter():
    price_in, price_out = np.array([0.06e-6, 0.38e-6]), np.array([0.06e-6, 0.40e-6])
    cost = predicted_cost(1000, np.array([200.0, 50.0]), price_in, price_out)
    # 3B: 1000*0.06e-6 + 200*0.06e-6 = 7.2e-5; 72B: 1000*0.38e-6 + 50*0.40e-6 = 4.0e-4
    assert cost == pytest.approx([7.2e-5, 4.0e-4])
    keep = budget_filter(1e-4, 1000, cost, price_in, price_out, use_filter=True)
    assert keep.tolist() == [True, False]
    # Nothing is predicted to fit, though the 3B could pay for the prompt: nothing kept (refused, not rerouted).
    keep = budget_filter(6.5e-5, 1000, cost, price_in, price_out, use_filter=True)
    assert not keep.any()
    # With the filter off every candidate that can pay the prompt stays (the clamp does the rest) ...
    keep = budget_filter(4.0e-4, 1000, cost, price_in, price_out, use_filter=False)
    assert keep.tolist() == [True, True]
    keep = budget_filter(6.5e-5, 1000, cost, price_in, price_out, use_filter=False)
    assert keep.tolist() == [True, False]
    # ... and none when not even the prompt can be paid.
    assert not budget_filter(5e-5, 1000, cost, price_in, price_out, use_filter=False).any()


def test_latency_waits_only_without_a_free_slot():
    tpot = np.full(4, 0.02)
    # A free slot; every slot running; requests waiting beside a full KV cache; requests waiting beside a cache
    # with room (between steps: they wait for a step, not for the running batch to finish).
    t = expected_latency(tpot, np.full(4, 100.0), pending_decode=np.array([4000.0, 4000.0, 3000.0, 3000.0]),
                         running=np.array([3.0, 8.0, 5.0, 5.0]), waiting=np.array([0.0, 0.0, 2.0, 2.0]),
                         kv_usage=np.array([0.3, 0.5, KV_FULL, KV_FULL - 0.05]), max_num_seqs=np.full(4, 8.0))
    assert t == pytest.approx([0.02 * 100, 0.02 * (4000 / 8 + 100), 0.02 * (3000 / 5 + 100), 0.02 * 100])


def test_lpt_orders_by_longest_prediction_first():
    assert lpt_order([np.array([10.0, 50.0]), np.array([300.0, 20.0]), np.array([60.0]), np.array([])]) == [1, 2, 0, 3]


@pytest.mark.parametrize("latency_term", ["prior", "heads"])
def test_dead_reckoning_spreads_a_burst_over_a_tier(latency_term):
    """Sixteen identical requests for the 7B tier (5 instances) must not herd onto one instance."""
    sevens = [i for i, inst in enumerate(CFG.instances) if inst.model == MODELS["7b"]]
    batch = [request(sevens) for _ in range(16)]
    est = flat_estimates(16, {m: 0.4 for m in CFG.models()}, {m: 150.0 for m in CFG.models()})

    def heads(tier, rows):  # a head whose TPOT grows with the requests already on the instance
        return 0.02 * (1 + 0.05 * rows[:, 4])

    decisions = assign_batch(batch, est, idle_view(), RouteBalanceOptions(latency_term=latency_term),
                             heads if latency_term == "heads" else None, RNG())
    per_instance = Counter(d.ranked[0] for d in decisions)
    assert set(per_instance) == set(sevens)
    assert max(per_instance.values()) - min(per_instance.values()) <= 1


def test_a_dispatch_re_predicts_only_the_requests_still_to_decide_that_may_go_there():
    """The heads run over every (request, instance) once, then per dispatch over the undecided requests that
    have the chosen instance among their candidates: the decisions are those of re-predicting every row."""
    sevens = [i for i, inst in enumerate(CFG.instances) if inst.model == MODELS["7b"]]
    threes = [i for i, inst in enumerate(CFG.instances) if inst.model == MODELS["3b"]]
    batch = [request(sevens) for _ in range(6)] + [request(threes) for _ in range(2)]
    est = flat_estimates(8, {m: 0.4 for m in CFG.models()}, {m: 150.0 for m in CFG.models()})
    calls: list[int] = []

    def heads(tier, rows):
        calls.append(len(rows))
        return 0.02 * (1 + 0.05 * rows[:, 4])

    decisions = assign_batch(batch, est, idle_view(), RouteBalanceOptions(lpt=False), heads, RNG())
    tiers = len({(i.model, i.gpu) for i in CFG.instances})
    assert sum(calls[:tiers]) == 8 * len(CFG.instances)  # the batch on every instance, one call per tier
    # Then, per dispatch, the later requests for the same model: 5, 4, ... 0 for the 7Bs, 1 then 0 for the 3Bs.
    assert calls[tiers:] == [5, 4, 3, 2, 1, 1]
    chosen = [d.ranked[0] for d in decisions]
    assert set(chosen[:6]) == set(sevens) and len(set(chosen[6:])) == 2 and set(chosen[6:]) <= set(threes)


def test_budget_keeps_what_it_can_pay_and_refuses_the_rest():
    est = flat_estimates(4, {MODELS["3b"]: 0.3, MODELS["7b"]: 0.35, MODELS["14b"]: 0.4, MODELS["72b"]: 0.45},
                         {m: 200.0 for m in CFG.models()})
    batch = [request(budget=1.0), request(budget=2e-5, input_tokens=100), request(budget=1e-5, input_tokens=100),
             request(budget=1e-6, input_tokens=100)]
    roomy, tight, short, broke = assign_batch(batch, est, idle_view(), RouteBalanceOptions(), None, RNG())
    assert roomy.refused is None and roomy.cost_usd <= 1.0
    # 100 in + 200 out on 3B is 1.8e-5: the 3B fits and nothing else does.
    assert CFG.instances[tight.ranked[0]].model == MODELS["3b"] and tight.cost_usd <= 2e-5
    assert all(CFG.instances[i].model == MODELS["3b"] for i in tight.ranked)
    # The prompt could be paid, the predicted answer cannot anywhere: a 402 saying so, not a silent cut.
    assert short.ranked == () and short.refused.status == 402 and "predicted cost" in short.refused.message
    assert broke.ranked == () and "cannot pay" in broke.refused.message and broke.refused.status == 402
    # Without the filter the short budget is served where Eq. 1 says, clamped by the dispatch plan.
    unfiltered = assign_batch(batch[2:3], est, idle_view(), RouteBalanceOptions(budget_filter=False), None, RNG())[0]
    assert unfiltered.refused is None and unfiltered.ranked


def test_losing_a_tier_routes_everything_to_the_rest():
    acct = PoolState()
    for inst in CFG.instances:
        if inst.model == MODELS["72b"]:
            acct.unreachable(inst.name, 0.0, SimpleNamespace(failure_threshold=1, cooldown_s=1.0, max_cooldown_s=1.0))
    view = acct.snapshot(CFG.instances, now=0.5, stale_after_s=3.0)
    quality = {m: 0.3 for m in CFG.models()} | {MODELS["72b"]: 0.9}  # everyone would want the 72B
    est = flat_estimates(20, quality, {m: 100.0 for m in CFG.models()})
    decisions = assign_batch([request(weights=(0.8, 0.1, 0.1)) for _ in range(20)], est, view,
                             RouteBalanceOptions(), None, RNG())
    assert all(CFG.instances[d.ranked[0]].model != MODELS["72b"] for d in decisions)


def tier_mix(estimators, preset: str, n: int = 96) -> Counter:
    w = CFG.weights(preset)
    prompts = [r.prompt for r in split(generate(800))[1][:n]]
    est = estimators.for_instances(prompts, CFG.instances)
    mix = Counter()
    for start in range(0, n, 16):  # batches of 16 over a pool that fills up as they land
        if start == 0:
            view = idle_view()
        batch = [request(weights=(w.quality, w.latency, w.cost), text=p) for p in prompts[start:start + 16]]
        rows = slice(start, start + 16)
        sub = Estimates(est.quality[rows], est.length[rows])
        for d in assign_batch(batch, sub, view, RouteBalanceOptions(), estimators.heads.tpot, RNG()):
            mix[CFG.instances[d.ranked[0]].model] += 1
    return mix


def test_presets_move_the_tier_mix_the_way_the_paper_says(built):
    _, _, estimators = built
    quality, cost = tier_mix(estimators, "quality"), tier_mix(estimators, "cost")
    big = MODELS["72b"], MODELS["14b"]
    assert sum(quality[m] for m in big) > sum(cost[m] for m in big)
    assert cost[MODELS["3b"]] > 0.5 * sum(cost.values())
    assert quality[MODELS["72b"]] > cost[MODELS["72b"]]


def test_exact_ties_spread_over_equal_instances_and_repeat_per_seed():
    """An idle pool of identical instances ties every score and queue: the draw spreads picks, seeded."""
    sevens = [i for i, inst in enumerate(CFG.instances) if inst.model == MODELS["7b"]]
    est = flat_estimates(1, {m: 0.4 for m in CFG.models()}, {m: 150.0 for m in CFG.models()})

    def first_picks(seed: int) -> list[int]:
        rng = RNG(seed)
        return [assign_batch([request(sevens)], est, idle_view(), RouteBalanceOptions(), None, rng)[0].ranked[0]
                for _ in range(40)]

    picks = first_picks(0)
    assert len(set(picks)) == len(sevens)  # lone requests on a fresh view no longer all go to the first 7B
    assert picks == first_picks(0) and picks != first_picks(1)
