"""The untuned world: drawn from a fixed seed, the same prompts as the calibrated world with other labels,
and its pool (speeds, prices, batch slopes) reaching the simulator, the emulator and `train`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from gateway.config.store import default_config_path, load_config
from gateway.config_schema import ConfigError
from gateway.core.engine.profiles import spec_for_instance
from gateway.lab.emulator.settings import emulator_of, engine_for
from gateway.lab.sim.evalset import evaluation_records
from gateway.lab.training.build import inputs_from_config
from gateway.lab.workload.synthetic import POOL_MODELS, generate
from gateway.lab.workload.worlds import calibrated, config_text, untuned

UNTUNED_CONFIG = Path(__file__).resolve().parents[1] / "gateway" / "examples" / "untuned-world.toml"


def test_the_committed_config_is_the_specification_s_own():
    made = config_text(untuned(), default_config_path().read_text(), "models-untuned")
    assert UNTUNED_CONFIG.read_text() == made, (
        "gateway/examples/untuned-world.toml differs from what worlds.py makes: regenerate it with "
        "config_text(untuned(), default_config_path().read_text(), 'models-untuned')")


def test_the_untuned_world_is_fixed_by_its_seed_and_is_another_world():
    world, again, tuned = untuned(), untuned(), calibrated(load_config(default_config_path()))
    assert world == again
    assert untuned(seed=1) != world
    for model in POOL_MODELS:
        assert world.labels.models[model] != tuned.labels.models[model]
        assert world.tpot_ms[model] != tuned.tpot_ms[model]
        assert world.prices[model] != tuned.prices[model]
        assert world.batch_slope[model] != tuned.batch_slope[model]


def test_the_same_prompts_get_other_labels():
    world = untuned().labels
    tuned, other = generate(400, seed=5), generate(400, seed=5, world=world)
    assert [r.prompt for r in tuned] == [r.prompt for r in other]
    scores = {w: np.array([[r.models[m].score for m in POOL_MODELS] for r in rs]) for w, rs in
              (("tuned", tuned), ("other", other))}
    assert np.abs(scores["tuned"] - scores["other"]).mean() > 0.05
    lengths = {w: np.mean([[r.models[m].output_length for m in POOL_MODELS] for r in rs], axis=0)
               for w, rs in (("tuned", tuned), ("other", other))}
    assert not np.allclose(lengths["tuned"], lengths["other"], rtol=0.1)


def test_the_world_s_config_reaches_the_engines_the_held_out_prompts_and_train():
    cfg, base = load_config(UNTUNED_CONFIG), load_config(default_config_path())
    world = untuned()
    assert emulator_of(cfg).world == "untuned"
    for inst in cfg.instances:
        engine = engine_for(cfg, inst)
        assert engine.batch_slope == pytest.approx(world.batch_slope[inst.model], abs=1e-4)
        assert engine.tpot_s == pytest.approx(world.tpot_ms[inst.model] / 1000)
        assert engine_for(base, inst).batch_slope == spec_for_instance(inst).batch_slope  # no override
    small = dataclasses.replace(cfg.estimators, train_records=50)
    held_out = evaluation_records(dataclasses.replace(cfg, estimators=small), 20)
    assert held_out == generate(70, seed=cfg.estimators.seed, world=world.labels)[50:]
    ours, theirs = inputs_from_config(cfg), inputs_from_config(base)
    assert ours.fingerprint() != theirs.fingerprint()  # a build of one world is never taken for the other's
    assert [t.batch_slope for t in ours.tiers] != [t.batch_slope for t in theirs.tiers]


def test_a_batch_slope_out_of_range_is_refused_naming_its_key(tmp_path):
    text = default_config_path().read_text().replace("batch_slopes = {}", 'batch_slopes = { "m" = 2.0 }')
    path = tmp_path / "config.toml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="batch_slopes.m"):
        emulator_of(load_config(path))
