"""Simulated worlds: the constants a synthetic workload and the emulated pool are drawn with.

`calibrated` is the world `routebalance calibrate` tuned to the RouteBalance
paper's figures (synthetic.py's constants, the engine profiles' batch slopes,
the packaged config's speeds and prices): a result there that was a
calibration target holds by construction. `untuned` is drawn from a seed,
from wide ranges that no paper's figure was read to set, so an ordering that
survives there is not an artefact of the tuning:

- quality structure: each model's gain over the 3B at full difficulty (bigger
  is better on average by random amounts, and the 72B's lead over the 14B may
  be negative), how far each model's topic rankings stray, and each kind's
  level, size gap and answer length;
- answer lengths: each model's mean and how much longer it answers hard prompts;
- the pool: each model's time per output token at batch 1, its batch slope,
  and its input and output prices.

The prompts (their kinds' shares, lengths and difficulty) are the calibrated
world's in both, so two worlds differ in what the models do with the same
prompts. The specification (UNTUNED_SEED and the ranges in `untuned`) was
committed before the world's first run and is not to be changed after seeing
results; docs/simulator/worlds.md names the commit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from gateway.core.engine.profiles import arch_for
from gateway.lab.workload import synthetic
from gateway.lab.workload.synthetic import LabelConstants, ModelProfile

UNTUNED_SEED = 20261126  # fixed in advance: the day the specification was written


@dataclass(frozen=True)
class World:
    name: str
    labels: LabelConstants  # what the models answer: quality structure and answer lengths
    tpot_ms: dict[str, float]  # per model: decode time per token at batch 1 (the config's tpot_prior_ms)
    batch_slope: dict[str, float]  # per model: extra step time per extra sequence, as a share of a lone step
    prices: dict[str, tuple[float, float]]  # per model: USD per 1M input and output tokens


def calibrated(config) -> World:
    """The tuned world: synthetic.py's constants and the pool of `config` as it is."""
    first = {i.model: i for i in reversed(config.instances)}
    models = synthetic.POOL_MODELS
    return World("calibrated", synthetic.CALIBRATED,
                 {m: first[m].tpot_prior_ms for m in models if m in first},
                 {m: arch_for(m).batch_slope for m in models},
                 {m: (first[m].price_input_per_mtok, first[m].price_output_per_mtok) for m in models if m in first})


def untuned(seed: int = UNTUNED_SEED) -> World:
    """A world drawn from `seed` (module docstring): the same seed, the same world."""
    rng = np.random.default_rng(seed)
    three, seven, fourteen, seventy_two = synthetic.POOL_MODELS
    g7 = rng.uniform(0.02, 0.15)
    g14 = g7 + rng.uniform(0.0, 0.12)
    gains = {three: 0.0, seven: g7, fourteen: g14, seventy_two: g14 + rng.uniform(-0.04, 0.12)}
    models = {m: ModelProfile(gain=float(gains[m]), mean_output_tokens=float(rng.uniform(80, 320)),
                              answer_hard=float(rng.uniform(0.0, 1.5))) for m in synthetic.POOL_MODELS}
    kinds = {k: dataclasses.replace(p, base=float(rng.uniform(0.2, 0.5)), gap=float(rng.uniform(0.4, 1.8)),
                                    answer=float(rng.uniform(0.4, 1.8))) for k, p in synthetic.KINDS.items()}
    affinity = tuple(float(a) for a in rng.uniform(0.3, 3.0, len(synthetic.POOL_MODELS)))
    # Speeds and prices grow with size on average, by random factors over overlapping ranges.
    tpot = dict(zip(synthetic.POOL_MODELS, (rng.uniform(8, 20), rng.uniform(12, 32), rng.uniform(16, 45),
                                            rng.uniform(30, 90)), strict=True))
    slope = {m: float(rng.uniform(0.005, 0.04)) for m in synthetic.POOL_MODELS}
    out = dict(zip(synthetic.POOL_MODELS, (rng.uniform(0.03, 0.2), rng.uniform(0.05, 0.4), rng.uniform(0.1, 0.9),
                                           rng.uniform(0.3, 2.5)), strict=True))
    prices = {m: (round(float(out[m] * rng.uniform(0.2, 1.0)), 4), round(float(out[m]), 4))
              for m in synthetic.POOL_MODELS}
    tpot_ms = {m: round(float(t), 1) for m, t in tpot.items()}
    return World("untuned", LabelConstants(models, kinds, affinity), tpot_ms, slope, prices)


def world_labels(name: str) -> LabelConstants:
    """The label constants of the world of this name ([emulator] world)."""
    return untuned().labels if name == "untuned" else synthetic.CALIBRATED


def config_text(world: World, base: str, models_dir: str) -> str:
    """The packaged config's text (`base`) with this world's pool: each instance's speed and prices,
    [emulator]'s world and batch slopes, and the estimators built into `models_dir`."""
    slopes = ", ".join(f'"{m}" = {s:.4f}' for m, s in world.batch_slope.items())
    top = {"models_dir": f'"{models_dir}"', "world": f'"{world.name}"', "batch_slopes": f"{{ {slopes} }}"}
    out, model, pool, replaced = [], None, False, set()
    for line in base.splitlines():
        key = line.split("=", 1)[0].strip()
        if line.startswith("["):  # a table: an instance's own or one of its sub-tables keeps `pool`
            pool = line.startswith(("[[instances]]", "[instances."))
            model = None if line.startswith("[[instances]]") else model
        elif pool and key == "model":
            model = line.split("=", 1)[1].strip().strip('"')
        elif pool and model in world.prices and key in ("price_input_per_mtok", "price_output_per_mtok",
                                                        "tpot_prior_ms"):
            value = {"price_input_per_mtok": world.prices[model][0], "price_output_per_mtok": world.prices[model][1],
                     "tpot_prior_ms": world.tpot_ms[model]}[key]
            line = f"{key} = {value:g}"
        elif not pool and key in top and not line.lstrip().startswith("#"):
            line, _ = f"{key} = {top[key]}", replaced.add(key)
        out.append(line)
    if replaced != top.keys():
        raise ValueError(f"the base config lacks {sorted(top.keys() - replaced)}")
    header = (f"# The {world.name} world's configuration (gateway/lab/workload/worlds.py), made by `config_text`\n"
              "# from the packaged default: regenerate it rather than edit it (tests/test_worlds.py compares).\n#\n")
    return header + "\n".join(out) + "\n"
