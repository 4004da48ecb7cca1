"""The emulator's own tables of config.toml: `[emulator]` and each instance's `[instances.faults]`.

The serving config keeps them as tables it does not read (a gateway in front of real servers has no use for
them); the emulator reads them through these sections, and `emulate` and `up` check them on every load and
reload (`checked`), so a typo is an error naming its key, as anywhere else in the file.
"""

from __future__ import annotations

from gateway.config_schema import ConfigError, Section, build_section, option, section


@section
class EmulatorConfig(Section):
    """[emulator]: how the emulated pool steps its engines, and its seed."""

    tick_s: float = option(0.01, gt=0)
    seed: int = 0


@section
class FaultsConfig(Section):
    """[instances.faults]: fault knobs of one emulated instance; a real vLLM instance ignores them."""

    error_rate: float = option(0.0, ge=0, le=1)
    added_latency_ms: float = option(0.0, ge=0)
    down: bool = False


def emulator_of(config) -> EmulatorConfig:
    return build_section(EmulatorConfig, dict(config.emulator), "emulator")


def faults_of(config, index: int) -> FaultsConfig:
    """The fault knobs of the config's instance `index`."""
    return build_section(FaultsConfig, dict(config.instances[index].faults), f"instances[{index}].faults")


def checked(config):
    """`config`, once its emulator tables are valid; ConfigError naming the key otherwise."""
    try:
        emulator_of(config)
        for k in range(len(config.instances)):
            faults_of(config, k)
    except ConfigError as e:
        raise ConfigError(e.reason, e.key) from None
    return config
