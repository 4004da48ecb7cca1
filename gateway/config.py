"""Gateway configuration: TOML schema, validation and reload.

Each section is declared once, as a frozen dataclass. A small validator walks
the dataclass type hints to turn the parsed TOML into those dataclasses, so a
typo, a wrong type or a missing key is reported with its full key path
(``instances[3].pricee_input: unknown key``) instead of surfacing later as an
AttributeError deep in the server.

Value rules live next to the field (``_field(ge=0)``); rules that involve more
than one field live in the section's ``_validate``. Both also run when a
section is built directly in code (tests, the simulator, per-request weight
overrides), so an invalid object cannot exist.

``ConfigStore`` owns the current ``Config`` and swaps it only when a reload
parses and validates cleanly; it has no thread or event loop of its own (the
server polls ``changed_on_disk`` and calls ``reload``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
import re
import tomllib
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

__all__ = [
    "DEFAULT_PRESETS",
    "POLICY_NAMES",
    "BatchRule",
    "Batching",
    "Config",
    "ConfigError",
    "ConfigStore",
    "Emulator",
    "Faults",
    "Instance",
    "Pipeline",
    "Scheduler",
    "Server",
    "Telemetry",
    "Upstream",
    "Weights",
    "default_config_path",
    "load_config",
    "parse_config",
]

log = logging.getLogger(__name__)

# Policies: "routebalance", or a pipeline baseline "<router>+<dispatcher>"
# (a model router, then a dispatcher among that model's instances).
ROUTERS = ("passthrough", "avengers", "best_route")
DISPATCHERS = ("round_robin", "shortest_queue", "random")
POLICY_NAMES = ("routebalance", *(f"{r}+{d}" for r in ROUTERS for d in DISPATCHERS))
BatchMode = Literal["eager", "window"]
QualityTerm = Literal["raw", "minmax"]
LatencyTerm = Literal["heads", "prior", "off"]
TieBreak = Literal["shortest_queue", "predicted"]


class ConfigError(ValueError):
    """An invalid configuration.

    ``key`` is the full path of the offending key (``server.port``,
    ``instances[4].name``) or None when the problem is the file as a whole;
    ``reason`` is the message without the key; ``str(err)`` has both, prefixed
    by ``source`` (usually the file path) when known.
    """

    def __init__(self, reason: str, key: str | None = None, source: str | None = None):
        self.reason, self.key, self.source = reason, key, source
        super().__init__(": ".join([p for p in (source, key) if p] + [reason]))


# --------------------------------------------------------------------------
# Field rules


def _field(default: Any = MISSING, *, factory: Any = MISSING, ge=None, gt=None, le=None,
           nonempty: bool = False) -> Any:
    """A dataclass field carrying simple value rules, checked in __post_init__."""
    rules = {k: v for k, v in (("ge", ge), ("gt", gt), ("le", le)) if v is not None}
    if nonempty:
        rules["nonempty"] = True
    return field(default=default, default_factory=factory, metadata=rules)


def _rule_violation(value: Any, rules: Mapping[str, Any]) -> str | None:
    if value is None:  # optional field left unset
        return None
    if rules.get("nonempty") and not value:
        return "must not be empty"
    if "ge" in rules and not value >= rules["ge"]:
        return f"must be >= {rules['ge']}, got {value!r}"
    if "gt" in rules and not value > rules["gt"]:
        return f"must be > {rules['gt']}, got {value!r}"
    if "le" in rules and not value <= rules["le"]:
        return f"must be <= {rules['le']}, got {value!r}"
    return None


class _Section:
    """Mixin: checks the field rules, then the section's cross-field rules."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            if f.metadata:
                problem = _rule_violation(getattr(self, f.name), f.metadata)
                if problem:
                    raise ConfigError(problem, f.name)
        self._validate()

    def _validate(self) -> None:
        pass


def _set(obj: Any, name: str, value: Any) -> None:
    # Normalising a frozen dataclass in __post_init__ is the documented way.
    object.__setattr__(obj, name, value)


_section = dataclass(frozen=True, kw_only=True)


# --------------------------------------------------------------------------
# Sections


@_section
class Server(_Section):
    host: str = _field("127.0.0.1", nonempty=True)
    port: int = _field(8000, ge=1, le=65535)
    max_body_bytes: int = _field(1_048_576, ge=1)
    # Model names that mean "let the scheduler choose among all instances".
    aliases: tuple[str, ...] = ("auto",)
    # When set, admin endpoints require "Authorization: Bearer <token>".
    admin_token: str | None = _field(None, nonempty=True)
    # 0 turns the file watcher off (reload only on request).
    config_watch_interval_s: float = _field(1.0, ge=0)

    def _validate(self) -> None:
        for i, alias in enumerate(self.aliases):
            if not alias:
                raise ConfigError("must not be empty", f"aliases[{i}]")


@_section
class Upstream(_Section):
    connect_timeout_s: float = _field(2.0, gt=0)
    read_timeout_s: float = _field(60.0, gt=0)  # longest gap between two bytes
    total_timeout_s: float = _field(600.0, gt=0)
    max_connections: int = _field(1024, ge=1)
    retries: int = _field(1, ge=0)  # before the first byte, on another instance


@_section
class Weights(_Section):
    """Eq. 1 weights. Normalised to sum to 1, so (1, 1, 1) means uniform."""

    quality: float = _field(0.0, ge=0)
    latency: float = _field(0.0, ge=0)
    cost: float = _field(0.0, ge=0)

    def _validate(self) -> None:
        total = self.quality + self.latency + self.cost
        if total <= 0:
            raise ConfigError("quality, latency and cost must not all be zero")
        if abs(total - 1.0) > 1e-9:  # leave weights that already sum to 1 exactly as written
            for name in ("quality", "latency", "cost"):
                _set(self, name, getattr(self, name) / total)


DEFAULT_PRESETS: Mapping[str, Weights] = types.MappingProxyType({
    "quality": Weights(quality=0.8, latency=0.1, cost=0.1),
    "uniform": Weights(quality=1.0, latency=1.0, cost=1.0),
    "cost": Weights(quality=0.1, latency=0.1, cost=0.8),
    "latency": Weights(quality=0.1, latency=0.8, cost=0.1),
})


@_section
class Pipeline(_Section):
    """Knobs of the pipeline-mode baselines (used when a policy is "<router>+<dispatcher>")."""

    avengers_performance_weight: float = _field(0.7, ge=0, le=1)
    avengers_clusters: int = _field(64, ge=1)
    best_route_threshold: float = _field(0.02, ge=0)
    seed: int = 0  # the random dispatcher's and k-means' seed


@_section
class Scheduler(_Section):
    policy: str = "routebalance"
    preset: str = _field("uniform", nonempty=True)
    # Merged over DEFAULT_PRESETS: a config adds or overrides presets but the
    # four documented ones (the API's contract) are always there.
    presets: Mapping[str, Weights] = _field(factory=lambda: DEFAULT_PRESETS)
    # Eq. 1 variants (the paper's isolation arms): quality as the raw KNN score
    # or min-max normalised over the candidates; latency from the TPOT heads,
    # the static per-tier prior (TPOT x length, no telemetry) or off
    # (w_lat = 0); ties broken by the shorter queue or the lower predicted latency.
    quality_term: QualityTerm = "raw"
    latency_term: LatencyTerm = "heads"
    tiebreak: TieBreak = "shortest_queue"
    lpt: bool = True  # longest predicted answer first within a batch
    budget_filter: bool = True  # Eq. 2 before scoring (the clamp and early stop always apply)
    pipeline: Pipeline = Pipeline()

    def _validate(self) -> None:
        if self.policy not in POLICY_NAMES:
            raise ConfigError(f"unknown policy {self.policy!r} (known: {', '.join(POLICY_NAMES)})", "policy")
        _set(self, "presets", types.MappingProxyType({**DEFAULT_PRESETS, **self.presets}))
        if self.preset not in self.presets:
            known = ", ".join(self.presets)
            raise ConfigError(f"unknown preset {self.preset!r} (known: {known})", "preset")


@_section
class BatchRule(_Section):
    """When the share of instances with waiting requests is below ``below``,
    close a batch at ``size`` requests or ``window_ms`` after its first one."""

    below: float = _field(gt=0)
    size: int = _field(ge=1)
    window_ms: float = _field(ge=0)


@_section
class Batching(_Section):
    # eager: fire as soon as the scheduler is free; window: the paper's rule.
    mode: BatchMode = "eager"
    max_queue: int = _field(4096, ge=1)
    rules: tuple[BatchRule, ...] = (
        BatchRule(below=0.3, size=4, window_ms=50.0),
        BatchRule(below=0.7, size=16, window_ms=100.0),
        BatchRule(below=1.01, size=32, window_ms=200.0),
    )

    def _validate(self) -> None:
        if not self.rules:
            raise ConfigError("at least one rule is required", "rules")
        for i in range(1, len(self.rules)):
            if self.rules[i].below <= self.rules[i - 1].below:
                raise ConfigError("rules must be sorted by strictly increasing 'below'",
                                  f"rules[{i}].below")
        # The ratio is a share in [0, 1]; the last rule must catch ratio == 1.
        if self.rules[-1].below <= 1.0:
            raise ConfigError("the last rule must have below > 1.0 so every load ratio "
                              "is covered", f"rules[{len(self.rules) - 1}].below")


@_section
class Telemetry(_Section):
    scrape_interval_s: float = _field(0.5, gt=0)
    scrape_timeout_s: float = _field(1.0, gt=0)
    stale_after_s: float = _field(3.0, gt=0)

    def _validate(self) -> None:
        if self.stale_after_s <= self.scrape_interval_s:
            raise ConfigError("must be > scrape_interval_s, or every reading is stale",
                              "stale_after_s")


@_section
class Estimators(_Section):
    # Where `routebalance train` writes the index, labels and heads; relative
    # paths are taken from the working directory.
    models_dir: str = _field("models", nonempty=True)
    # Prompt truncation for the embedder, in tokens ([CLS] and [SEP] included):
    # 256 is the reference; 128 and 64 trade neighbour agreement for speed.
    max_tokens: int = _field(256, ge=16, le=512)
    threads: int = _field(2, ge=1)  # onnxruntime intra-op threads
    batch_size: int = _field(8, ge=1)  # length-sorted sub-batches inside one embed call
    # Size of the synthetic labelled workload `train` builds when no data is given.
    train_records: int = _field(2000, ge=50)
    seed: int = 0


@_section
class Emulator(_Section):
    tick_s: float = _field(0.01, gt=0)
    seed: int = 0


@_section
class Faults(_Section):
    """Emulator-only fault knobs; a real vLLM instance ignores them."""

    error_rate: float = _field(0.0, ge=0, le=1)
    added_latency_ms: float = _field(0.0, ge=0)
    down: bool = False


_GPU_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*GB?$", re.IGNORECASE)


@_section
class Instance(_Section):
    name: str = _field(nonempty=True)
    url: str = _field(nonempty=True)  # server root, e.g. http://10.0.0.5:8000 (no /v1)
    model: str = _field(nonempty=True)  # the name vLLM serves it under
    gpu: str = _field(nonempty=True)
    gpu_count: int = _field(1, ge=1)
    tensor_parallel: int = _field(1, ge=1)
    # Per GPU. None: read from the GPU name ("A100-80GB" -> 80); always set after load.
    gpu_memory_gb: float | None = _field(None, gt=0)
    gpu_memory_utilization: float = _field(0.9, gt=0, le=1)
    max_num_seqs: int = _field(256, ge=1)
    max_model_len: int = _field(8192, ge=1)
    price_input_per_mtok: float = _field(ge=0)  # USD per 1M tokens
    price_output_per_mtok: float = _field(ge=0)
    tpot_prior_ms: float = _field(gt=0)
    faults: Faults = Faults()

    def _validate(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"must be an http:// or https:// URL, got {self.url!r}", "url")
        if parts.path.rstrip("/").endswith("/v1"):
            raise ConfigError("give the server root, without /v1 (the gateway adds the "
                              "/v1/... and /metrics paths)", "url")
        _set(self, "url", self.url.rstrip("/"))  # so callers can append "/v1/..."
        if self.tensor_parallel > self.gpu_count:
            raise ConfigError(f"must be <= gpu_count ({self.gpu_count}), got "
                              f"{self.tensor_parallel}", "tensor_parallel")
        if self.gpu_memory_gb is None:
            m = _GPU_MEMORY.search(self.gpu)
            if not m:
                raise ConfigError(f"missing required key (cannot read it from gpu "
                                  f"{self.gpu!r})", "gpu_memory_gb")
            _set(self, "gpu_memory_gb", float(m.group(1)))


@_section
class Config(_Section):
    server: Server = Server()
    upstream: Upstream = Upstream()
    scheduler: Scheduler = _field(factory=Scheduler)
    batching: Batching = Batching()
    telemetry: Telemetry = Telemetry()
    estimators: Estimators = Estimators()
    emulator: Emulator = Emulator()
    instances: tuple[Instance, ...] = _field()
    _by_name: Mapping[str, Instance] = field(init=False, repr=False, compare=False)

    def _validate(self) -> None:
        if not self.instances:
            raise ConfigError("at least one instance is required", "instances")
        names: dict[str, int] = {}
        urls: dict[str, int] = {}
        for i, inst in enumerate(self.instances):
            if inst.name in names:
                raise ConfigError(f"duplicate instance name {inst.name!r} (also "
                                  f"instances[{names[inst.name]}])", f"instances[{i}].name")
            if inst.url in urls:
                raise ConfigError(f"duplicate url {inst.url!r} (also instances[{urls[inst.url]}])",
                                  f"instances[{i}].url")
            names[inst.name] = urls[inst.url] = i
        _set(self, "_by_name", types.MappingProxyType({i.name: i for i in self.instances}))
        models = set(self.models())
        for i, alias in enumerate(self.server.aliases):
            if alias in models:
                raise ConfigError(f"alias {alias!r} is also a pool model name",
                                  f"server.aliases[{i}]")

    def models(self) -> tuple[str, ...]:
        """Distinct served model names, in order of first appearance."""
        return tuple(dict.fromkeys(inst.model for inst in self.instances))

    def instance(self, name: str) -> Instance:
        """The instance called ``name``; KeyError if there is none."""
        return self._by_name[name]

    def weights(self, preset: str) -> Weights:
        """The weights of a named preset; KeyError if there is none."""
        return self.scheduler.presets[preset]


# --------------------------------------------------------------------------
# The validator: TOML data -> dataclasses, guided by the type hints


def _type_name(value: Any) -> str:
    if isinstance(value, dict):
        return "table"
    if isinstance(value, list):
        return "array"
    return type(value).__name__


def _join(path: str, key: str) -> str:
    if not key:
        return path
    if not path:
        return key
    return path + key if key.startswith("[") else f"{path}.{key}"


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _convert(tp: Any, value: Any, path: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, path)
    if origin in (typing.Union, types.UnionType):  # X | None; TOML has no null
        (inner,) = [a for a in args if a is not type(None)]
        return _convert(inner, value, path)
    if origin is Literal:
        if any(type(value) is type(a) and value == a for a in args):
            return value
        choices = ", ".join(repr(a) for a in args)
        raise ConfigError(f"expected one of {choices}, got {value!r}", path)
    if origin is tuple:
        assert len(args) == 2 and args[1] is Ellipsis, f"unsupported annotation {tp}"
        if not isinstance(value, list):
            raise ConfigError(f"expected array, got {_type_name(value)}", path)
        return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
    if origin in (dict, Mapping):
        if not isinstance(value, dict):
            raise ConfigError(f"expected table, got {_type_name(value)}", path)
        return types.MappingProxyType(
            {k: _convert(args[1], v, _join(path, k)) for k, v in value.items()})
    if tp is float:
        # ints are fine where a float is wanted (port = 8000.0 is not, hence no reverse)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(f"expected a finite number, got {value!r}", path)
            return float(value)
    elif tp in (int, str, bool):
        # bool is a subclass of int; `port = true` must not pass as 1
        if isinstance(value, tp) and not (tp is int and isinstance(value, bool)):
            return value
    else:
        raise TypeError(f"unsupported annotation {tp!r} at {path}")
    raise ConfigError(f"expected {tp.__name__}, got {_type_name(value)}", path)


def _build(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"expected table, got {_type_name(data)}", path)
    hints = _hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    for key in data:
        if key not in known:
            raise ConfigError("unknown key", _join(path, key))
    kwargs = {}
    for name, f in known.items():
        if name in data:
            kwargs[name] = _convert(hints[name], data[name], _join(path, name))
        elif f.default is MISSING and f.default_factory is MISSING:
            raise ConfigError("missing required key", _join(path, name))
    try:
        return cls(**kwargs)
    except ConfigError as err:  # keys raised by _validate are relative to this table
        raise ConfigError(err.reason, _join(path, err.key or ""), err.source) from None


# --------------------------------------------------------------------------
# Loading


def parse_config(data: dict[str, Any], source: str = "<config>") -> Config:
    """Validate already-parsed TOML data; ConfigError names ``source`` and the key."""
    try:
        return _build(Config, data, "")
    except ConfigError as err:
        raise ConfigError(err.reason, err.key, source) from None


def _read(path: Path) -> tuple[Config, tuple[int, int, int] | None]:
    """Parse ``path``; also return the stamp of the version that was read.

    The stamp comes from fstat of the open file before reading, so a write
    that races the read shows up as a change later instead of being missed.
    """
    try:
        with open(path, "rb") as fh:
            st = os.fstat(fh.fileno())
            raw = fh.read()
    except OSError as err:
        raise ConfigError(f"cannot read: {err.strerror or err}", source=str(path)) from None
    stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"invalid TOML: {err}", source=str(path)) from None
    return parse_config(data, str(path)), stamp


def load_config(path: str | os.PathLike[str]) -> Config:
    """Read and validate a TOML config file; raises ConfigError."""
    return _read(Path(path))[0]


def default_config_path() -> Path:
    """The packaged default config (the 13-instance pool of the paper)."""
    return Path(__file__).with_name("default_config.toml")


def _stamp(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class ConfigStore:
    """The current Config of a file, replaced only by a reload that validates.

    Construction loads the file and raises ConfigError if it is invalid (the
    server should not start on a bad config). Later failures keep the old
    config, log a warning and are counted.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._config, self._seen = _read(self.path)
        self._subscribers: list[Callable[[Config], None]] = []
        self.reloads_ok = 0
        self.reloads_failed = 0
        self.last_error: str | None = None  # message of the last reload if it failed

    @property
    def current(self) -> Config:
        return self._config

    def subscribe(self, callback: Callable[[Config], None]) -> Callable[[], None]:
        """Call ``callback(new_config)`` after each swap; returns an unsubscribe function."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    def changed_on_disk(self) -> bool:
        """Has the file changed since the version last read (loaded or rejected)?

        A rejected version counts as read, so a polling watcher retries only
        when the file changes again instead of failing every interval.
        """
        return _stamp(self.path) != self._seen

    def reload(self) -> tuple[bool, str]:
        """Re-read the file. Returns (ok, message); on failure the old config stays."""
        try:
            new, self._seen = _read(self.path)
        except ConfigError as err:
            self._seen = _stamp(self.path)
            self.reloads_failed += 1
            self.last_error = str(err)
            log.warning("config reload failed, keeping the previous config: %s", err)
            return False, str(err)
        self.reloads_ok += 1
        self.last_error = None  # it describes the current state, not history
        if new == self._config:  # touched, not changed: keep the object, wake nobody
            return True, f"{self.path}: unchanged"
        self._config = new
        log.info("config reloaded from %s", self.path)
        for callback in list(self._subscribers):
            try:
                callback(new)
            except Exception:  # one broken subscriber must not stop the others
                log.exception("config subscriber %r failed", callback)
        return True, f"{self.path}: reloaded ({len(new.instances)} instances)"
