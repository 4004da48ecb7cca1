"""The learned heads and the cross-validation that chooses among estimators (gateway/estimators/heads.py,
crossfit.py), on planted data where the right answer is known."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.estimators.crossfit import (
    QUALITY_CANDIDATES,
    EstimatorCandidate,
    Pricing,
    above_hull,
    choose,
    folds,
    out_of_fold,
)
from gateway.estimators.heads import LengthHeads, QualityHeads, fit_logistic, load_heads, save_heads

MODELS = ("small", "big")


def unit_rows(n: int, d: int = 16, seed: int = 0) -> np.ndarray:
    x = np.random.default_rng(seed).normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def pricing(n: int, length: np.ndarray) -> Pricing:
    price_in, price_out = np.array([1e-7, 1e-6]), np.array([1e-7, 1e-6])
    input_len = np.full(n, 50.0)
    return Pricing(price_in, price_out, input_len, input_len[:, None] * price_in + length * price_out)


def test_the_logistic_head_learns_a_planted_direction_and_the_ridge_head_a_length():
    x = unit_rows(600)
    u = np.zeros(16)
    u[0] = 1.0
    right = (x @ u > 0).astype(np.float32)
    w, b = fit_logistic(x[:400], right[:400], l2=0.1)
    p = 1 / (1 + np.exp(-(x[400:] @ w + b)))
    assert ((p > 0.5) == (right[400:] == 1)).mean() > 0.9
    lengths = np.exp(5 + 2 * x[:, 1:2] * np.ones((1, 2)))  # answer length grows with the second coordinate
    head = LengthHeads.fit(x[:400], lengths[:400], MODELS, l2=0.01)
    error = np.abs(head.predict(x[400:]) - lengths[400:]) / lengths[400:]
    assert np.median(error) < 0.1
    assert head.predict(x[400:]).max() <= lengths[:400].max() + 1e-3  # never beyond what training saw


def test_heads_survive_a_save_and_load(tmp_path):
    x = unit_rows(200)
    quality = (np.random.default_rng(1).random((200, 2)) < 0.5).astype(np.float32)
    q = QualityHeads.fit(x, quality, MODELS, l2=1.0, rank=4)
    ln = LengthHeads.fit(x, np.full((200, 2), 30.0), MODELS, l2=1.0)
    save_heads(tmp_path, q, ln)
    q2, ln2 = load_heads(tmp_path / "heads.npz")
    assert q2.models == MODELS and q2.projection.shape == (16, 4)
    np.testing.assert_allclose(q2.predict(x), q.predict(x))
    np.testing.assert_allclose(ln2.predict(x), ln.predict(x))
    save_heads(tmp_path, None, ln)  # quality from the KNN: no quality head stored
    assert load_heads(tmp_path / "heads.npz")[0] is None


def test_folds_cover_every_record_once_and_a_seed_fixes_them():
    parts = folds(23, 5, seed=3)
    assert sorted(np.concatenate(parts).tolist()) == list(range(23))
    assert all(np.array_equal(a, b) for a, b in zip(parts, folds(23, 5, seed=3), strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(parts, folds(23, 5, seed=4), strict=True))
    # a prompt that appears twice (the same key) never lands on both sides; rows without a key ("") stay apart
    groups = np.array(["a", "b", "a", "", "c", "b", "", "a", "d", "e"])
    parts = folds(10, 3, seed=0, groups=groups)
    assert sorted(np.concatenate(parts).tolist()) == list(range(10))
    fold_of = {int(r): f for f, part in enumerate(parts) for r in part}
    for key in ("a", "b"):
        assert len({fold_of[r] for r in np.flatnonzero(groups == key)}) == 1
    assert all(len(part) for part in parts)


def test_out_of_fold_estimates_never_see_their_own_prompt():
    """Labels that are pure noise: a one-neighbour KNN that saw its own prompt would know every label and route
    like the oracle; out of fold it can do no better than the single models' hull."""
    n = 300
    x = unit_rows(n)
    rng = np.random.default_rng(2)
    quality = (rng.random((n, 2)) < [0.5, 0.7]).astype(np.float32)
    length = np.full((n, 2), 100.0, dtype=np.float32)
    price = pricing(n, length)
    memoriser = EstimatorCandidate("knn k=1 raw", "knn", {"k": 1, "shrink": False})
    oof = out_of_fold(x, quality, length, price, MODELS, folds_k=5, repeats=2, inner_k=3,
                      quality_candidates=(memoriser,), length_candidates=(EstimatorCandidate("knn", "knn", {"k": 10}),))
    rows = np.arange(n)
    in_sample = above_hull(quality, length, quality, price, rows)  # what knowing the labels would give
    assert in_sample > 0.1
    held_out = np.mean([above_hull(oof.quality[r], oof.length[r], quality, price, rows) for r in range(2)])
    assert held_out < 0.03
    assert len(oof.chosen) == 10  # one choice per outer fold


def test_choice_follows_the_routing_criterion_inside_the_folds():
    """The small model is right exactly where the first coordinate is positive, the big one everywhere else
    half the time: a head that sees the direction routes better than the prompt-blind candidate, and the
    choice, made in each outer fold, says so."""
    n = 400
    x = unit_rows(n, seed=5)
    rng = np.random.default_rng(6)
    quality = np.column_stack([(x[:, 0] > 0), rng.random(n) < 0.5]).astype(np.float32)
    length = np.full((n, 2), 100.0, dtype=np.float32)
    price = pricing(n, length)
    # every prompt's neighbours are all of them: the same estimate for every prompt
    blind = EstimatorCandidate("knn everyone", "knn", {"k": n, "shrink": False})
    head = EstimatorCandidate("logistic", "logistic", {"l2": 0.1})
    lengths = (EstimatorCandidate("knn", "knn", {"k": 10}),)
    choice = choose(x, quality, length, price, MODELS, np.arange(n), quality_candidates=(blind, head),
                    length_candidates=lengths)
    assert choice.quality is head
    assert choice.scores["quality: logistic"] > choice.scores["quality: knn everyone"] + 0.05
    oof = out_of_fold(x, quality, length, price, MODELS, folds_k=4, repeats=1, inner_k=3,
                      quality_candidates=(blind, head), length_candidates=lengths)
    assert [q for q, _ in oof.chosen] == ["logistic"] * 4
    assert choice.heads(x, quality, length, MODELS)[0] is not None and choice.knn_k == 10


@pytest.mark.parametrize("candidate", QUALITY_CANDIDATES, ids=lambda c: c.name)
def test_every_shipped_candidate_fits_and_predicts_probabilities(candidate):
    x = unit_rows(120)
    quality = (np.random.default_rng(3).random((120, 2)) < 0.5).astype(np.float32)
    q, _ = candidate.fit(x[:100], quality[:100], np.full((100, 2), 50.0, dtype=np.float32), MODELS).predict(x[100:])
    assert q.shape == (20, 2) and (q >= 0).all() and (q <= 1).all()


def test_the_routing_criterion_can_leave_out_models_the_pool_does_not_serve():
    """A model the pool no longer serves has no price: routing among all columns would pick it (free and always
    right); among the pool's columns it is never a pick, and the criterion is that of the two pool models."""
    n = 200
    rng = np.random.default_rng(4)
    quality = np.column_stack([rng.random(n) < 0.4, rng.random(n) < 0.7, np.ones(n)]).astype(np.float32)
    length = np.full((n, 3), 100.0, dtype=np.float32)
    price = np.array([1e-7, 1e-6, 0.0])
    input_len = np.full(n, 50.0)
    pricing = Pricing(price, price, input_len, input_len[:, None] * price + length * price)
    rows = np.arange(n)
    knowing = quality.copy()
    everything = above_hull(knowing, length, quality, pricing, rows)
    pool_only = above_hull(knowing, length, quality, pricing, rows, columns=[0, 1])
    two = Pricing(price[:2], price[:2], input_len, pricing.cost[:, :2])
    assert pool_only == pytest.approx(above_hull(knowing[:, :2], length[:, :2], quality[:, :2], two, rows))
    assert everything != pytest.approx(pool_only)
