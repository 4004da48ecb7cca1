"""The config the functional core reads, as Protocols of its own.

The core never imports gateway.config: the drivers hand it the real Config
(gateway/config/sections.py), whose sections have these fields and more, and
mypy checks that the core reads nothing else.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class InstanceSettings(Protocol):
    """One [[instances]] entry, as the scheduling loop and the pool view read it."""

    @property
    def name(self) -> str: ...
    @property
    def model(self) -> str: ...
    @property
    def gpu(self) -> str: ...
    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def tpot_prior_ms(self) -> float: ...
    @property
    def gpu_count(self) -> int: ...
    @property
    def prefix_caching(self) -> bool: ...
    @property
    def price_input_per_mtok(self) -> float: ...
    @property
    def price_output_per_mtok(self) -> float: ...


class BatchRuleSettings(Protocol):
    @property
    def below(self) -> float: ...
    @property
    def size(self) -> int: ...
    @property
    def window_ms(self) -> float: ...


class BatchingSettings(Protocol):
    @property
    def mode(self) -> str: ...
    @property
    def rules(self) -> Sequence[BatchRuleSettings]: ...


class SchedulerSettings(Protocol):
    @property
    def policy(self) -> str: ...
    @property
    def prefix_cache(self) -> str: ...  # "approximate" | "events" | "off"
    @property
    def prefix_block_tokens(self) -> int: ...
    @property
    def prefix_index_max_blocks(self) -> int: ...


class TelemetrySettings(Protocol):
    @property
    def stale_after_s(self) -> float: ...


class HealthRules(Protocol):
    """When failures cool an instance down, and for how long (the config's [health])."""

    @property
    def failure_threshold(self) -> int: ...
    @property
    def cooldown_s(self) -> float: ...
    @property
    def max_cooldown_s(self) -> float: ...


class CoreConfig(Protocol):
    """What of the whole config the core reads."""

    @property
    def instances(self) -> Sequence[InstanceSettings]: ...
    @property
    def scheduler(self) -> SchedulerSettings: ...
    @property
    def batching(self) -> BatchingSettings: ...
    @property
    def telemetry(self) -> TelemetrySettings: ...
    @property
    def health(self) -> HealthRules: ...

    def options(self, table: str) -> Any:
        """A policy's own table `[policies.<table>]`: the section class it declared, which only it reads."""
        ...
