"""The prefix-cache baselines (gateway/policies/prefix/): vllm-router's cache_aware, llm-d's default profile and
session affinity, on views built by hand."""

from __future__ import annotations

import dataclasses
import types
from collections import Counter

import numpy as np
import pytest

from gateway.config.sections import Config, Instance
from gateway.config.store import default_config_path, load_config
from gateway.core.prefix import PrefixIndex, block_hashes
from gateway.core.request import RouteRequest
from gateway.core.view import PoolView
from gateway.policies import registry
from gateway.policies.prefix import within_model
from gateway.policies.prefix.cache_aware import CacheAware, CacheAwareOptions, imbalanced
from gateway.policies.prefix.llmd import Llmd, LlmdOptions, queue_score
from gateway.policies.prefix.session_affinity import SessionAffinity, SessionAffinityOptions, weight

BLOCK = 16
NAMES = ("cache_aware", "llmd", "session_affinity")


def pool(n: int = 4, model: str = "m") -> tuple[Instance, ...]:
    return tuple(Instance(name=f"{model}{k}", url=f"http://127.0.0.1:{9001 + k}", model=model, gpu="A30-24GB",
                          price_input_per_mtok=0.1, price_output_per_mtok=0.2, tpot_prior_ms=10.0)
                 for k in range(n))


def view_of(instances, in_flight=None, waiting=None, kv_usage=None, available=None, prefixes=True) -> PoolView:
    n = len(instances)

    def col(values):
        return np.zeros(n) if values is None else np.asarray(values, dtype=float)

    running = col(in_flight).copy()  # what the gateway has on an instance runs there
    return PoolView(
        instances=instances,
        available=np.ones(n, dtype=bool) if available is None else np.asarray(available, dtype=bool),
        running=running, waiting=col(waiting), kv_usage=col(kv_usage), decode_rate=np.zeros(n),
        in_flight=col(in_flight), pending_prefill=np.zeros(n), pending_decode=np.zeros(n),
        max_num_seqs=np.array([i.max_num_seqs for i in instances], dtype=float),
        price_in=np.full(n, 0.1e-6), price_out=np.full(n, 0.2e-6), tpot_prior_s=np.full(n, 0.01),
        tiers=tuple(i.model for i in instances),
        prefixes=tuple(PrefixIndex(10_000) for _ in instances) if prefixes else (),
        block_size=BLOCK, prefill_s=np.zeros(n),
    )


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def request(toks: list[int] | None = None, candidates=None, n: int = 4, session: str | None = None,
            input_tokens: int | None = None) -> RouteRequest:
    toks = toks if toks is not None else []
    return RouteRequest(candidates=tuple(range(n)) if candidates is None else tuple(candidates), prompt_text="p",
                        input_tokens=len(toks) if input_tokens is None else input_tokens, max_tokens=None,
                        weights=(1 / 3, 1 / 3, 1 / 3), prefix=block_hashes(toks, BLOCK) if toks else (),
                        session=session)


def hold(view: PoolView, i: int, toks: list[int]) -> None:
    """Instance i holds the blocks of `toks` in its prefix cache."""
    index = view.prefixes[i]
    assert index is not None
    index.record(block_hashes(toks, BLOCK))


def first(decisions) -> list[int]:
    return [d.ranked[0] for d in decisions]


# ---- cache_aware -----------------------------------------------------------------------------------------------


def test_cache_aware_defaults_are_vllm_routers_published_ones():
    o = CacheAwareOptions()
    assert (o.cache_threshold, o.balance_abs_threshold, o.balance_rel_threshold) == (0.3, 64, 1.5)
    assert o.low_match == "least_loaded"


def test_imbalance_needs_both_thresholds():
    assert imbalanced(np.array([0.0, 65.0]), 64, 1.5)
    assert not imbalanced(np.array([0.0, 64.0]), 64, 1.5)  # the spread is not above the absolute threshold
    assert not imbalanced(np.array([200.0, 290.0]), 64, 1.5)  # 90 apart, but 290 <= 1.5 x 200
    assert imbalanced(np.array([200.0, 301.0]), 64, 1.5)


def test_cache_aware_sends_a_prompt_where_most_of_it_is_held_when_balanced():
    inst = pool()
    prompt = tokens(0, 160)  # 10 blocks; 9 can be reused (the last token is always computed)
    view = view_of(inst, in_flight=[3, 1, 0, 2])
    hold(view, 0, prompt[:48])  # 3 blocks: 30% of the prompt, not above the threshold
    hold(view, 2, prompt[:64])  # 4 blocks: 40%
    hold(view, 3, prompt)  # 9 blocks: 90%
    d = CacheAware(CacheAwareOptions()).assign([request(prompt)], None, view)[0]
    assert d.ranked[0] == 3 and d.detail == "cache_affinity"
    assert d.cached_tokens == 144
    assert sorted(d.ranked) == [0, 1, 2, 3] and d.ranked[1:] == (2, 1, 0)  # the rest least loaded first
    assert view.in_flight[3] == 3  # dead-reckoned


def test_cache_aware_sends_it_to_the_least_loaded_when_imbalanced_beyond_both_thresholds():
    inst = pool()
    prompt = tokens(0, 160)
    policy = CacheAware(CacheAwareOptions())
    view = view_of(inst, in_flight=[100, 40, 30, 20])  # 100 - 20 > 64 and 100 > 1.5 x 20
    hold(view, 0, prompt)
    d = policy.assign([request(prompt)], None, view)[0]
    assert d.ranked == (3, 2, 1, 0) and d.detail == "load_balance"
    # Spread beyond the absolute threshold only (100 vs 70): still balanced, so the cache wins.
    view = view_of(inst, in_flight=[100, 70, 80, 90])
    hold(view, 0, prompt)
    assert policy.assign([request(prompt)], None, view)[0].ranked[0] == 0
    # Beyond the relative threshold only (10 vs 1): balanced too.
    view = view_of(inst, in_flight=[10, 1, 2, 3])
    hold(view, 0, prompt)
    assert policy.assign([request(prompt)], None, view)[0].ranked[0] == 0


def test_cache_aware_sends_a_low_match_to_the_least_loaded():
    inst = pool()
    prompt = tokens(0, 160)
    view = view_of(inst, in_flight=[0, 5, 1, 6])
    hold(view, 3, prompt[:48])  # 30%: at the threshold, not above it
    d = CacheAware(CacheAwareOptions()).assign([request(prompt)], None, view)[0]
    assert d.ranked == (0, 2, 1, 3) and d.detail == "low_match_min_load"
    # SGLang's variant: the instance holding the fewest blocks.
    view = view_of(inst, in_flight=[0, 5, 1, 6])
    for i, n in enumerate((80, 0, 32, 48)):
        hold(view, i, tokens(1000 * (i + 1), n))
    d = CacheAware(CacheAwareOptions(low_match="smallest_tree")).assign([request(prompt)], None, view)[0]
    assert d.ranked[0] == 1 and d.detail == "low_match_smallest_tree"


def test_cache_aware_keeps_a_batch_together_and_reckons_its_load():
    """Within one batch the first request's prompt lands somewhere; its follow-up finds it there (dead
    reckoning of prompts), and a burst of unrelated prompts spreads by load."""
    inst = pool()
    view = view_of(inst)
    policy = CacheAware(CacheAwareOptions())
    opening = tokens(0, 160)
    turn2 = opening + tokens(5000, 64)
    picks = first(policy.assign([request(opening), request(turn2)], None, view))
    assert picks[0] == picks[1]
    view = view_of(inst)
    burst = [request(tokens(10_000 * (k + 1), 64)) for k in range(8)]
    assert Counter(first(policy.assign(burst, None, view))) == Counter({0: 2, 1: 2, 2: 2, 3: 2})


def test_cache_aware_without_a_prefix_index_balances_load():
    inst = pool()
    view = view_of(inst, in_flight=[2, 0, 1, 3], prefixes=False)
    d = CacheAware(CacheAwareOptions()).assign([request(tokens(0, 160))], None, view)[0]
    assert d.ranked == (1, 2, 0, 3) and d.cached_tokens is None


def test_cache_aware_skips_an_unavailable_instance_even_if_it_holds_the_prompt():
    inst = pool()
    prompt = tokens(0, 160)
    view = view_of(inst, available=[True, False, True, True])
    hold(view, 1, prompt)
    hold(view, 2, prompt[:96])
    d = CacheAware(CacheAwareOptions()).assign([request(prompt)], None, view)[0]
    assert d.ranked[0] == 2 and 1 not in d.ranked


# ---- llmd ------------------------------------------------------------------------------------------------------


def test_llmd_scores_match_a_hand_computed_case():
    inst = pool(3)
    prompt = tokens(0, 100)  # 6 full blocks; 6 can be reused (99 // 16)
    view = view_of(inst, waiting=[4, 0, 2], kv_usage=[0.2, 0.9, 0.5])
    hold(view, 0, prompt[:64])  # 4 blocks = 64 tokens
    hold(view, 2, prompt)  # 6 blocks = 96 tokens
    policy = Llmd(LlmdOptions())
    d = policy.assign([request(prompt, n=3)], None, view)[0]
    s = d.detail
    np.testing.assert_allclose(s.prefix, [0.64, 0.0, 0.96])
    np.testing.assert_allclose(s.queue, [0.0, 1.0, 0.5])  # (max - q) / (max - min), max 4, min 0
    np.testing.assert_allclose(s.kv, [0.8, 0.1, 0.5])
    # 3 x prefix + 2 x queue + 2 x kv
    np.testing.assert_allclose(s.total, [3 * 0.64 + 0 + 1.6, 0 + 2.0 + 0.2, 3 * 0.96 + 1.0 + 1.0])
    assert d.ranked == (2, 0, 1) and d.cached_tokens == 96


def test_llmd_queue_score_is_one_when_every_queue_is_equal_and_reads_waiting_only():
    np.testing.assert_allclose(queue_score(np.array([3.0, 3.0, 3.0])), [1.0, 1.0, 1.0])
    np.testing.assert_allclose(queue_score(np.array([1.0, 5.0, 3.0])), [1.0, 0.0, 0.5])
    inst = pool(2)
    view = view_of(inst, in_flight=[50, 0], waiting=[0, 1])  # busy but not queueing beats idle with a queue of 1
    assert Llmd(LlmdOptions()).assign([request(tokens(0, 40), n=2)], None, view)[0].ranked[0] == 0


def test_llmd_weights_are_options():
    inst = pool(2)
    prompt = tokens(0, 160)
    view = view_of(inst, waiting=[3, 0])
    hold(view, 0, prompt)  # 90% of the prompt on the instance with the longer queue
    assert Llmd(LlmdOptions()).assign([request(prompt, n=2)], None, view)[0].ranked[0] == 0  # 2.7 + 0 + 2 > 0 + 2 + 2
    view = view_of(inst, waiting=[3, 0])
    hold(view, 0, prompt)
    only_queue = LlmdOptions(prefix_weight=0.0, kv_weight=0.0)
    assert Llmd(only_queue).assign([request(prompt, n=2)], None, view)[0].ranked[0] == 1


def test_llmd_breaks_exact_ties_at_random_and_repeats_for_a_seed():
    inst = pool(4)

    def picks(seed: int) -> list[int]:
        policy = Llmd(LlmdOptions(seed=seed))
        return [policy.assign([request(tokens(0, 8))], None, view_of(inst))[0].ranked[0] for _ in range(40)]

    assert set(picks(0)) == {0, 1, 2, 3}
    assert picks(0) == picks(0) and picks(0) != picks(1)


# ---- session_affinity ------------------------------------------------------------------------------------------


def affinity(candidates, sessions, view, **options) -> list[int]:
    policy = SessionAffinity(SessionAffinityOptions(**options))
    return first(policy.assign([request(candidates=candidates, session=s) for s in sessions], None, view))


def test_a_session_goes_to_the_same_instance_across_calls_and_policies():
    inst = pool(5)
    sessions = [f"conversation-{k}" for k in range(50)]
    once = affinity(range(5), sessions, view_of(inst))
    # another policy object (another process), another load: the same instances
    again = affinity(range(5), sessions, view_of(inst, in_flight=[9, 0, 3, 7, 1]))
    assert once == again
    # and the weight is a pure function of the key and the name (blake2b), so it is the same in every process
    assert weight(b"session:conversation-0", "m0") == weight(b"session:conversation-0", "m0")
    assert weight(b"session:conversation-0", "m0") != weight(b"session:conversation-0", "m1")


def test_an_unavailable_instance_moves_only_its_own_sessions():
    inst = pool(5)
    sessions = [f"user-{k}" for k in range(400)]
    before = affinity(range(5), sessions, view_of(inst))
    after = affinity(range(5), sessions, view_of(inst, available=[True, True, False, True, True]))
    moved = [k for k in range(len(sessions)) if before[k] != after[k]]
    assert moved and all(before[k] == 2 for k in moved)  # only the down instance's sessions moved...
    assert all(after[k] != 2 for k in range(len(sessions)))  # ...to the others
    assert len(moved) == before.count(2)
    # an instance taken out of the candidates entirely moves no one else either
    fewer = affinity([0, 1, 3, 4], sessions, view_of(inst))
    assert fewer == after


def test_different_sessions_spread_evenly_over_instances():
    inst = pool(4)
    counts = Counter(affinity(range(4), [f"s{k}" for k in range(4000)], view_of(inst)))
    assert set(counts) == {0, 1, 2, 3}
    assert all(abs(c - 1000) < 150 for c in counts.values()), counts


def test_without_a_session_the_prompt_opening_keys_it_and_without_either_the_least_loaded():
    inst = pool(4)
    policy = SessionAffinity(SessionAffinityOptions(prefix_blocks=4))
    system = tokens(0, 64)  # the first 4 blocks: a conversation's opening
    turns = [request(system + tokens(1000 * k, 16 * k)) for k in range(1, 6)]
    picks = first(policy.assign(turns, None, view_of(inst)))
    assert len(set(picks)) == 1  # every turn sharing the opening sticks, whatever follows
    openings = [request(tokens(10_000 * k, 80)) for k in range(1, 200)]
    assert len(set(first(policy.assign(openings, None, view_of(inst))))) == 4  # different openings spread
    # no session, no hashed prompt: the fewest requests in flight, dead-reckoned through the batch
    view = view_of(inst, in_flight=[3, 1, 0, 2], prefixes=False)
    picks = first(policy.assign([request(input_tokens=50) for _ in range(3)], None, view))
    assert picks[0] == 2 and sorted(picks[1:]) == [1, 2]  # then 1 and 2 tie (one each), at random


def test_the_session_wins_over_the_prompt():
    inst = pool(4)
    policy = SessionAffinity(SessionAffinityOptions())
    prompts = [tokens(10_000 * k, 80) for k in range(1, 40)]
    picks = first(policy.assign([request(p, session="one") for p in prompts], None, view_of(inst)))
    assert len(set(picks)) == 1


# ---- the registry ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_each_builds_from_the_default_config_and_routes(name):
    cfg = load_config(default_config_path())
    entry = registry.entry(name)
    assert entry.reads_prefixes and not entry.needs_estimates and entry.summary.startswith("baseline: ")
    policy = registry.build(name, cfg)
    assert policy.name == name
    n = len(cfg.instances)
    view = view_of(cfg.instances)
    decisions = policy.assign([request(tokens(0, 100), candidates=range(n), session="s"),
                               request(tokens(0, 100), candidates=(0, 1))], None, view)
    assert sorted(decisions[0].ranked) == list(range(n))  # every usable candidate, ranked
    assert sorted(decisions[1].ranked) == [0, 1]


@pytest.mark.parametrize("name", NAMES)
def test_options_come_from_their_own_table(name):
    table = registry.options_class(name)
    cfg = Config(instances=pool(), policies=types.MappingProxyType({name: table(seed=7)}))
    assert registry.build(name, cfg).options.seed == 7


# ---- RouteBalance's cache term (Eq. 1's latency with prefill) ------------------------------------------------


def _routebalance(view: PoolView, reqs: list[RouteRequest], length: float = 100.0):
    """RouteBalance's assignment with the prior TPOT (0.01 s), the busy branch's wait, 1 ms a prefill token."""
    import dataclasses

    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    n, i = len(reqs), len(view.instances)
    est = Estimates(np.full((n, i), 0.5), np.full((n, i), length))
    view = dataclasses.replace(view, prefill_s=np.full(i, 1e-3), pending_decode=view.running * length)
    return assign_batch(reqs, est, view, RouteBalanceOptions(), None, np.random.default_rng(0))


def _small_pool():
    import dataclasses

    return tuple(dataclasses.replace(inst, max_num_seqs=4) for inst in pool(3))


def test_routebalance_prefers_the_warm_instance_and_prices_its_load():
    history = tokens(0, 1600)
    prompt = request(history + tokens(9000, 40), n=3)
    view = view_of(_small_pool(), in_flight=[2, 2, 2])
    hold(view, 1, history)
    (d,) = _routebalance(view, [prompt])
    assert d.ranked[0] == 1 and d.cached_tokens == 1600
    # Full, with long answers queued: waiting there costs more than prefilling the history elsewhere.
    busy = view_of(_small_pool(), in_flight=[2, 4, 2], waiting=[0, 3, 0])
    hold(busy, 1, history)
    (d,) = _routebalance(busy, [prompt], length=1000.0)
    assert d.ranked[0] != 1 and d.cached_tokens == 0
    # A burst of the conversation's branches in one batch: the warm one takes them while its queue costs less than
    # prefilling the history elsewhere (at 1 ms a prompt token, 1.64 s counted 4 times, against a queue that
    # grows by 0.25 s a request), then the rest spread (dead reckoning): preferred, not flooded.
    burst = view_of(_small_pool(), in_flight=[0, 0, 0])
    hold(burst, 1, history)
    placed = first(_routebalance(burst, [request(history + tokens(20_000 + 100 * k, 40), n=3) for k in range(40)]))
    assert placed.count(1) > max(placed.count(0), placed.count(2)) and set(placed) != {1}


def test_a_request_waiting_beside_a_cache_with_room_does_not_make_the_warm_instance_full():
    """A scrape that caught a request between steps (waiting, the KV cache with room) leaves the warm instance a
    free slot: the turn stays where its history is. The same queue beside a full cache waits for the running
    answers (1,000 iterations of 10 ms), more than prefilling the history elsewhere (1.64 s x (4 + 2))."""
    from gateway.core.scoring import KV_FULL

    history = tokens(0, 1600)
    prompt = request(history + tokens(9000, 40), n=3)
    picks = []
    for kv in (0.2, KV_FULL):
        view = view_of(_small_pool(), in_flight=[2, 2, 2], waiting=[0, 1, 0], kv_usage=[0.2, kv, 0.2])
        hold(view, 1, history)
        (d,) = _routebalance(view, [prompt], length=1000.0)
        picks.append(d.ranked[0])
    assert picks[0] == 1 and picks[1] != 1


def test_dead_reckoning_books_a_dispatch_where_the_decode_term_says_it_waits():
    """The working copy and Eq. 1's decode term answer "is there a free slot" with one rule: beside a cache with
    room a dispatch runs (the scrape caught a request between steps), beside a full cache it waits, and with
    every slot running it waits whatever the cache."""
    from gateway.core.scoring import KV_FULL

    pool = _small_pool()
    booked = []
    for waiting, kv, running in ((1, 0.2, 2), (1, KV_FULL, 2), (0, 0.2, pool[0].max_num_seqs)):
        view = view_of(pool, in_flight=[running] * 3, waiting=[waiting] * 3, kv_usage=[kv] * 3)
        view.dispatched(0, 10.0, 32)
        booked.append((view.running[0] - running, view.waiting[0] - waiting))
    assert booked == [(1, 0), (0, 1), (0, 1)]


def _tpot_slower_when_busy(tier, rows):  # 10 ms, 5% slower for each request the gateway has on the instance
    return 0.01 * (1 + 0.05 * rows[:, 4])


def _tier_mate_pick(prompt: list[int], held: list[int], error: float | None, **options) -> int:
    """Where RouteBalance sends `prompt` among three instances of one tier: the middle one has a request on it
    and holds `held`; prefill costs 0.1 ms a token; the TPOT head's held-out error is `error` (None: unknown)."""
    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    view = view_of(pool(3), in_flight=[0, 1, 0])
    hold(view, 1, held)
    view = dataclasses.replace(view, prefill_s=np.full(3, 1e-4))
    (d,) = assign_batch([request(prompt, n=3)], Estimates(np.full((1, 3), 0.5), np.full((1, 3), 100.0)), view,
                        RouteBalanceOptions(**options), _tpot_slower_when_busy, np.random.default_rng(0),
                        None if error is None else {"m": error})
    return d.ranked[0]


def test_between_tier_mates_the_cache_decides_within_the_heads_error():
    """The warm instance has one request on it, and a head 5% slower there costs it more (0.05 s of decode) than
    its 2-block history saves (0.012 s of prefill): 0.012 apart in score. Within the latency term's error (w_lat
    x the head's held-out error: 1/3 x 5% = 0.017) the history decides; with a 1% head, or no error known, the
    score does."""
    history = tokens(0, 32)

    def pick(error: float | None, **options) -> int:
        return _tier_mate_pick(history + tokens(9000, 8), history, error, **options)

    assert pick(0.05) == 1 and pick(0.01) != 1 and pick(None) != 1
    # tie_tolerance widens the band in multiples of it: 3 x 0.0033 is still under 0.012 apart, 4 x is over; 0
    # leaves the score alone
    assert pick(0.01, tie_tolerance=3) != 1 and pick(0.01, tie_tolerance=4) == 1
    assert pick(0.05, tie_tolerance=0) != 1


def test_within_the_heads_error_a_short_opening_held_does_not_decide():
    """Every prompt opens with the chat template's block, so every instance that has served anything holds it.
    Held alone, that opening (16 of 216 tokens) must not keep drawing requests to a busy instance within the
    heads' error, or an instance that missed the first requests never gets one; what a tier-mate holds decides
    only when it is at least `tie_min_share` of the prompt more than the best's."""
    prompt = tokens(0, 216)

    def pick(held: int, **options) -> int:
        return _tier_mate_pick(prompt, prompt[:held], 0.1, **options)

    assert pick(16) != 1 and pick(16, tie_min_share=0) == 1  # the opening alone: the idle instance
    assert pick(80) == 1  # 37% of the prompt: within the band, the history decides
    assert pick(80, tie_min_share=0.5) != 1 and pick(80, tie_tolerance=0) != 1  # the score alone: the idle one


def test_without_a_latency_term_exact_ties_between_tier_mates_stay_the_queues():
    """With w_lat = 0 a tier's instances tie exactly; the shorter queue breaks it, not the cache (else every
    request of the tier would pile onto the instance that served first)."""
    import dataclasses

    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    history = tokens(0, 32)
    view = view_of(pool(3), in_flight=[0, 2, 1])
    hold(view, 1, history)
    reqs = [dataclasses.replace(request(history + tokens(9000 + 100 * k, 8), n=3), weights=(0.5, 0.0, 0.5))
            for k in range(3)]
    decisions = assign_batch(reqs, Estimates(np.full((3, 3), 0.5), np.full((3, 3), 100.0)), view,
                             RouteBalanceOptions(), lambda tier, rows: np.full(len(rows), 0.01),
                             np.random.default_rng(0), {"m": 0.05})
    assert first(decisions)[0] == 0 and 1 not in first(decisions)[:2]


def test_routebalance_without_prefixes_scores_as_the_paper():
    history = tokens(0, 1600)
    view = view_of(_small_pool(), in_flight=[0, 1, 0], prefixes=False)
    (d,) = _routebalance(view, [request(history, n=3)])
    assert d.cached_tokens is None and d.ranked[0] != 1


def _pick_beside_a_busy_warm_instance(prefill_s: float = 1e-3, **options) -> int:
    """Where RouteBalance (with these options) sends a turn whose 1,600-token history instance 1 holds, instance 1
    being the busiest (4 in flight, 3 waiting, against 2 and 0 on the cold ones): cold, 10 s of decode and 1.64 s
    of prefill (at the default 1 ms a token) for itself and each of its 2 running; warm, 20 s and 0.04 s for
    itself and each of its 4."""
    import dataclasses

    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    history = tokens(0, 1600)
    busy = view_of(_small_pool(), in_flight=[2, 4, 2], waiting=[0, 3, 0])
    hold(busy, 1, history)
    busy = dataclasses.replace(busy, prefill_s=np.full(3, prefill_s), pending_decode=busy.running * 1000.0)
    (d,) = assign_batch([request(history + tokens(9000, 40), n=3)],
                        Estimates(np.full((1, 3), 0.5), np.full((1, 3), 1000.0)), busy,
                        RouteBalanceOptions(**options), None, np.random.default_rng(0))
    return d.ranked[0]


def test_a_heavier_own_prefill_keeps_a_turn_where_its_history_is():
    """prefill_weight counts the request's own prefill more than once (its time to first token): the busy warm
    instance that loses above (at the default, 4) and at 1 wins at 6 (cold: 10 s + 1.64 s x (w + 2); warm: 20 s
    + 0.04 s x (w + 4))."""
    from gateway.policies.routebalance.assign import RouteBalanceOptions

    picks = {own: _pick_beside_a_busy_warm_instance(prefill_weight=own) for own in (1.0, 4.0, 6.0)}
    assert picks[1.0] != 1 and picks[4.0] != 1 and picks[6.0] == 1
    with pytest.raises(ValueError, match="prefill_weight"):
        RouteBalanceOptions(prefill_weight=0.5)


def test_the_running_batchs_share_of_a_miss_weighs_by_its_weight():
    """prefill_running_weight scales what a miss's prefill costs the requests running beside it: the same busy
    warm instance as above loses at 0 and 1 and wins at 2 (cold: 10 s + 1.64 s x (4 + 2r); warm: 20 s + 0.04 s
    x (4 + 4r))."""
    from gateway.policies.routebalance.assign import RouteBalanceOptions

    picks = {share: _pick_beside_a_busy_warm_instance(prefill_running_weight=share) for share in (0.0, 1.0, 2.0)}
    assert picks[0.0] != 1 and picks[1.0] != 1 and picks[2.0] == 1
    with pytest.raises(ValueError, match="prefill_running_weight"):
        RouteBalanceOptions(prefill_running_weight=-0.1)


def test_the_running_batchs_share_places_within_the_model_the_request_chose():
    """The hold a miss's prefill has on the requests running beside it ranks a model's instances, not the
    models: two busy instances of the model whose quality the score prefers (10 running each) and an idle one
    of another, every one cold for a 2,000-token prompt. Its own latency is the same everywhere (1 s of decode
    and 2 s of prefill counted 4 times), so the preferred model answers; counted across models, the 20 s its
    prefill would hold each busy instance's batch would have sent it to the other model. The other instance
    of its model is its first fallback."""
    import dataclasses

    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    instances = pool(2, "preferred") + pool(1, "other")
    busy = view_of(instances, in_flight=[10, 10, 0])
    busy = dataclasses.replace(busy, prefill_s=np.full(3, 1e-3))
    quality = np.array([[0.5, 0.5, 0.45]])
    (d,) = assign_batch([request(tokens(0, 2000), n=3)], Estimates(quality, np.full((1, 3), 100.0)), busy,
                        RouteBalanceOptions(), None, np.random.default_rng(0))
    assert set(d.ranked[:2]) == {0, 1} and d.ranked[2] == 2


def test_a_slower_measured_prefill_keeps_a_turn_where_its_history_is():
    """The prefill rate the view carries (the tier's, refined from what its instances report: core/prefill_rate.py)
    prices a miss: the busy warm instance loses at 1 ms a token (cold: 10 s + 1.64 s x 6; warm: 20 s + 0.04 s x 8)
    and wins at 2 ms (cold: 10 s + 3.28 s x 6; warm: 20 s + 0.08 s x 8)."""
    assert _pick_beside_a_busy_warm_instance(1e-3) != 1
    assert _pick_beside_a_busy_warm_instance(2e-3) == 1


def test_the_prefill_term_adds_the_prompts_pending_ahead_for_the_request_alone():
    """The request waits (own_weight times) for the prompt tokens pending on a candidate and for its own prompt
    less what the candidate holds; its prefill holds each running request (weight times) for its own prompt
    only: what is pending there holds the batch wherever this request goes."""
    from gateway.core.scoring import prefill_hold, prefill_latency

    rate, cached = np.full(3, 1e-3), np.array([0.0, 800.0, 0.0])
    t = prefill_latency(rate, 1000, cached, pending_prefill=np.array([0.0, 0.0, 500.0]), own_weight=4.0)
    assert t == pytest.approx([4 * 1.0, 4 * 0.2, 4 * 1.5])
    held = prefill_hold(rate, 1000, cached, running=np.array([0.0, 2.0, 1.0]), weight=0.5)
    assert held == pytest.approx([0.0, 0.5 * 2 * 0.2, 0.5 * 1 * 1.0])


def test_a_prompt_goes_where_no_long_prompt_is_pending_ahead_of_it():
    """Two cold instances: one with a request whose 3,000-token prompt is still to prefill, one with two
    requests decoding. A head that prices both alike leaves the prefill term to tell them apart: the second
    holds two running requests through the new prompt's 100 tokens (0.1 s each) where the first holds one, but
    the first makes the prompt wait 3 s for the one pending there (counted 4 times)."""
    import dataclasses

    from gateway.core.request import Estimates
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    def pick(pending: float) -> int:
        view = view_of(pool(2), in_flight=[1, 2])
        view = dataclasses.replace(view, prefill_s=np.full(2, 1e-3), pending_prefill=np.array([pending, 0.0]))
        (d,) = assign_batch([request(tokens(9000, 100), n=2)], Estimates(np.full((1, 2), 0.5),
                            np.full((1, 2), 100.0)), view, RouteBalanceOptions(),
                            lambda tier, rows: np.full(len(rows), 0.01), np.random.default_rng(0))
        return d.ranked[0]

    assert pick(0.0) == 0 and pick(3000.0) == 1


# ---- pending prefill: what an instance must compute, not the whole prompt ------------------------------------


def test_dead_reckoning_counts_only_the_prefill_an_instance_must_compute():
    """A turn sent where its history is held adds its new tokens to the instance's pending prefill, not its whole
    prompt: the TPOT heads must not read a warm turn as a long prefill ahead of the batch."""
    history = tokens(0, 1600)
    view = view_of(pool(2))
    hold(view, 0, history)
    turn = request(history + tokens(9000, 40), n=2)
    view.dispatched(0, 10.0, turn.input_tokens, turn.prefix)
    view.dispatched(1, 10.0, turn.input_tokens, turn.prefix)
    assert list(view.pending_prefill) == [40, 1640]
    # The batch's own dispatches count: a branch of the same turn sent after it to the cold one computes 48 tokens
    # (the first prompt's 102 full blocks are reused; its last, partial block is not).
    branch = request(history + tokens(9000, 40) + tokens(20_000, 40), n=2)
    view.dispatched(1, 10.0, branch.input_tokens, branch.prefix)
    assert view.pending_prefill[1] == 1640 + 48


def test_the_scheduler_books_the_prefill_an_instance_must_compute_unless_prefixes_are_off():
    import dataclasses

    from gateway.core.loop import SchedulingLoop
    from gateway.core.pool_state import PoolState
    from gateway.core.request import DispatchPlan, Ticket

    base = load_config(default_config_path())
    history = tokens(0, 1600)
    prompts = [history + tokens(9000, 40), history + tokens(9000, 40) + tokens(20_000, 40)]
    booked = {}
    for mode in ("approximate", "off"):
        cfg = dataclasses.replace(base, scheduler=dataclasses.replace(base.scheduler, prefix_cache=mode))
        block = cfg.scheduler.prefix_block_tokens
        pool_state = PoolState()
        loop = SchedulingLoop(registry, pool_state, max_queue=8, resolve=lambda _cfg, _model: (0,))
        for k, toks in enumerate(prompts):
            req = RouteRequest((0,), "p", len(toks), 16, (1.0, 0.0, 0.0), prefix=block_hashes(toks, block))
            loop.dispatched(Ticket(req, "auto", True, cfg), DispatchPlan(0, 16, False), float(k))
        booked[mode] = pool_state.of(cfg.instances[0].name).own_share().prefill_tokens
    assert booked == {"approximate": 1640 + 48, "off": 1640 + 1680}


def test_a_held_rounds_working_copy_counts_a_booked_prompt_whole_not_as_its_own_cache_hit():
    """`settle` books each request on the live index and dead-reckons it on the round's working copy, which reads
    that index: the copy must count the prompt before the booking records it, or every prompt would be a hit on
    itself."""
    from gateway.core.loop import SchedulingLoop
    from gateway.core.policy import Policy
    from gateway.core.pool_state import PoolState
    from gateway.core.request import Decision, Ticket

    seen: list[float] = []

    class Watch(Policy):
        name = "watch"

        def assign(self, batch, estimates, view):
            return [Decision((0,)) for _ in batch]

        def hold(self, ticket, view):
            seen.append(float(view.pending_prefill[0]))
            return False

    cfg = load_config(default_config_path())
    block = cfg.scheduler.prefix_block_tokens
    pool_state = PoolState()
    loop = SchedulingLoop(registry, pool_state, max_queue=8, resolve=lambda _cfg, _model: (0,))
    # The instance already holds another prompt: the round's copy reads its live index.
    pool_state.sent_prompt(cfg.instances[0].name, block_hashes(tokens(50_000, 64), block), 1000)
    toks = tokens(0, 1640)
    tickets = [Ticket(RouteRequest((0,), "p", len(toks), 16, (1.0, 0.0, 0.0), prefix=block_hashes(toks, block)),
                      "auto", True, cfg) for _ in range(2)]
    policy = Watch()
    loop.settle(tickets, [(Decision((0,), tokens=16.0), policy) for _ in tickets], 0.0)
    assert seen == [0.0, 1640.0]  # the second sees the first's whole prompt still to compute


# ---- a baseline within the model RouteBalance names (policies/prefix/within_model.py) --------------------------


WITHIN = tuple(entry.name for entry in within_model.ENTRIES)


def _two_models_one_warm_in_each():
    """Two instances of a model the estimates prefer ("good": quality 0.9) and two of another ("cheap": 0.1);
    good1 holds a prompt's first 800 tokens, cheap0 all 1,600 of its history."""
    from gateway.core.request import Estimates

    cheap = tuple(dataclasses.replace(inst, url=f"http://127.0.0.1:{9011 + k}")
                  for k, inst in enumerate(pool(2, "cheap")))
    view = view_of(pool(2, "good") + cheap)
    history = tokens(0, 1600)
    hold(view, 1, history[:800])
    hold(view, 2, history)
    est = Estimates(np.array([[0.9, 0.9, 0.1, 0.1]]), np.full((1, 4), 100.0))
    return view, request(history + tokens(9000, 40)), est


@pytest.mark.parametrize("name", WITHIN)
def test_the_model_is_routebalances_and_the_instance_the_baselines(name):
    view, req, est = _two_models_one_warm_in_each()
    (alone,) = registry.build("cache_aware", load_config(default_config_path())).assign([req], None,
                                                                                          view.probe())
    assert alone.ranked[0] == 2  # on its own, cache_aware follows the longest match to the other model
    policy = registry.build(name, Config(instances=view.instances))
    assert registry.entry(name).needs_estimates and policy.name == name
    (d,) = policy.assign([req], est, view)
    assert d.ranked[0] in (0, 1) and set(d.ranked[2:]) == {2, 3}  # the named model's instances, then the rest
    if name.endswith("+session_affinity"):  # it sticks by the conversation, not by what is held
        later = request(tokens(0, 1600) + tokens(9000, 40) + tokens(20_000, 200))
        (again,) = policy.assign([later], est, view.probe())
        assert again.ranked[0] == d.ranked[0]  # the conversation's next turn goes where its first went
    else:  # both cache-aware placers find the half held within the model
        assert d.ranked[0] == 1 and d.cached_tokens == 800
    assert d.quality == 0.9 and d.tokens == 100.0
    # RouteBalance decided on a probe: the view counts the request once, where the baseline placed it.
    assert view.in_flight.tolist() == [float(i == d.ranked[0]) for i in range(4)]


def test_a_request_routebalance_refuses_stays_refused():
    view, req, est = _two_models_one_warm_in_each()
    poor = dataclasses.replace(req, budget_usd=1e-12)
    (d,) = registry.build("routebalance+cache_aware", Config(instances=view.instances)).assign([poor], est, view)
    assert d.ranked == () and d.refused is not None and d.refused.status == 402
    assert view.in_flight.sum() == 0


def test_a_probe_takes_dead_reckoning_the_view_does_not_see():
    view = view_of(pool(2))
    probe = view.probe()
    probe.dispatched(0, 50.0, 100, block_hashes(tokens(0, 64), BLOCK))
    assert probe.in_flight[0] == 1 and probe.pending_decode[0] == 50 and probe.sent
    assert view.in_flight[0] == 0 and view.pending_decode[0] == 0 and view.pending_prefill[0] == 0 and not view.sent
