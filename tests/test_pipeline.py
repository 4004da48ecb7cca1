"""Pipeline-mode baselines: model routers, dispatchers and the policy that chains them."""

from __future__ import annotations

import types

import numpy as np
import pytest

from gateway.config.sections import Config, Instance
from gateway.core.request import Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.estimators.knn import KnnEstimator
from gateway.policies import pipeline, registry
from gateway.policies.pipeline.dispatchers import RoundRobin, ShortestQueue

DIM = 16
# model -> (USD per 1M input tokens, per 1M output tokens, TPOT ms, replicas)
MODELS = {"small": (0.1, 0.2, 10.0, 2), "mid": (0.5, 1.0, 20.0, 2), "big": (2.0, 4.0, 40.0, 4)}
LABELLED = ("small", "mid", "big")


def pool(extra_model: str | None = None) -> tuple[Instance, ...]:
    """s0 s1 m0 m1 b0 b1 b2 b3 (indices 0-7), plus one instance of an unlabelled model if asked."""
    specs = [(m, p) for m, p in MODELS.items() for _ in range(p[3])]
    if extra_model:
        specs.append((extra_model, (0.01, 0.01, 5.0, 1)))
    return tuple(Instance(name=f"{m}{k}", url=f"http://127.0.0.1:{9001 + k}", model=m, gpu="A30-24GB",
                          price_input_per_mtok=p[0], price_output_per_mtok=p[1], tpot_prior_ms=p[2])
                 for k, (m, p) in enumerate(specs))


def make_pipeline(name: str, inst=None, knn=None, **tables):
    """The registered policy `name`, built as the server builds it, for a config over `inst` (default: pool()).

    `tables`: policy table -> its knobs, e.g. pipeline={"seed": 7}, best_route={"threshold": 0.0}.
    """
    cfg = Config(instances=inst or pool(), policies=types.MappingProxyType(
        {table: registry.options_class(table)(**knobs) for table, knobs in tables.items()}))
    return registry.build(name, cfg, None if knn is None else types.SimpleNamespace(knn=knn))


# "<router>+<dispatcher>" (the prefix package's routebalance+<baseline> are not pipelines)
PIPELINES = [e.name for e in pipeline.ENTRIES]


def view_of(instances, active=None, available=None) -> PoolView:
    n = len(instances)
    zeros = [np.zeros(n) for _ in range(7)]
    if active is not None:
        zeros[0] = np.asarray(active, dtype=float)  # running
    running, waiting, kv_usage, decode_rate, in_flight, pending_prefill, pending_decode = zeros
    return PoolView(
        instances=instances,
        available=np.ones(n, dtype=bool) if available is None else np.asarray(available, dtype=bool),
        running=running, waiting=waiting, kv_usage=kv_usage, decode_rate=decode_rate, in_flight=in_flight,
        pending_prefill=pending_prefill, pending_decode=pending_decode,
        max_num_seqs=np.array([i.max_num_seqs for i in instances], dtype=float),
        price_in=np.array([i.price_input_per_mtok for i in instances]) / 1e6,
        price_out=np.array([i.price_output_per_mtok for i in instances]) / 1e6,
        tpot_prior_s=np.array([i.tpot_prior_ms for i in instances]) / 1e3,
        tiers=tuple(i.model for i in instances),
    )


def indices(instances, model: str) -> tuple[int, ...]:
    return tuple(k for k, i in enumerate(instances) if i.model == model)


def request(candidates, input_tokens: int = 50) -> RouteRequest:
    return RouteRequest(candidates=tuple(candidates), prompt_text="p", input_tokens=input_tokens, max_tokens=None,
                        weights=(1 / 3, 1 / 3, 1 / 3))


def unit(x: np.ndarray) -> np.ndarray:
    return (x / np.linalg.norm(x, axis=-1, keepdims=True)).astype(np.float32)


# Two prompt clusters around basis vectors 0 and 1. Cluster A: big is best; cluster B: mid is best.
# Every model answers 100 tokens, so cost ranks by output price: small is cheapest everywhere.
CLUSTER_QUALITY = {"A": (0.2, 0.5, 0.9), "B": (0.3, 0.8, 0.4)}


def near(cluster: str, n: int, rng: np.random.Generator) -> np.ndarray:
    centre = np.zeros(DIM)
    centre["AB".index(cluster)] = 1.0
    return unit(centre + 0.05 * rng.standard_normal((n, DIM)))


def cluster_knn() -> KnnEstimator:
    """60 training prompts: 30 of cluster A, then 30 of B, labelled with CLUSTER_QUALITY."""
    rng = np.random.default_rng(1)
    emb = np.vstack([near("A", 30, rng), near("B", 30, rng)])
    quality = np.repeat(np.array([CLUSTER_QUALITY["A"], CLUSTER_QUALITY["B"]]), 30, axis=0)
    length = np.full((60, 3), 100.0)
    return KnnEstimator.build(emb, quality, length, LABELLED)


@pytest.fixture(scope="module")
def knn() -> KnnEstimator:
    return cluster_knn()


def estimates_for(instances, quality_by_model: list[dict[str, float]], embeddings=None) -> Estimates:
    """Per-instance columns from per-model predictions; every model answers 200 tokens."""
    q = np.array([[row[i.model] for i in instances] for row in quality_by_model])
    return Estimates(quality=q, length=np.full(q.shape, 200.0), embeddings=embeddings)


def picks(decisions) -> list[int]:
    return [d.ranked[0] for d in decisions]


def test_every_router_comes_with_every_dispatcher():
    routers = {"passthrough", "avengers", "best_route"}
    assert set(PIPELINES) == {f"{r}+{d}" for r in routers
                              for d in ("round_robin", "shortest_queue", "random", "power_of_two")}


@pytest.mark.parametrize("name", PIPELINES)
def test_every_combination_keeps_each_request_on_its_own_candidates(name, knn):
    inst = pool()
    policy = make_pipeline(name, inst, knn, avengers={"clusters": 2})
    assert policy.name == name
    assert policy.needs_estimates == (not name.startswith("passthrough"))
    small, mid, big = (indices(inst, m) for m in LABELLED)
    cand_sets = [small + mid + big, mid, big, small + big, (1, 3, 5), mid + big] * 3
    rng = np.random.default_rng(2)
    est = Estimates(quality=rng.uniform(size=(len(cand_sets), len(inst))),
                    length=rng.uniform(10, 500, (len(cand_sets), len(inst))),
                    embeddings=unit(rng.standard_normal((len(cand_sets), DIM))))
    assert policy.assign([], Estimates(est.quality[:0], est.length[:0], est.embeddings[:0]), view_of(inst)) == []
    decisions = policy.assign([request(c) for c in cand_sets], est, view_of(inst))
    assert len(decisions) == len(cand_sets)
    for cands, d in zip(cand_sets, decisions, strict=True):
        assert sorted(d.ranked) == sorted(cands)  # everything usable, chosen first, nothing foreign
        assert d.refused is None
    for cands, d in zip(cand_sets, decisions, strict=True):
        if cands in (mid, big):  # one model's instances: stays on that model
            assert {inst[i].model for i in d.ranked} == {inst[cands[0]].model}


def test_the_chosen_models_instances_come_first_and_the_predictions_are_for_ranked_0(knn):
    inst = pool()
    policy = make_pipeline("best_route+shortest_queue", inst, knn, best_route={"threshold": 0.0})  # always big
    est = estimates_for(inst, [{"small": 0.1, "mid": 0.2, "big": 0.9}], near("A", 1, np.random.default_rng(5)))
    (d,) = policy.assign([request(range(len(inst)), input_tokens=1000)], est, view_of(inst))
    assert [inst[i].model for i in d.ranked[:4]] == ["big"] * 4
    b = d.ranked[0]
    assert d.tokens == 200.0 and d.quality == pytest.approx(0.9)
    assert d.cost_usd == pytest.approx(1000 * 2.0e-6 + 200 * 4.0e-6)
    assert d.latency_s == pytest.approx(0.040 * 200)
    assert inst[b].model == "big"


def test_round_robin_cycles_each_models_instances_even_when_models_interleave(knn):
    inst = pool()
    policy = make_pipeline("best_route+round_robin", inst, knn, best_route={"threshold": 0.0})  # always big
    everything, small = tuple(range(len(inst))), indices(inst, "small")
    # Even requests may use anything (and go to big); odd ones only small.
    batch = [request(everything if r % 2 == 0 else small) for r in range(8)]
    est = estimates_for(inst, [{"small": 0.1, "mid": 0.2, "big": 0.9}] * 8, near("A", 8, np.random.default_rng(5)))
    view = view_of(inst)
    first = picks(policy.assign(batch, est, view))
    big = indices(inst, "big")
    assert sorted(first[0::2]) == list(big)  # each big replica once, in a seeded order
    assert sorted(first[1::2]) == [small[0], small[0], small[1], small[1]]
    assert first[1::2][:2] == first[1::2][2:]  # small alternates
    assert picks(policy.assign(batch[:2], est, view)) == first[:2]  # the turns carry over batches


def test_shortest_queue_spreads_a_burst_instead_of_herding():
    inst = pool()
    big = indices(inst, "big")
    policy = make_pipeline("passthrough+shortest_queue")
    chosen = picks(policy.assign([request(big) for _ in range(8)], None, view_of(inst)))
    assert sorted(chosen.count(b) for b in big) == [2, 2, 2, 2]


def test_shortest_queue_prefers_the_emptiest_and_breaks_ties_by_free_share():
    inst = pool()
    big = indices(inst, "big")
    active = np.zeros(len(inst))
    active[list(big)] = [3, 1, 2, 2]
    view = view_of(inst, active=active)
    view.max_num_seqs[big[3]] = 512  # same queue as big[2], but a smaller share of its slots
    (d,) = make_pipeline("passthrough+shortest_queue").assign([request(big)], None, view)
    assert d.ranked == (big[1], big[3], big[2], big[0])


@pytest.mark.parametrize("dispatcher", ["shortest_queue", "round_robin"])
def test_ties_are_broken_at_random_with_a_seed_not_by_index(dispatcher):
    inst = pool()
    big = indices(inst, "big")

    def firsts(seed):
        """The first choice of a fresh policy on an idle pool (every big replica ties), over 40 seeds."""
        return [picks(make_pipeline(f"passthrough+{dispatcher}", pipeline={"seed": seed + k}).assign(
            [request(big)], None, view_of(inst)))[0] for k in range(40)]

    assert firsts(0) == firsts(0)
    assert set(firsts(0)) == set(big)  # no herding onto big[0]
    assert firsts(0) != firsts(1)


def test_shortest_queue_ranks_ties_in_a_different_order_each_time():
    inst = pool()
    big = indices(inst, "big")
    view = view_of(inst)  # idle, and never updated: every rank sees four ties
    sq = ShortestQueue(seed=3)
    tops = [sq.rank(big, view)[0] for _ in range(200)]
    assert {b: tops.count(b) for b in big} == pytest.approx({b: 50 for b in big}, abs=20)
    again = ShortestQueue(seed=3)
    assert [again.rank(big, view)[0] for _ in range(200)] == tops
    rr = RoundRobin(seed=3)
    assert sorted(rr.rank(big, view)) == list(big)


def test_random_is_deterministic_for_a_seed_and_covers_every_instance():
    inst = pool()
    big = indices(inst, "big")
    batch = [request(big) for _ in range(40)]

    def run(seed):
        return picks(make_pipeline("passthrough+random", pipeline={"seed": seed}).assign(batch, None, view_of(inst)))

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert set(run(7)) == set(big)


def test_an_instance_known_down_is_not_ranked():
    inst = pool()
    big = indices(inst, "big")
    available = np.ones(len(inst), dtype=bool)
    available[big[0]] = False
    decisions = make_pipeline("passthrough+round_robin").assign([request(big)] * 6, None,
                                                                 view_of(inst, available=available))
    assert all(big[0] not in d.ranked for d in decisions)


def test_bad_names_are_refused():
    for bad in ("passthrough", "nope+round_robin", "passthrough+nope", "passthrough+random+x"):
        with pytest.raises(ValueError, match=r"unknown policy .* \(known: routebalance, passthrough\+round_robin"):
            make_pipeline(bad)
    for needs_knn in ("avengers+random", "best_route+shortest_queue"):
        with pytest.raises(ValueError, match="KNN"):
            make_pipeline(needs_knn)
