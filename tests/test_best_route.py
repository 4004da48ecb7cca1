"""BEST-Route: its scorer (P(an option matches the reference)), the cheapest option that clears the bar, the
scoring cost, and its config table."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import pytest
from test_pipeline import DIM, LABELLED, indices, make_pipeline, pool, request, unit, view_of

from conftest import RECORDS
from gateway.config.sections import parse_config
from gateway.config.store import default_config_path
from gateway.config_schema import ConfigError
from gateway.core.request import Estimates
from gateway.estimators.knn import KnnEstimator
from gateway.lab.training.build import label_arrays
from gateway.lab.workload.synthetic import generate
from gateway.policies import registry
from gateway.policies.pipeline.best_route import MatchScorer, expected_cost
from gateway.policies.pipeline.routers import model_prices
from gateway.records import split

# Two kinds of prompt, around basis vectors 0 and 1. How often each cheaper model falls short of big (scores
# below it; otherwise it matches):
SHORTFALL = {"A": {"small": 0.9, "mid": 0.6}, "B": {"small": 0.2, "mid": 0.3}}


def prompts(kind: str, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """n embeddings of a kind, and noisy quality labels (small, mid, big) drawn with its shortfall rates."""
    centre = np.zeros(DIM)
    centre["AB".index(kind)] = 1.0
    emb = unit(centre + 0.1 * rng.standard_normal((n, DIM)))
    q = np.full((n, 3), 0.5)
    for col, model in enumerate(("small", "mid")):
        short = rng.random(n) < SHORTFALL[kind][model]
        q[:, col] = np.where(short, 0.5 - rng.uniform(0.01, 0.3, n), 0.5 + rng.uniform(0.0, 0.3, n))
    return emb, q


def sample(n_each: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    (ea, qa), (eb, qb) = prompts("A", n_each, rng), prompts("B", n_each, rng)
    return np.vstack([ea, eb]), np.vstack([qa, qb])


@pytest.fixture(scope="module")
def noisy_knn() -> KnnEstimator:
    emb, q = sample(300, seed=1)
    return KnnEstimator.build(emb, q, np.full(q.shape, 100.0), LABELLED)


def log_loss(p: np.ndarray, y: np.ndarray) -> float:
    p = np.clip(p, 1e-9, 1 - 1e-9)
    return float(-(y * np.log(p) + (1 - y) * np.log(1 - p)).mean())


def fit(knn: KnnEstimator, inst=None, length=None, input_tokens=None, **kw) -> MatchScorer:
    """The scorer trained on a KNN's training set, as the policy trains it (lengths and prompts: the KNN's own)."""
    x = knn.index.reconstruct_n(0, knn.index.ntotal)
    return MatchScorer.fit(x, knn.quality, knn.length if length is None else length,
                           knn.input_tokens if input_tokens is None else input_tokens, LABELLED,
                           model_prices(inst or pool()), **kw)


def test_the_scorer_learns_on_which_prompts_an_option_matches_the_reference(noisy_knn):
    sc = fit(noisy_knn)
    assert sc.models == ("small", "mid") and sc.reference == "big"  # the priciest answer is the reference
    x, q = sample(200, seed=2)  # held out
    y = (q[:, :2] >= q[:, [2]]).astype(float)
    p = sc.predict(x)
    assert p.shape == (400, 2) and ((p > 0) & (p < 1)).all()
    base = (noisy_knn.quality[:, :2] >= noisy_knn.quality[:, [2]]).mean(axis=0)  # the best constant predictor
    gain = [log_loss(np.full(400, base[k]), y[:, k]) - log_loss(p[:, k], y[:, k]) for k in range(2)]
    assert gain[0] > 0.1 and gain[1] > 0.01  # mid's two rates are closer together: less to learn
    a, b = p[:200].mean(axis=0), p[200:].mean(axis=0)  # P(match) = 1 - the kind's shortfall rate
    assert a[0] == pytest.approx(0.1, abs=0.1) and b[0] == pytest.approx(0.8, abs=0.1)
    assert a[1] == pytest.approx(0.4, abs=0.1) and b[1] == pytest.approx(0.7, abs=0.1)


def test_a_tie_with_the_reference_counts_as_a_match():
    rng = np.random.default_rng(8)
    emb = np.vstack([prompts("A", 100, rng)[0], prompts("B", 100, rng)[0]])
    q = np.tile([0.0, 0.0, 1.0], (200, 1))  # 0/1 labels: big always right, mid never
    q[:100, 0] = 1.0  # on kind A small ties big (both right); on kind B it is wrong
    sc = fit(KnnEstimator.build(emb, q, np.full(q.shape, 100.0), LABELLED))
    p = sc.predict(emb)
    assert p[:100, 0].mean() > 0.8 and p[100:, 0].mean() < 0.2  # "at least as good": the tie matches
    assert p[:, 1].max() < 0.05  # mid never matches


def test_training_is_deterministic_for_a_seed(noisy_knn):
    one, two = (fit(noisy_knn, seed=4) for _ in range(2))
    assert one.l2 == two.l2 and np.array_equal(one.weights, two.weights)


def test_the_margin_widens_what_counts_as_a_match(noisy_knn):
    strict, relaxed = fit(noisy_knn, margin=0.0), fit(noisy_knn, margin=0.15)
    x = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    assert (relaxed.predict(x).mean(axis=0) > strict.predict(x).mean(axis=0) + 0.1).all()


def test_the_reference_is_the_model_whose_answer_is_expected_to_cost_most(noisy_knn):
    inst = tuple(dataclasses.replace(i, price_output_per_mtok=9.0) if i.model == "mid" else i for i in pool())
    assert fit(noisy_knn, inst).reference == "mid"
    # By price alone big is the priciest (4.0 against 1.0 per 1M output tokens), but mid's answers are 8x longer.
    length = np.tile([100.0, 800.0, 100.0], (noisy_knn.index.ntotal, 1))
    sc = fit(noisy_knn, length=length)
    assert sc.reference == "mid" and sc.models == ("small", "big")
    assert sc.answer_tokens == {"small": 100.0, "mid": 800.0, "big": 100.0}


def test_the_expected_cost_pays_the_prompt_once_and_each_answer():
    price = (1e-6, 4e-6)  # USD per input, output token
    assert expected_cost(price, 100, 50) == pytest.approx(100e-6 + 200e-6)
    assert expected_cost(price, 100, 50, n=3) == pytest.approx(100e-6 + 600e-6)


def route(policy, inst, emb, cands=None) -> list[str]:
    cands = tuple(range(len(inst))) if cands is None else cands
    n = len(emb)
    est = Estimates(np.zeros((n, len(inst))), np.full((n, len(inst)), 100.0), emb)
    return [inst[d.ranked[0]].model for d in policy.assign([request(cands) for _ in range(n)], est, view_of(inst))]


@pytest.mark.parametrize(("threshold", "a", "b"), [
    (0.0, "big", "big"),  # nothing is sure enough: everything to the reference
    (0.45, "big", "small"),
    (0.75, "mid", "small"),
    (1.0, "small", "small"),  # anything goes: the cheapest
])
def test_the_cheapest_model_within_the_threshold_else_the_reference(noisy_knn, threshold, a, b):
    inst = pool()
    policy = make_pipeline("best_route+round_robin", inst, noisy_knn, best_route={"threshold": threshold})
    rng = np.random.default_rng(3)
    emb = np.vstack([prompts("A", 10, rng)[0], prompts("B", 10, rng)[0]])
    picked = route(policy, inst, emb)
    assert picked[:10].count(a) >= 9 and picked[10:].count(b) >= 9


def test_options_are_tried_by_expected_cost_not_by_price(noisy_knn):
    # small's answers are 10x longer than mid's: 1000 x 0.2 costs more than 100 x 1.0 per 1M output tokens.
    emb = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    length = np.tile([1000.0, 100.0, 100.0], (len(emb), 1))
    knn = KnnEstimator.build(emb, noisy_knn.quality, length, LABELLED)
    inst = pool()
    anything = make_pipeline("best_route+round_robin", inst, knn, best_route={"threshold": 1.0})
    assert set(route(anything, inst, sample(10, seed=9)[0])) == {"mid"}  # the bar is 0: the cheapest option


def test_a_long_prompt_reorders_the_options_by_their_input_price(noisy_knn):
    # small: 3.0 per 1M input tokens, 0.2 output; mid: 0.5 and 1.0. 100-token answers everywhere.
    inst = tuple(dataclasses.replace(i, price_input_per_mtok=3.0) if i.model == "small" else i for i in pool())
    policy = make_pipeline("best_route+round_robin", inst, noisy_knn, best_route={"threshold": 1.0})
    emb = sample(1, seed=10)[0]
    est = Estimates(np.zeros((2, len(inst))), np.full((2, len(inst)), 100.0), emb)
    short, long = (request(range(len(inst)), input_tokens=t) for t in (10, 1000))
    picked = [inst[d.ranked[0]].model for d in policy.assign([short, long], est, view_of(inst))]
    assert picked == ["small", "mid"]  # 30 + 20 against 5 + 100; then 3000 + 20 against 500 + 100


def test_a_higher_threshold_never_picks_a_pricier_model(noisy_knn):
    inst = pool()
    emb = sample(50, seed=5)[0]
    price = {"small": 0, "mid": 1, "big": 2}
    previous = None
    for t in (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 1.0):
        picked = np.array([price[m] for m in route(make_pipeline("best_route+shortest_queue", inst, noisy_knn,
                                                                 best_route={"threshold": t}), inst, emb)])
        if previous is not None:
            assert (picked <= previous).all()
        previous = picked


def test_only_the_requests_own_models_and_never_an_unlabelled_one(noisy_knn):
    inst = pool(extra_model="tiny")
    policy = make_pipeline("best_route+round_robin", inst, noisy_knn, best_route={"threshold": 0.0})
    emb = prompts("A", 3, np.random.default_rng(6))[0]
    small_or_mid = indices(inst, "small") + indices(inst, "mid")
    tiny = indices(inst, "tiny")
    # No reference among the candidates: the one most likely to match it (in A, mid).
    assert route(policy, inst, emb[:1], small_or_mid) == ["mid"]
    assert route(policy, inst, emb[1:2], tiny + indices(inst, "small")) == ["small"]  # tiny has no labels
    assert route(policy, inst, emb[2:], tiny) == ["tiny"]  # no labelled model: like passthrough


def test_the_scorer_is_trained_when_the_policy_is_built_and_kept(noisy_knn, monkeypatch):
    inst = pool()
    policy = make_pipeline("best_route+random", inst, noisy_knn)
    assert isinstance(policy.router.scorer, MatchScorer)
    monkeypatch.setattr(MatchScorer, "fit", classmethod(lambda *a, **k: pytest.fail("retrained")))
    assert len(route(policy, inst, sample(5, seed=7)[0])) == 10


def test_serial_scoring_costs_a_forward_per_prompt_and_concurrent_one_per_batch(noisy_knn):
    def cost(scoring, n, **knobs):
        policy = make_pipeline("best_route+round_robin", pool(), noisy_knn, best_route={"scoring": scoring, **knobs})
        return policy.compute_s(n, None)

    assert cost("concurrent", 1) == pytest.approx(0.055)  # the default forward: 55 ms
    assert [cost("serial", n) for n in (1, 4, 16)] == pytest.approx([0.055, 0.220, 0.880])
    assert [cost("concurrent", n) for n in (1, 4, 16)] == pytest.approx([0.055] * 3)
    assert cost("serial", 3, forward_ms=431.0) == pytest.approx(1.293)
    assert make_pipeline("passthrough+round_robin").compute_s(16, None) < 0.001


# --- on the bundled estimators: the small synthetic build every test shares ---------------------------


@pytest.fixture(scope="module")
def held_out(built):
    """(config, estimators, per-instance label scores, Estimates) of the held-out prompts of the shared build."""
    cfg, _, est = built
    _, test = split(generate(RECORDS, seed=cfg.estimators.seed))
    scores, _ = label_arrays(test, tuple(i.model for i in cfg.instances))
    return cfg, est, scores, est.for_instances([r.prompt for r in test], cfg.instances)


def tier_shares(held_out, threshold: float) -> tuple[dict[str, float], float]:
    cfg, est, scores, estimates = held_out
    policy = registry.build("best_route+shortest_queue", cfg.with_options("best_route", threshold=threshold), est)
    n, inst = len(scores), cfg.instances
    picked = [d.ranked[0] for d in policy.assign([request(range(len(inst))) for _ in range(n)], estimates,
                                                  view_of(inst))]
    models = [inst[i].model.split("-")[1] for i in picked]
    return {m: models.count(m) / n for m in set(models)}, float(scores[np.arange(n), picked].mean())


def test_on_the_bundled_labels_threshold_0_takes_72b_and_a_high_one_floods_3b(held_out):
    low, low_quality = tier_shares(held_out, 0.0)
    high, high_quality = tier_shares(held_out, 0.8)
    assert low == {"72B": 1.0}
    assert high.get("3B", 0) >= 0.9
    assert low_quality > high_quality
    mid, _ = tier_shares(held_out, 0.5)
    assert len(mid) >= 2  # in between, the scorer splits the traffic


# --- config -------------------------------------------------------------------------------------------


def default_data() -> dict:
    return tomllib.loads(default_config_path().read_text())


def test_the_table_is_checked():
    cfg = parse_config(default_data())
    assert cfg.options("best_route").threshold == 0.5 and cfg.options("best_route").scoring == "concurrent"
    for key, bad in (("threshold", 1.5), ("scoring", "parallel"), ("forward_ms", -1.0), ("margin", 2.0)):
        data = default_data()
        data["policies"]["best_route"][key] = bad
        with pytest.raises(ConfigError) as err:
            parse_config(data)
        assert err.value.key == f"policies.best_route.{key}"


def test_the_old_pipeline_key_says_where_it_moved():
    data = default_data()
    data["policies"]["pipeline"]["best_route_threshold"] = 0.02
    with pytest.raises(ConfigError) as err:
        parse_config(data, "old.toml")
    assert err.value.key == "policies.pipeline.best_route_threshold"
    assert "[policies.best_route]" in err.value.reason and "`threshold`" in err.value.reason
