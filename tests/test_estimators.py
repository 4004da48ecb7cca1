"""The estimator pipeline end to end: `train` artefacts, loading, estimates, and bad artefacts."""

from __future__ import annotations

import dataclasses
import shutil

import numpy as np
import pytest

from conftest import RECORDS, small_config
from gateway.artefacts import ArtefactError
from gateway.config.store import default_config_path, load_config
from gateway.estimators.bundle import Estimators
from gateway.estimators.knn import KnnEstimator
from gateway.lab.experiments.embedder_frontier import option_config
from gateway.lab.training.build import (
    ensure_built,
    format_report,
    inputs_from_config,
    label_arrays,
    preset_quality,
)
from gateway.lab.workload.synthetic import generate
from gateway.records import MAX_OUTPUT_TOKENS, split


def test_train_report_shows_knn_above_random_and_heads_above_the_prior(built):
    cfg, manifest, _ = built
    knn = manifest["report"]["knn"]
    assert knn["best_model_hit_rate"] > knn["random_hit_rate"]
    assert knn["quality_oracle"] > knn["quality_of_picks"] > min(knn["quality_always"].values())
    tiers = {f"{i.model}@{i.gpu}" for i in cfg.instances}
    assert set(manifest["heads"]) == tiers
    for tier, h in manifest["report"]["heads"].items():
        assert h["head_mae_ms"] < h["prior_mae_ms"], tier
    # What a head misses by on its held-out traces reaches the scheduler (routebalance/assign.py reads it).
    assert built[2].heads.errors == {t: h["head_mape"] for t, h in manifest["report"]["heads"].items()}
    assert all(0 < e < 1 for e in built[2].heads.errors.values())
    text = format_report(manifest)
    assert "best-model hit rate" in text and "TPOT heads" in text


def test_ensure_built_reuses_current_artefacts(built):
    cfg, manifest, _ = built
    assert ensure_built(cfg)["built_at"] == manifest["built_at"]
    # A pool that dropped a tier is still served by the build (test_real_instances.py: what else is).
    fewer = dataclasses.replace(cfg, instances=tuple(i for i in cfg.instances if "72B" not in i.model))
    assert ensure_built(fewer)["built_at"] == manifest["built_at"]


def test_identical_prompts_get_identical_estimates_and_batch_matches_single(built):
    _, _, est = built
    prompts = [r.prompt for r in split(generate(RECORDS))[1][:12]]
    batch = est.estimate(prompts + [prompts[0]])
    assert np.array_equal(batch.quality[0], batch.quality[-1])
    for i in (0, 5, 11):
        single = est.estimate([prompts[i]])
        assert np.allclose(single.quality[0], batch.quality[i], atol=1e-5)
        assert np.allclose(single.length[0], batch.length[i], atol=1e-3)
    assert batch.quality.shape == (13, 4) and np.all((batch.quality >= 0) & (batch.quality <= 1))
    assert np.all((batch.length >= 1) & (batch.length <= MAX_OUTPUT_TOKENS))


def test_a_prompt_marked_blind_is_not_embedded_and_gets_its_models_priors(built):
    cfg, _, est = built
    prompts = [r.prompt for r in split(generate(RECORDS))[1][20:24]]
    looked = est.for_instances(prompts, cfg.instances)
    hits, misses = est.embedder.cache_counts()
    mixed = est.for_instances(prompts, cfg.instances, [False, True, False, True])
    assert sum(est.embedder.cache_counts()) - hits - misses == 2  # only the two looked-at prompts went in
    for k in (0, 2):
        assert np.allclose(mixed.quality[k], looked.quality[k]) and np.allclose(mixed.length[k], looked.length[k])
    quality, length = est.priors(cfg.instances)
    models = [i.model for i in cfg.instances]
    for k in (1, 3):
        assert np.array_equal(mixed.quality[k], quality) and np.array_equal(mixed.length[k], length)
        assert not mixed.embeddings[k].any()
    # one value per model (its label means), and the models differ
    j = {m: models.index(m) for m in models}
    big, small = (next(m for m in models if size in m) for size in ("72B", "3B"))
    assert length[j[big]] != length[j[small]]
    for col, m in enumerate(models):
        assert quality[col] == quality[j[m]] and length[col] == length[j[m]]


def test_a_prompt_on_top_of_a_labelled_neighbour_gets_its_labels_shrunk_toward_the_prior(built):
    _, _, est = built
    train, _ = split(generate(RECORDS))
    record = train[3]
    vector = est.embedder.embed([record.prompt])
    expected_q = np.array([record.models[m].score for m in est.knn.models])
    expected_len = [record.models[m].output_length for m in est.knn.models]
    # cos = 1 gives weight 1e6 against at most ~10 for the others: the neighbour dominates the raw means.
    raw = est.knn.estimate(vector, shrink=False)
    assert np.allclose(raw.quality[0], expected_q, atol=1e-3)
    assert np.allclose(raw.length[0], expected_len, rtol=1e-3)
    # One neighbour is one label's worth of evidence: the served estimate moves from each model's prior
    # toward that label, part of the way.
    prior = est.knn.prior.mean
    shrunk = est.knn.estimate(vector).quality[0]
    between = np.minimum(prior, expected_q) - 1e-6, np.maximum(prior, expected_q) + 1e-6
    assert np.all((between[0] <= shrunk) & (shrunk <= between[1]))
    assert np.abs(shrunk - prior).sum() > 0 and np.abs(shrunk - expected_q).sum() > 0


@pytest.fixture(scope="module")
def held_out_vectors(built):
    """Embeddings of the prompts the suite's build held out, and of 600 after them."""
    records = generate(RECORDS + 600)
    held = split(records[:RECORDS])[1] + records[RECORDS:]
    return built[2].embedder.embed([r.prompt for r in held])


@pytest.mark.parametrize("binary", [False, True], ids=["graded", "0/1"])
def test_quality_preset_picks_beat_the_best_single_model_on_held_out_prompts(built, held_out_vectors, binary):
    """Trained on graded or on 0/1 labels, Eq. 1's quality preset over the shrunk estimates picks
    models whose held-out labels beat always sending to the best single model; on 0/1 labels the
    shrinkage does better than the raw neighbour means (which chase the luckiest model)."""
    cfg, _, est = built
    records = generate(RECORDS + 600, binary=binary)
    train, held = split(records[:RECORDS])
    held += records[RECORDS:]
    models = est.knn.models
    quality, length = label_arrays(train, models)
    # The build's index holds the training prompts' embeddings in order: the same prompts, relabelled.
    knn = KnnEstimator.build(est.knn.index.reconstruct_n(0, est.knn.index.ntotal), quality, length, models)
    truth, _ = label_arrays(held, models)
    shrunk = preset_quality(knn.estimate(held_out_vectors), truth, held, cfg)
    raw = preset_quality(knn.estimate(held_out_vectors, shrink=False), truth, held, cfg)
    best_single = truth.mean(axis=0).max()
    assert shrunk >= best_single + 0.01
    if binary:
        assert knn.prior.noise_var.min() > 0.15  # 0/1 labels: most of a neighbourhood's spread is noise
        assert shrunk >= raw


@pytest.mark.parametrize("changes", [{"precision": "int8"}, {"max_tokens": 128}])
def test_an_index_built_with_one_embedder_is_not_served_with_another(built, changes):
    """The index holds embeddings made at the build's truncation and precision: a config asking for others
    is refused with the command that rebuilds, and `up` and `train` see the build as stale."""
    cfg, manifest, _ = built
    other = dataclasses.replace(cfg, estimators=dataclasses.replace(cfg.estimators, **changes))
    with pytest.raises(ArtefactError, match="routebalance train"):
        Estimators.load(other)
    assert inputs_from_config(other).fingerprint() != manifest["inputs"]
    assert inputs_from_config(cfg).fingerprint() == manifest["inputs"]


@pytest.mark.parametrize("victim", ["knn.faiss", "knn_labels.npz", "minilm.onnx", "manifest.json"])
def test_missing_or_corrupt_artefacts_are_named(built, tmp_path, victim):
    cfg, _, _ = built
    copy = tmp_path / "models"
    shutil.copytree(cfg.estimators.models_dir, copy)
    broken = small_config(copy)
    (copy / victim).unlink()
    with pytest.raises(ArtefactError, match=victim):
        Estimators.load(broken)
    shutil.copy(f"{cfg.estimators.models_dir}/{victim}", copy / victim)
    Estimators.load(broken)  # restored: loads again
    with open(copy / victim, "r+b") as f:
        f.seek(100)
        f.write(b"garbage!")
    with pytest.raises(ArtefactError, match=victim):
        Estimators.load(broken)


def test_shrinkage_prior_is_not_thrown_by_duplicate_prompts():
    """A training set where every prompt appears twice: each neighbourhood is dominated by the twin,
    which says nothing about label noise; the fit must not divide by n_eff - 1 near 0."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 16)).astype(np.float32)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    quality = rng.random((300, 2)).astype(np.float32)  # pure noise, variance 1/12
    single = KnnEstimator.build(x, quality, np.ones_like(quality), ("a", "b")).prior
    twice = KnnEstimator.build(np.vstack([x, x]), np.vstack([quality, quality]), np.ones((600, 2)), ("a", "b")).prior
    assert np.all(single.noise_var == pytest.approx(1 / 12, rel=0.25))
    assert np.all(np.isfinite(twice.noise_var)) and np.all(twice.noise_var < 0.2)
    # No signal in the labels: estimates stay near each model's prior mean.
    assert np.all(single.signal_var < 0.1 * single.noise_var)


def test_an_embedder_option_config_changes_the_estimators_table_only(tmp_path):
    """embedder_frontier's per-option config: the built-in config with [estimators] models_dir, precision and
    max_tokens set, every other table as it was."""
    base = load_config(default_config_path())
    path = tmp_path / "option.toml"
    path.write_text(option_config(default_config_path().read_text(), "models-int8",
                                  {"precision": "int8", "max_tokens": 128}))
    option = load_config(path)
    assert (option.estimators.models_dir, option.estimators.precision, option.estimators.max_tokens) == \
        ("models-int8", "int8", 128)
    assert dataclasses.replace(option.estimators, models_dir=base.estimators.models_dir, precision="fp32",
                               max_tokens=256) == base.estimators
    assert option.instances == base.instances and option.policies == base.policies
    with pytest.raises(ValueError, match="no_such_key"):
        option_config(default_config_path().read_text(), "m", {"no_such_key": 1})
