"""BEST-Route: its own shortfall classifier, the threshold rule, the scoring cost, and its config table."""

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
from gateway.policies.pipeline.best_route import ShortfallClassifier
from gateway.policies.pipeline.routers import model_prices
from gateway.records import split

# Two kinds of prompt, around basis vectors 0 and 1. How often each cheaper model falls short of big:
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


def test_the_classifier_learns_which_prompts_a_cheaper_model_falls_short_on(noisy_knn):
    train_x = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    clf = ShortfallClassifier.fit(train_x, noisy_knn.quality, LABELLED, model_prices(pool()))
    assert clf.models == ("small", "mid") and clf.reference == "big"  # cheapest first; the priciest is the reference
    x, q = sample(200, seed=2)  # held out
    y = (q[:, :2] < q[:, [2]]).astype(float)
    p = clf.predict(x)
    assert p.shape == (400, 2) and ((p > 0) & (p < 1)).all()
    base = (noisy_knn.quality[:, :2] < noisy_knn.quality[:, [2]]).mean(axis=0)  # the best constant predictor
    gain = [log_loss(np.full(400, base[k]), y[:, k]) - log_loss(p[:, k], y[:, k]) for k in range(2)]
    assert gain[0] > 0.1 and gain[1] > 0.01  # mid's two rates are closer together: less to learn
    a, b = p[:200].mean(axis=0), p[200:].mean(axis=0)
    assert a[0] == pytest.approx(0.9, abs=0.1) and b[0] == pytest.approx(0.2, abs=0.1)
    assert a[1] == pytest.approx(0.6, abs=0.1) and b[1] == pytest.approx(0.3, abs=0.1)


def test_training_is_deterministic_for_a_seed(noisy_knn):
    x = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    one, two = (ShortfallClassifier.fit(x, noisy_knn.quality, LABELLED, model_prices(pool()), seed=4)
                for _ in range(2))
    assert one.l2 == two.l2 and np.array_equal(one.weights, two.weights)


def test_the_margin_relaxes_what_counts_as_falling_short(noisy_knn):
    x = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    strict = ShortfallClassifier.fit(x, noisy_knn.quality, LABELLED, model_prices(pool()), margin=0.0)
    relaxed = ShortfallClassifier.fit(x, noisy_knn.quality, LABELLED, model_prices(pool()), margin=0.15)
    assert (relaxed.predict(x).mean(axis=0) < strict.predict(x).mean(axis=0) - 0.1).all()


def test_the_reference_is_the_model_with_the_highest_output_price(noisy_knn):
    inst = tuple(dataclasses.replace(i, price_output_per_mtok=9.0) if i.model == "mid" else i for i in pool())
    x = noisy_knn.index.reconstruct_n(0, noisy_knn.index.ntotal)
    clf = ShortfallClassifier.fit(x, noisy_knn.quality, LABELLED, model_prices(inst))
    assert clf.reference == "mid" and clf.models == ("small", "big")


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
    # No reference among the candidates: the one least likely to fall short (in A, mid).
    assert route(policy, inst, emb[:1], small_or_mid) == ["mid"]
    assert route(policy, inst, emb[1:2], tiny + indices(inst, "small")) == ["small"]  # tiny has no labels
    assert route(policy, inst, emb[2:], tiny) == ["tiny"]  # no labelled model: like passthrough


def test_the_classifier_is_trained_when_the_policy_is_built_and_kept(noisy_knn, monkeypatch):
    inst = pool()
    policy = make_pipeline("best_route+random", inst, noisy_knn)
    assert isinstance(policy.router.classifier, ShortfallClassifier)
    monkeypatch.setattr(ShortfallClassifier, "fit", classmethod(lambda *a, **k: pytest.fail("retrained")))
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
    assert len(mid) >= 2  # in between, the classifier splits the traffic


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
