"""Avengers-Pro: per-cluster performance/cost ranking, priced with input and output tokens, and its config table."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pytest
from test_pipeline import LABELLED, MODELS, cluster_knn, indices, make_pipeline, near, pool, request, view_of

from gateway.config.sections import parse_config
from gateway.config.store import default_config_path
from gateway.config_schema import ConfigError
from gateway.core.request import Estimates
from gateway.estimators.knn import PROMPT_TOKENS, KnnEstimator


@pytest.fixture(scope="module")
def knn() -> KnnEstimator:
    return cluster_knn()


def routed(policy, inst, emb, cands=None) -> list[str]:
    cands = tuple(range(len(inst))) if cands is None else cands
    n = len(emb)
    est = Estimates(np.zeros((n, len(inst))), np.full((n, len(inst)), 100.0), emb)
    return [inst[d.ranked[0]].model for d in policy.assign([request(cands) for _ in range(n)], est, view_of(inst))]


def probes(rng_seed: int = 3) -> np.ndarray:
    rng = np.random.default_rng(rng_seed)
    return np.vstack([near("A", 4, rng), near("B", 4, rng)])


@pytest.mark.parametrize("clusters", [2, 64])  # 64 is capped at the 60 training prompts
@pytest.mark.parametrize(("weight", "expected"), [(1.0, {"A": "big", "B": "mid"}), (0.0, {"A": "small", "B": "small"})])
def test_avengers_follows_the_cluster_labels(knn, clusters, weight, expected):
    inst = pool()
    policy = make_pipeline("avengers+shortest_queue", inst, knn,
                           avengers={"performance_weight": weight, "clusters": clusters})
    assert routed(policy, inst, probes()) == [expected["A"]] * 4 + [expected["B"]] * 4


def test_avengers_never_picks_an_unlabelled_model(knn):
    inst = pool(extra_model="tiny")
    tiny, small = indices(inst, "tiny"), indices(inst, "small")
    policy = make_pipeline("avengers+round_robin", inst, knn, avengers={"performance_weight": 0.0, "clusters": 2})
    emb = near("A", 2, np.random.default_rng(4))
    est = Estimates(quality=np.zeros((2, len(inst))), length=np.full((2, len(inst)), 100.0), embeddings=emb)
    mixed, only_tiny = policy.assign([request(tiny + small), request(tiny)], est, view_of(inst))
    assert inst[mixed.ranked[0]].model == "small"  # tiny is cheaper, but has no labels
    assert mixed.ranked[-1] == tiny[0]
    assert only_tiny.ranked == tiny  # no labelled model: passthrough


def priced(inst, model: str, per_mtok_in: float, per_mtok_out: float):
    return tuple(dataclasses.replace(i, price_input_per_mtok=per_mtok_in, price_output_per_mtok=per_mtok_out)
                 if i.model == model else i for i in inst)


def test_the_cost_is_input_plus_output_tokens_at_their_prices(knn):
    inst = pool()
    router = make_pipeline("avengers+round_robin", inst, knn, avengers={"clusters": 2}).router
    # Every training answer is 100 tokens; without per-prompt input tokens every prompt counts PROMPT_TOKENS.
    expected = [(PROMPT_TOKENS * MODELS[m][0] + 100 * MODELS[m][1]) / 1e6 for m in LABELLED]
    assert router.cost == pytest.approx(np.array([expected, expected]))


def test_an_expensive_input_price_changes_the_ranking(knn):
    """Cost alone (p_w = 0): small has the cheapest output, but once its input is dear enough, mid wins."""
    inst = pool()
    knobs = {"performance_weight": 0.0, "clusters": 2}
    assert set(routed(make_pipeline("avengers+round_robin", inst, knn, avengers=knobs), inst, probes())) == {"small"}
    dear = priced(inst, "small", 50.0, 0.2)  # 85 x 50 + 100 x 0.2 per 1M, against mid's 85 x 0.5 + 100 x 1.0
    assert set(routed(make_pipeline("avengers+round_robin", dear, knn, avengers=knobs), dear, probes())) == {"mid"}


def test_per_prompt_input_tokens_are_used_when_the_estimator_has_them(knn):
    """Cluster A's prompts are long, B's short: with small's input dear and its output cheap, A goes to mid."""
    # The fixture's rows: 30 of A, then 30 of B.
    with_tokens = KnnEstimator(knn.index, knn.quality, knn.length, knn.models,
                               input_tokens=np.array([1000.0] * 30 + [10.0] * 30))
    # Per 1M tokens, A (1000 in, 100 out): small 1000 x 0.5 + 100 x 0.01 = 501, mid 1000 x 0.1 + 100 x 1.0 = 200;
    # B (10 in): small 6, mid 101.
    inst = priced(priced(pool(), "small", 0.5, 0.01), "mid", 0.1, 1.0)
    knobs = {"performance_weight": 0.0, "clusters": 2}
    assert routed(make_pipeline("avengers+round_robin", inst, with_tokens, avengers=knobs), inst,
                  probes()) == ["mid"] * 4 + ["small"] * 4
    # The same prices without per-prompt tokens: every prompt 85 tokens, small (43.5) beats mid (108.5) everywhere.
    assert set(routed(make_pipeline("avengers+round_robin", inst, knn, avengers=knobs), inst, probes())) == {"small"}


def test_the_performance_weight_trades_quality_for_cost(knn):
    inst = pool()
    chosen = {w: routed(make_pipeline("avengers+round_robin", inst, knn,
                                      avengers={"performance_weight": w, "clusters": 2}), inst, probes())
              for w in (0.25, 0.39, 0.53, 0.70, 0.80)}
    price = {"small": 0, "mid": 1, "big": 2}
    spend = [sum(price[m] for m in chosen[w]) for w in sorted(chosen)]
    assert spend == sorted(spend)  # a higher weight never buys cheaper models
    assert chosen[0.25] != chosen[0.80]


def default_data() -> dict:
    return tomllib.loads(default_config_path().read_text())


def test_the_table_and_its_defaults():
    opts = parse_config(default_data()).options("avengers")
    assert (opts.performance_weight, opts.clusters, opts.seed) == (0.53, 64, 0)
    data = default_data()
    data["policies"]["avengers"]["performance_weight"] = 1.2
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert err.value.key == "policies.avengers.performance_weight"


@pytest.mark.parametrize(("old", "new"), [("avengers_performance_weight", "performance_weight"),
                                          ("avengers_clusters", "clusters")])
def test_the_old_pipeline_keys_say_where_they_moved(old, new):
    data = default_data()
    data["policies"]["pipeline"][old] = 1
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert err.value.key == f"policies.pipeline.{old}"
    assert "[policies.avengers]" in err.value.reason and f"`{new}`" in err.value.reason
