"""The emulator's own tables of config.toml: `[emulator]` and each instance's `[instances.faults]`.

The serving config keeps them as tables it does not read (a gateway in front of real servers has no use for
them); the emulator reads them through these sections, and `emulate` and `up` check them on every load and
reload (`checked`), so a typo is an error naming its key, as anywhere else in the file.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import field
from typing import Literal

from gateway.config_schema import ConfigError, Section, build_section, option, section
from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.profiles import spec_for_instance
from gateway.lab.workload.synthetic import LabelConstants
from gateway.lab.workload.worlds import world_labels


@section
class EmulatorConfig(Section):
    """[emulator]: how the emulated pool steps its engines, and its seed."""

    tick_s: float = option(0.01, gt=0)
    seed: int = 0
    # The simulated world (gateway/lab/workload/worlds.py): the synthetic workload's labels that `train`,
    # `sim` and the emulator answer with. "untuned" comes with its own config (gateway/examples/untuned-world.toml).
    world: Literal["calibrated", "untuned"] = "calibrated"
    # Per model: the engine's extra decode-step time per extra sequence, as a share of a lone step (default:
    # the architecture's, gateway/core/engine/profiles.py).
    batch_slopes: Mapping[str, float] = field(default_factory=dict)
    # How instances with `kv_events` encode each event (gateway/lab/emulator/kv_events.py): "map", a map tagged by
    # its "type" as vLLM sends since vllm-project/vllm#42892 (v0.26 does); "array", the tagged array of the
    # vLLM releases before it.
    kv_events_encoding: Literal["map", "array"] = "map"

    def _validate(self) -> None:
        for model, slope in self.batch_slopes.items():
            if not 0 <= slope <= 1:
                raise ConfigError(f"must be in [0, 1], got {slope!r}", f"batch_slopes.{model}")


@section
class FaultsConfig(Section):
    """[instances.faults]: fault knobs of one emulated instance; a real vLLM instance ignores them."""

    error_rate: float = option(0.0, ge=0, le=1)
    added_latency_ms: float = option(0.0, ge=0)
    down: bool = False


def emulator_of(config) -> EmulatorConfig:
    return build_section(EmulatorConfig, _plain(config.emulator), "emulator")


def _plain(table: Mapping) -> dict:
    """A table the serving config froze (read-only mappings, tuples), as TOML gave it: the schema reads dicts."""
    return {k: _plain(v) if isinstance(v, Mapping) else v for k, v in table.items()}


def faults_of(config, index: int) -> FaultsConfig:
    """The fault knobs of the config's instance `index`."""
    return build_section(FaultsConfig, dict(config.instances[index].faults), f"instances[{index}].faults")


def engine_for(config, inst) -> EngineSpec:
    """The engine model of an emulated or simulated instance: its profile, with the world's batch slope."""
    spec = spec_for_instance(inst)
    slope = emulator_of(config).batch_slopes.get(inst.model)
    return spec if slope is None else dataclasses.replace(spec, batch_slope=slope)


def label_constants(config) -> LabelConstants:
    """What the config's world sets of the synthetic workload's labels."""
    return world_labels(emulator_of(config).world)


def checked(config):
    """`config`, once its emulator tables are valid; ConfigError naming the key otherwise."""
    try:
        emulator_of(config)
        for k in range(len(config.instances)):
            faults_of(config, k)
    except ConfigError as e:
        raise ConfigError(e.reason, e.key) from None
    return config
