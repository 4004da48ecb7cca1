"""The sections of config.toml and the whole Config they make.

Each section is a frozen dataclass built and checked by gateway/config_schema.py,
so a typo, a wrong type or a missing key is reported with its full key path
(``instances[3].pricee_input: unknown key``). Each policy declares its own
table (``[policies.<name>]``) in its module; the registry tells this module
which tables exist and how to check them.

Reading a file and reloading it are in gateway/config/store.py.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import types
from collections.abc import Mapping
from dataclasses import field
from typing import Any, Literal
from urllib.parse import urlsplit

from gateway.config_schema import ConfigError, Section, build_section, option, section, set_normalised
from gateway.core.progressive import ConfidenceWeights, FallbackRule, ProgressiveLimits
from gateway.policies import registry

__all__ = [
    "DEFAULT_PRESETS",
    "BatchRule",
    "BatchingConfig",
    "Config",
    "ApiKey",
    "AuthConfig",
    "HealthConfig",
    "Instance",
    "JudgeConfig",
    "LearningConfig",
    "MoeConfig",
    "SchedulerConfig",
    "SloConfig",
    "ServerConfig",
    "StateConfig",
    "TelemetryConfig",
    "TracingConfig",
    "UpstreamConfig",
    "Weights",
    "parse_config",
]

log = logging.getLogger(__name__)

BatchMode = Literal["eager", "window"]
# Keys that moved to a policy's own table: a config that still has them is told where.
MOVED = {
    "scheduler.pipeline": "[policies.pipeline]",
    **{f"scheduler.{k}": "[policies.routebalance]"
       for k in ("quality_term", "latency_term", "tiebreak", "lpt", "budget_filter")},
    # Each learned pipeline router has its own table now; [policies.pipeline] keeps the dispatchers' seed.
    "policies.pipeline.best_route_threshold": "[policies.best_route] as `threshold`: now the highest predicted "
                                              "probability (0 to 1) of a cheaper model falling short, "
                                              "not a quality gap",
    "policies.pipeline.avengers_performance_weight": "[policies.avengers] as `performance_weight`",
    "policies.pipeline.avengers_clusters": "[policies.avengers] as `clusters`",
}


# --------------------------------------------------------------------------
# Sections


@section
class ServerConfig(Section):
    host: str = option("127.0.0.1", nonempty=True)
    port: int = option(8000, ge=1, le=65535)
    # /metrics on its own listener (e.g. for a private network); None: on the API port.
    metrics_port: int | None = option(None, ge=1, le=65535)
    max_body_bytes: int = option(1_048_576, ge=1)
    # Longest request line or header line, and the most header lines, a client may send.
    max_header_bytes: int = option(8190, ge=256)
    max_headers: int = option(100, ge=8)
    # A connection that is idle, or has not sent a whole request head, closes after
    # keepalive_timeout_s; a request's body must arrive within body_timeout_s. Slow
    # clients cannot hold connections longer.
    keepalive_timeout_s: float = option(15.0, gt=0)
    body_timeout_s: float = option(30.0, gt=0)
    # A streaming client that takes no data for this long is dropped (and its upstream request aborted).
    write_timeout_s: float = option(30.0, gt=0)
    # Client connections open at once; past it new connections are closed at once.
    max_connections: int = option(2048, ge=1)
    # Requests whose body is larger than this (bytes) are token-counted in a worker
    # thread, and answer texts longer than this (characters) too, so tokenizing a
    # huge prompt or answer cannot stall the event loop.
    tokenize_inline_chars: int = option(16384, ge=0)
    # Model names that mean "let the scheduler choose among all instances".
    aliases: tuple[str, ...] = ("auto",)
    # Admin endpoints (/admin/*) require "Authorization: Bearer <token>"; without a token they are off.
    admin_token: str | None = option(None, nonempty=True)
    # 0 turns the file watcher off (reload only on request).
    config_watch_interval_s: float = option(1.0, ge=0)
    # At shutdown (SIGTERM, Ctrl-C) requests in flight, streams included, get this long to finish; then they
    # are cut off, and closing the rest (the spend still to write, the Redis link) takes a few seconds more.
    shutdown_timeout_s: float = option(10.0, gt=0)

    def _validate(self) -> None:
        for i, alias in enumerate(self.aliases):
            if not alias:
                raise ConfigError("must not be empty", f"aliases[{i}]")
        if self.metrics_port == self.port:
            raise ConfigError("must differ from port (leave it out to serve /metrics on the API port)",
                              "metrics_port")


@section
class UpstreamConfig(Section):
    connect_timeout_s: float = option(2.0, gt=0)
    read_timeout_s: float = option(60.0, gt=0)  # longest gap between two bytes of a stream
    response_timeout_s: float = option(300.0, gt=0)  # longest wait for a non-streamed answer
    total_timeout_s: float = option(600.0, gt=0)
    max_connections: int = option(1024, ge=1)
    # Per instance, so one stalled instance cannot take every connection; a request
    # that waits longer than acquire_timeout_s for one fails over to the next instance.
    max_connections_per_instance: int = option(256, ge=1)
    acquire_timeout_s: float = option(5.0, gt=0)
    # A non-streamed answer larger than this is refused (502), not buffered.
    max_response_bytes: int = option(16 << 20, ge=1024)
    retries: int = option(2, ge=0)  # failed attempts retried before the first byte, each on another instance


@section
class HealthConfig(Section):
    """Passive health: an instance that fails `failure_threshold` attempts in a row cools
    down for cooldown_s, doubled after each failed probe up to max_cooldown_s."""

    failure_threshold: int = option(2, ge=1)
    cooldown_s: float = option(1.0, gt=0)
    max_cooldown_s: float = option(60.0, gt=0)

    def _validate(self) -> None:
        if self.max_cooldown_s < self.cooldown_s:
            raise ConfigError("must be >= cooldown_s", "max_cooldown_s")


_SHA256 = re.compile(r"[0-9a-f]{64}")
Period = Literal["day", "month", "total"]


@section
class ApiKey(Section):
    """One client key. Only its SHA-256 is stored; `routebalance keys add` makes one."""

    name: str = option(nonempty=True)
    sha256: str = option(nonempty=True)
    spend_limit_usd: float | None = option(None, ge=0)
    period: Period = "total"  # the spend limit resets each UTC day or month, or never
    requests_per_minute: int | None = option(None, ge=1)
    models: tuple[str, ...] = ()  # models or aliases it may name; empty: all
    presets: tuple[str, ...] = ()  # presets it may ask for; empty: all
    slo_s: float | None = option(None, gt=0)  # end-to-end SLO of its requests that name none
    tpot_slo_ms: float | None = option(None, gt=0)  # time-per-output-token bound of its requests that name none
    # false: its traffic stays out of learning ([learning]): no answer lengths stored, feedback refused (403).
    learn: bool = True
    # true: its prompts are cached apart from every other key's (vLLM's `cache_salt`, sent per request), so no
    # other tenant can time its cached prompts, and the gateway's prefix index keeps them apart too.
    cache_salt: bool = False

    def _validate(self) -> None:
        if not _SHA256.fullmatch(self.sha256):
            raise ConfigError("must be the key's SHA-256 as 64 lowercase hex digits", "sha256")


@section
class AuthConfig(Section):
    # Without keys, requests without one are served only while the server listens on
    # loopback; this lets them in on any address (and next to keys).
    allow_anonymous: bool = False
    keys: tuple[ApiKey, ...] = ()

    def _validate(self) -> None:
        names: dict[str, int] = {}
        hashes: dict[str, int] = {}
        for i, key in enumerate(self.keys):
            if key.name in names:
                raise ConfigError(f"duplicate key name {key.name!r} (also keys[{names[key.name]}])",
                                  f"keys[{i}].name")
            if key.sha256 in hashes:
                raise ConfigError(f"the same key as keys[{hashes[key.sha256]}]", f"keys[{i}].sha256")
            names[key.name] = hashes[key.sha256] = i


@section
class StateConfig(Section):
    """Where spend is kept: "sqlite" (persisted, survives restarts; one process, or the workers of one host's
    `serve --workers`, reservations included), "memory" (tests), or
    "redis" (shared by several replicas: spend and reservations, instance cooldowns and each replica's
    in-flight work). Read at start: a change takes a restart."""

    backend: Literal["sqlite", "memory", "redis"] = "sqlite"
    path: str = option("data/state.db", nonempty=True)  # sqlite: relative to the working directory
    url: str = option("redis://127.0.0.1:6379/0", nonempty=True)  # redis
    # Redis unreachable: keys with a spend limit are refused (503), or checked against this replica's
    # last view of their spend plus what it reserved since ("local": fails open by what the others spend).
    on_unavailable: Literal["refuse", "local"] = "refuse"
    sync_interval_s: float = option(0.25, gt=0)  # how often a replica publishes its share and reads the others'
    timeout_s: float = option(0.5, gt=0)  # each Redis call, connecting included
    prefix: str = option("routebalance:", nonempty=True)  # of every Redis key, so gateways can share a server


DEFAULT_SOURCE_WEIGHTS: Mapping[str, float] = types.MappingProxyType({"file": 1.0, "judge": 0.7, "feedback": 0.5})


@section
class LearningConfig(Section):
    """Labels from the gateway's own traffic (docs/operations/learning.md): each answer's length, and the
    scores clients give their own completions (POST /v1/feedback), kept in a label store that
    `routebalance labels export` turns into a workload file for `train`; refreshes, exploration and judged
    shadow answers. `enabled`, `path`, `length_queue` and whether shadow answers are on at all (shadow_share
    above 0, with a [judge]) are read at start (a change takes a restart); the rest applies from a reload on."""

    enabled: bool = True
    path: str = option("data/labels.db", nonempty=True)  # SQLite, relative to the working directory
    # false: only each prompt's SHA-256 is kept, in memory and on disk (its labels cannot then be exported).
    keep_prompt_text: bool = True
    # Labels from traffic older than this are deleted (at start and hourly); a user's file labels are kept.
    retention_days: float = option(90.0, gt=0)
    # Rows the store holds at most; past it new labels are refused (lengths dropped and counted, feedback 503)
    # rather than older ones pushed out.
    max_labels: int = option(1_000_000, ge=1)
    # Completion ids a client may still rate, held in memory: at most this many, for this long, with at most
    # this much prompt text (characters) between them; the oldest are forgotten first.
    max_completions: int = option(100_000, ge=1)
    completion_ttl_s: float = option(86400.0, gt=0)
    max_completion_text_chars: int = option(64_000_000, ge=0)
    # Answer lengths waiting for the store's writer; past it new ones are dropped (counted), never held.
    length_queue: int = option(10_000, ge=1)
    feedback_rate_per_min: int = option(60, ge=1)  # feedback calls per API key (or anonymous client address)
    feedback_max_bytes: int = option(4096, ge=64)  # a feedback body larger than this is refused (413)
    # How much each quality source counts when an export combines them into one score (a weighted mean of
    # the sources present, each on its own scale; 0 leaves a source out). Merged over the defaults.
    source_weights: Mapping[str, float] = option(factory=lambda: DEFAULT_SOURCE_WEIGHTS)
    # A refresh folds the stored labels into the estimators without a restart (POST /admin/refresh, or every
    # refresh_interval_s; 0: on request only): corrections of the built estimates, heads for new models.
    refresh_interval_s: float = option(0.0, ge=0)
    min_labels: int = option(20, ge=1)  # quality labels a new model needs before it gets its own quality head
    # A refit whose out-of-fold routing (above the single models' hull) is worse than the estimators `train`
    # chose by more than this is refused; refresh_check_rows built prompts are checked at most.
    refresh_tolerance: float = option(0.01, ge=0)
    refresh_check_rows: int = option(2000, ge=100)
    max_versions: int = option(5, ge=2)  # refits kept on disk for rollback (oldest deleted first)
    # A refresh embeds the prompts of at most this many labelled prompts, the most recent (about 12 ms each).
    refresh_max_prompts: int = option(20_000, ge=100)
    # A pool model without labels is routed on a pessimistic prior and offered, to be explored, on at most this
    # share of requests, within this much predicted spend per UTC day (serving/explore.py).
    explore_share: float = option(0.05, ge=0, le=1)
    explore_usd_per_day: float = option(1.0, ge=0)
    # Judged shadow answers (serving/shadow.py; needs a [judge]): this share of answered requests is also sent to
    # one other model with an idle instance, and the judge scores both answers. 0: off.
    shadow_share: float = option(0.0, ge=0, le=1)
    shadow_max_in_flight: int = option(2, ge=1)  # shadow calls at once; past it a request is not shadowed
    shadow_max_tokens: int = option(512, ge=1)  # per shadow answer
    shadow_usd_per_day: float = option(1.0, ge=0)  # the gateway's own spend on shadow answers, per UTC day

    def _validate(self) -> None:
        for source, weight in self.source_weights.items():
            if source not in DEFAULT_SOURCE_WEIGHTS:
                raise ConfigError(f"unknown source {source!r} (known: {', '.join(DEFAULT_SOURCE_WEIGHTS)})",
                                  f"source_weights.{source}")
            if not 0 <= weight < float("inf"):
                raise ConfigError(f"must be a finite number >= 0, got {weight!r}", f"source_weights.{source}")
        set_normalised(self, "source_weights", types.MappingProxyType({**DEFAULT_SOURCE_WEIGHTS,
                                                                       **self.source_weights}))


# The judge's prompt: {prompt} and {answer} are replaced by the prompt and the answer (other braces stay as
# written); the reply is read for one number in [0, 1] (gateway/learning/judge.py).
DEFAULT_RUBRIC = (
    "You grade answers. Read the question and the answer below, and judge how correct and complete the answer "
    "is.\n\nQuestion:\n{prompt}\n\nAnswer:\n{answer}\n\n"
    'Reply with one line, "Score: X", where X is a number from 0 (wrong or useless) to 1 (fully correct), and '
    "nothing else."
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@section
class JudgeConfig(Section):
    """An LLM that scores answers in [0, 1] (`routebalance judge`; docs/operations/collect.md): any
    OpenAI-compatible endpoint and model, a pool instance included."""

    url: str | None = option(None, nonempty=True)  # base URL ending in /v1; unset: no judge
    model: str | None = option(None, nonempty=True)  # the model name the endpoint serves; required with url
    # The name of an environment variable holding the endpoint's API key (never the key itself).
    api_key_env: str | None = option(None, nonempty=True)
    rubric: str = option(DEFAULT_RUBRIC, nonempty=True)
    timeout_s: float = option(60.0, gt=0)  # each call to the judge, whole
    max_concurrency: int = option(4, ge=1, le=256)  # calls in flight at once
    max_answer_chars: int = option(8000, ge=100)  # longer answers are cut to this before they are judged
    # A judge whose URL is not a pool instance's receives prompts and answers only when this is true.
    outside_pool_may_see_prompts: bool = False

    def _validate(self) -> None:
        if self.url is not None:
            parts = urlsplit(self.url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ConfigError(f"must be an http:// or https:// URL, got {self.url!r}", "url")
            if not parts.path.rstrip("/").endswith("/v1"):
                raise ConfigError(f"must be the endpoint's OpenAI base URL, ending in /v1, got {self.url!r}", "url")
            set_normalised(self, "url", self.url.rstrip("/"))
            if self.model is None:
                raise ConfigError("is required when url is set (the model the judge endpoint serves)", "model")
        if self.api_key_env is not None and not _ENV_NAME.fullmatch(self.api_key_env):
            raise ConfigError("must name an environment variable that holds the key (letters, digits and _), "
                              "never the key itself", "api_key_env")
        for placeholder in ("{prompt}", "{answer}"):
            if placeholder not in self.rubric:
                raise ConfigError(f"must contain the placeholder {placeholder}", "rubric")


@section
class Weights(Section):
    """Eq. 1 weights. Normalised to sum to 1, so (1, 1, 1) means uniform."""

    quality: float = option(0.0, ge=0)
    latency: float = option(0.0, ge=0)
    cost: float = option(0.0, ge=0)

    def _validate(self) -> None:
        total = self.quality + self.latency + self.cost
        if total <= 0:
            raise ConfigError("quality, latency and cost must not all be zero")
        if abs(total - 1.0) > 1e-9:  # leave weights that already sum to 1 exactly as written
            for name in ("quality", "latency", "cost"):
                set_normalised(self, name, getattr(self, name) / total)


DEFAULT_PRESETS: Mapping[str, Weights] = types.MappingProxyType({
    "quality": Weights(quality=0.8, latency=0.1, cost=0.1),
    "uniform": Weights(quality=1.0, latency=1.0, cost=1.0),
    "cost": Weights(quality=0.1, latency=0.1, cost=0.8),
    "latency": Weights(quality=0.1, latency=0.8, cost=0.1),
})


@section
class SchedulerConfig(Section):
    policy: str = "routebalance"  # a registered policy (gateway/policies/registry.py)
    preset: str = option("uniform", nonempty=True)
    # Merged over DEFAULT_PRESETS: a config adds or overrides presets but the
    # four documented ones (the API's contract) are always there.
    presets: Mapping[str, Weights] = option(factory=lambda: DEFAULT_PRESETS)
    # Preset -> the policy its requests use when they name none (a preset not listed: `policy`).
    preset_policies: Mapping[str, str] = option(factory=lambda: types.MappingProxyType({}))
    # What the gateway knows of each instance's prefix cache (core/prefix.py): "approximate", what it sent where;
    # "events", the instances' KV-cache events where they publish them (`kv_events`), else approximate; "off",
    # nothing (the instances still cache; Eq. 1's latency is then the paper's, decode only).
    prefix_cache: Literal["approximate", "events", "off"] = "approximate"
    prefix_block_tokens: int = option(16, ge=1)  # the engines' KV block size (vLLM's --block-size)
    # Most blocks indexed per instance (fewer when its KV capacity, vllm:cache_config_info, is smaller);
    # about 104 bytes a block, so 13 instances at this bound take at most about 70 MB.
    prefix_index_max_blocks: int = option(50_000, ge=1)

    def _validate(self) -> None:
        if self.policy not in registry.names():
            raise ConfigError(f"unknown policy {self.policy!r} (known: {', '.join(registry.names())})", "policy")
        set_normalised(self, "presets", types.MappingProxyType({**DEFAULT_PRESETS, **self.presets}))
        if self.preset not in self.presets:
            known = ", ".join(self.presets)
            raise ConfigError(f"unknown preset {self.preset!r} (known: {known})", "preset")
        for preset, policy in self.preset_policies.items():
            if preset not in self.presets:
                raise ConfigError(f"unknown preset {preset!r} (known: {', '.join(self.presets)})",
                                  f"preset_policies.{preset}")
            if policy not in registry.names():
                raise ConfigError(f"unknown policy {policy!r} (known: {', '.join(registry.names())})",
                                  f"preset_policies.{preset}")

    def policy_for(self, preset: str) -> str:
        """The policy of a request that names none and runs with `preset`."""
        return self.preset_policies.get(preset, self.policy)


@section
class BatchRule(Section):
    """When the share of instances with waiting requests is below ``below``,
    close a batch at ``size`` requests or ``window_ms`` after its first one."""

    below: float = option(gt=0)
    size: int = option(ge=1)
    window_ms: float = option(ge=0)


DEFAULT_SLO_CLASSES: Mapping[str, float] = types.MappingProxyType({"interactive": 30.0, "batch": 600.0})


@section
class SloConfig(Section):
    """Service-level objectives: the defaults of requests that name none, and the classes they are counted in."""

    # End-to-end SLO (seconds) of a request that names none (and whose key has none), per preset;
    # a preset not listed gives no SLO.
    presets: Mapping[str, float] = option(factory=lambda: types.MappingProxyType({}))
    # Name -> the longest SLO (seconds) in the class; a request falls in the tightest class that
    # holds its SLO (the loosest if longer than all). Metrics and reports count attainment per class.
    classes: Mapping[str, float] = option(factory=lambda: DEFAULT_SLO_CLASSES)
    # Longer SLOs are refused with 400: a unit mistake (milliseconds for seconds), not a wish.
    max_s: float = option(86400.0, gt=0)

    def _validate(self) -> None:
        if not self.classes:
            raise ConfigError("at least one class is required", "classes")
        for name, bound in self.classes.items():
            if not bound > 0:
                raise ConfigError(f"must be > 0, got {bound!r}", f"classes.{name}")
        for name, slo in self.presets.items():
            if not 0 < slo <= self.max_s:
                raise ConfigError(f"must be > 0 and <= max_s ({self.max_s:g}), got {slo!r}", f"presets.{name}")


@section
class BatchingConfig(Section):
    # eager: fire as soon as the scheduler is free; window: the paper's rule.
    mode: BatchMode = "eager"
    max_queue: int = option(4096, ge=1)
    # A request not decided (and, for a policy that holds requests, released) within this is answered 503.
    max_wait_s: float = option(30.0, gt=0)
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


@section
class TelemetryConfig(Section):
    scrape_interval_s: float = option(0.5, gt=0)
    scrape_timeout_s: float = option(1.0, gt=0)
    stale_after_s: float = option(3.0, gt=0)

    def _validate(self) -> None:
        if self.stale_after_s <= self.scrape_interval_s:
            raise ConfigError("must be > scrape_interval_s, or every reading is stale",
                              "stale_after_s")


@section
class TracingConfig(Section):
    """OpenTelemetry traces of the routing decisions, exported over OTLP/HTTP (docs/operations/tracing.md).
    Off by default, and then nothing of OpenTelemetry is imported. Read at start: a change takes a restart."""

    enabled: bool = False
    otlp_endpoint: str = option("http://127.0.0.1:4318/v1/traces", nonempty=True)  # the collector's traces URL
    service_name: str = option("routebalance-gateway", nonempty=True)
    sample_ratio: float = option(1.0, ge=0, le=1)  # of the traces this gateway starts (a client's choice is kept)
    export_timeout_s: float = option(5.0, gt=0)  # each export POST
    export_interval_s: float = option(1.0, gt=0)  # how long finished spans wait to be sent together
    max_queue_spans: int = option(4096, ge=1)  # finished spans waiting for export; beyond it they are dropped
    export_batch_spans: int = option(512, ge=1)  # spans per export POST

    def _validate(self) -> None:
        parts = urlsplit(self.otlp_endpoint)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"must be an http:// or https:// URL, got {self.otlp_endpoint!r}", "otlp_endpoint")
        if self.export_batch_spans > self.max_queue_spans:
            raise ConfigError(f"must be <= max_queue_spans ({self.max_queue_spans})", "export_batch_spans")


@section
class EstimatorsConfig(Section):
    # Where `routebalance train` writes the index, labels and heads; relative
    # paths are taken from the working directory.
    models_dir: str = option("models", nonempty=True)
    # Prompt truncation for the embedder, in tokens ([CLS] and [SEP] included):
    # 256 is the reference; 128 and 64 trade neighbour agreement for speed.
    max_tokens: int = option(256, ge=16, le=512)
    # The embedder's arithmetic: "fp32", the reference, or "int8", onnxruntime's dynamic quantisation of the
    # same graph (about 0.55x the CPU time here; how it routes: docs/operations/load-tests.md).
    precision: Literal["fp32", "int8"] = "fp32"
    threads: int = option(2, ge=1)  # onnxruntime intra-op threads
    batch_size: int = option(8, ge=1)  # length-sorted sub-batches inside one embed call
    # Prompt embeddings kept for prompts seen again (an LRU keyed by the truncated tokens; 0: off).
    embed_cache_entries: int = option(4096, ge=0)
    # Size of the synthetic labelled workload `train` builds when no data is given.
    train_records: int = option(18608, ge=50)
    seed: int = 0
    # A labelled workload file (JSON Lines, the shape of `routebalance train --workload`) the estimators
    # are built from; unset: the synthetic one. Estimators built from a file are never rebuilt from
    # synthetic data: `up` and `sim` keep them when this is unset.
    workload: str | None = option(None, nonempty=True)
    # A workload file's labels are scarce, so every record trains the served estimators, and the report
    # comes from repeated k-fold (cv_repeats x cv_folds), each prompt predicted by estimators that never saw
    # it; the same folds choose among the candidate estimators (estimators/crossfit.py).
    cv_folds: int = option(5, ge=2, le=20)
    cv_repeats: int = option(3, ge=1, le=20)
    # The synthetic workload's quality labels: "graded" scores in [0, 1], or "binary" 0/1
    # judgements drawn from them (as real data sets often label answers).
    labels: Literal["graded", "binary"] = "graded"


@section
class ProgressiveConfig(Section):
    """Progressive mode (PICE, `routing.mode = "progressive"`): the bounds of one request's plan, and when a
    prompt is better answered whole (core/progressive.py `FallbackRule`)."""

    max_points: int = option(8, ge=1, le=16)  # points asked for (and kept) in the sketch
    sketch_max_tokens: int = option(160, ge=8)
    expansion_max_tokens: int = option(200, ge=8)
    candidates: int = option(2, ge=1, le=4)  # expansions per point, on this many of the cheapest models
    min_points: int = option(2, ge=1)  # a sketch with fewer points is answered whole
    # short_answer: a predicted answer of the largest tier under this many tokens is answered whole
    # (0: never; live, the prediction is the estimators' KNN length).
    min_answer_tokens: int = option(200, ge=0)
    fact_max_words: int = option(15, ge=0)  # single_fact: a question this short opening "what/who/when..."
    fact_max_answer_tokens: int = option(400, ge=0)  # ... whose predicted answer is at most this long
    # A point keeps its candidate of highest confidence, PICE's Eq. 3: this weight on the mean token
    # probability, the next on the length over expansion_max_tokens, the rest on ROUGE-L against the point.
    confidence_logprob_weight: float = option(0.5, ge=0, le=1)
    confidence_length_weight: float = option(0.25, ge=0, le=1)

    def _validate(self) -> None:
        if self.min_points > self.max_points:
            raise ConfigError(f"must not exceed max_points ({self.max_points})", "min_points")
        if self.confidence_logprob_weight + self.confidence_length_weight > 1 + 1e-9:
            raise ConfigError("confidence_logprob_weight + confidence_length_weight must not exceed 1",
                              "confidence_length_weight")

    def limits(self) -> ProgressiveLimits:
        weights = ConfidenceWeights(self.confidence_logprob_weight, self.confidence_length_weight,
                                    self.expansion_max_tokens)
        return ProgressiveLimits(self.max_points, self.sketch_max_tokens, self.expansion_max_tokens, self.candidates,
                                 self.min_points, weights)

    def rule(self) -> FallbackRule:
        return FallbackRule(self.min_answer_tokens, self.fact_max_words, self.fact_max_answer_tokens)


@section
class MoeConfig(Section):
    """[instances.moe]: the instance serves a mixture-of-experts model. Emulator and simulator only (a real
    vLLM ignores it): a decode step's MoE layers cost grows with the union of experts its batch activates,
    and requests of one domain (the prompt's kind) share experts (gateway/core/engine/moe.py)."""

    experts: int = option(128, ge=1)  # routed experts per MoE layer
    experts_per_token: int = option(8, ge=1)  # top-k
    layers: int = option(48, ge=1)  # MoE layers
    # How peaked each domain's preferred experts are (a softmax temperature's inverse; 0: every domain
    # routes uniformly, no locality). 1.3 makes a same-domain batch of 8-32 load 19-20% fewer experts
    # than a mixed one (the paper's 17-21%).
    concentration: float = option(1.3, ge=0)
    shared: float = option(0.3, ge=0, le=1)  # share of the expert preference all domains have in common
    moe_share: float = option(0.6, gt=0)  # of a lone decode step, the time in the MoE layers (< 1)
    # MoE-layer time that does not grow with the experts loaded, in experts' worth (the paper's Fig. 2:
    # 16 -> 128 active experts is 4.7x the MoE-layer latency, so about 14)
    fixed_experts: float = option(14.0, ge=0)
    seed: int = 0  # of the domains' expert preferences
    # Within-kind structure the kind does not reveal: `within` of a domain's own preference is its subdomain's,
    # `subdomains` per kind, a prompt's fixed by its text's hash (0 / 1: the kind alone, as before)
    within: float = option(0.0, ge=0, le=1)
    subdomains: int = option(1, ge=1)
    # Share of a domain's own preference its prefill tokens draw afresh (0.3: per-expert prefill/decode
    # correlation 0.81, inside the paper's 0.70-0.92); what a count-IDF signature sees
    prefill_noise: float = option(0.0, ge=0, le=1)

    def _validate(self) -> None:
        if self.experts_per_token > self.experts:
            raise ConfigError(f"must be <= experts ({self.experts})", "experts_per_token")
        if self.moe_share >= 1:
            raise ConfigError(f"must be < 1 (the dense part keeps the rest), got {self.moe_share}", "moe_share")


InstanceKind = Literal["generate", "embed"]
_GPU_MEMORY = re.compile(r"(\d+(?:\.\d+)?)\s*GB?$", re.IGNORECASE)


@section
class Instance(Section):
    name: str = option(nonempty=True)
    url: str = option(nonempty=True)  # server root, e.g. http://10.0.0.5:8000 (no /v1)
    model: str = option(nonempty=True)  # the name vLLM serves it under
    # Sent as "Authorization: Bearer <api_key>" (vLLM's --api-key), so the pool need not be open.
    api_key: str | None = option(None, nonempty=True)
    gpu: str = option(nonempty=True)
    gpu_count: int = option(1, ge=1)
    tensor_parallel: int = option(1, ge=1)
    # Per GPU. None: read from the GPU name ("A100-80GB" -> 80) if it says; only the
    # emulator and the simulator need it (they model the KV cache).
    gpu_memory_gb: float | None = option(None, gt=0)
    gpu_memory_utilization: float = option(0.9, gt=0, le=1)
    max_num_seqs: int = option(256, ge=1)
    max_model_len: int = option(8192, ge=1)
    price_input_per_mtok: float = option(ge=0)  # USD per 1M tokens
    price_output_per_mtok: float = option(ge=0)
    tpot_prior_ms: float = option(gt=0)
    # Instances naming the same gpu_id time-share one GPU, one model loaded at a time (simulated only).
    gpu_id: str | None = option(None, nonempty=True)
    # [instances.faults]: the emulator's fault knobs for this instance; lab code reads and checks them
    # (gateway/lab/emulator/settings.py), and a gateway in front of a real server never looks at them.
    faults: Mapping[str, Any] = option(factory=lambda: types.MappingProxyType({}))
    moe: MoeConfig | None = None  # [instances.moe]: a mixture-of-experts model (emulated and simulated instances)
    # It caches prompt prefixes (vLLM's default; false: served with --no-enable-prefix-caching). The emulator and
    # the simulator obey it, and the gateway predicts no cache hit on an instance that does not cache.
    prefix_caching: bool = True
    # Where it publishes vLLM's KV-cache events (--kv-events-config's ZMQ endpoint, e.g. "tcp://10.0.0.5:5557");
    # with [scheduler] prefix_cache = "events" the gateway reads them. An emulated instance publishes there.
    kv_events: str | None = option(None, nonempty=True)
    # "generate" serves chat, completions and responses; "embed" serves /v1/embeddings only (a vLLM pooling
    # model), chosen by load and priced per input token (price_input_per_mtok; the output price is unused).
    kind: InstanceKind = "generate"

    def _validate(self) -> None:
        if self.kind == "embed" and (self.moe is not None or self.gpu_id is not None or self.kv_events is not None):
            raise ConfigError("an embed instance has no moe, gpu_id or kv_events (it generates no tokens)", "kind")
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ConfigError(f"must be an http:// or https:// URL, got {self.url!r}", "url")
        if parts.path.rstrip("/").endswith("/v1"):
            raise ConfigError("give the server root, without /v1 (the gateway adds the "
                              "/v1/... and /metrics paths)", "url")
        set_normalised(self, "url", self.url.rstrip("/"))  # so callers can append "/v1/..."
        if self.tensor_parallel > self.gpu_count:
            raise ConfigError(f"must be <= gpu_count ({self.gpu_count}), got "
                              f"{self.tensor_parallel}", "tensor_parallel")
        if self.gpu_memory_gb is None:
            m = _GPU_MEMORY.search(self.gpu)
            if m:
                set_normalised(self, "gpu_memory_gb", float(m.group(1)))


@section
class Config(Section):
    server: ServerConfig = ServerConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    health: HealthConfig = HealthConfig()
    auth: AuthConfig = AuthConfig()
    state: StateConfig = StateConfig()
    scheduler: SchedulerConfig = option(factory=SchedulerConfig)
    slo: SloConfig = option(factory=SloConfig)
    batching: BatchingConfig = BatchingConfig()
    telemetry: TelemetryConfig = TelemetryConfig()
    tracing: TracingConfig = TracingConfig()
    estimators: EstimatorsConfig = EstimatorsConfig()
    learning: LearningConfig = option(factory=LearningConfig)
    judge: JudgeConfig = JudgeConfig()
    # [emulator]: the emulated pool's settings; lab code reads and checks them (gateway/lab/emulator/settings.py).
    emulator: Mapping[str, Any] = option(factory=lambda: types.MappingProxyType({}))
    progressive: ProgressiveConfig = ProgressiveConfig()
    instances: tuple[Instance, ...] = option()
    # The instances of kind "embed", taken out of `instances` (which keeps the generating ones, all that the
    # scheduling loop, the policies and the estimators see): /v1/embeddings routes over these alone.
    embedders: tuple[Instance, ...] = field(default=(), metadata={"derived": True})
    # [policies.<table>]: each policy's own options, checked by the section its
    # module registered (parse_config builds them; a table left out has its defaults).
    policies: Mapping[str, Any] = field(default_factory=lambda: types.MappingProxyType({}))
    _by_name: Mapping[str, Instance] = field(init=False, repr=False, compare=False)

    def _validate(self) -> None:
        if not self.instances:
            raise ConfigError("at least one instance is required", "instances")
        names: dict[str, int] = {}
        urls: dict[str, int] = {}
        for i, inst in enumerate((*self.instances, *self.embedders)):
            if inst.name in names:
                raise ConfigError(f"duplicate instance name {inst.name!r} (also "
                                  f"instances[{names[inst.name]}])", f"instances[{i}].name")
            if inst.url in urls:
                raise ConfigError(f"duplicate url {inst.url!r} (also instances[{urls[inst.url]}])",
                                  f"instances[{i}].url")
            names[inst.name] = urls[inst.url] = i
        shared: dict[str, Instance] = {}
        for i, inst in enumerate(self.instances):
            first = shared.setdefault(inst.gpu_id, inst) if inst.gpu_id is not None else inst
            if (first.gpu, first.gpu_count) != (inst.gpu, inst.gpu_count):
                raise ConfigError(f"shares gpu_id {inst.gpu_id!r} with {first.name!r}, so it must name the same gpu "
                                  f"and gpu_count", f"instances[{i}].gpu_id")
        self._split_kinds()  # after the checks that name an instance by its index in the file
        set_normalised(self, "_by_name", types.MappingProxyType({i.name: i for i in self.instances}))
        models = {*self.models(), *self.embedding_models()}
        for i, alias in enumerate(self.server.aliases):
            if alias in models:
                raise ConfigError(f"alias {alias!r} is also a pool model name",
                                  f"server.aliases[{i}]")
        for i, key in enumerate(self.auth.keys):
            for j, model in enumerate(key.models):
                if model not in models and model not in self.server.aliases:
                    raise ConfigError(f"{model!r} is neither a pool model nor an alias",
                                      f"auth.keys[{i}].models[{j}]")
            for j, preset in enumerate(key.presets):
                if preset not in self.scheduler.presets:
                    raise ConfigError(f"unknown preset {preset!r}", f"auth.keys[{i}].presets[{j}]")
            if key.slo_s is not None and key.slo_s > self.slo.max_s:
                raise ConfigError(f"must be <= slo.max_s ({self.slo.max_s:g})", f"auth.keys[{i}].slo_s")
        for preset in self.slo.presets:
            if preset not in self.scheduler.presets:
                raise ConfigError(f"unknown preset {preset!r}", f"slo.presets.{preset}")

    def _split_kinds(self) -> None:
        """Move the embed instances to `embedders`. A model is one kind's: a name served by both would make a
        chat request and an embeddings request to it ambiguous."""
        generate = tuple(inst for inst in self.instances if inst.kind == "generate")
        embed = (*self.embedders, *(inst for inst in self.instances if inst.kind == "embed"))
        if not generate:
            raise ConfigError('at least one instance of kind "generate" is required', "instances")
        generating = {inst.model for inst in generate}
        for i, inst in enumerate((*self.instances, *self.embedders)):
            if inst.kind == "embed" and inst.model in generating:
                raise ConfigError(f"model {inst.model!r} is served by instances of both kinds; an embedding "
                                  f"model needs a name of its own", f"instances[{i}].model")
        set_normalised(self, "instances", generate)
        set_normalised(self, "embedders", embed)

    def models(self) -> tuple[str, ...]:
        """Distinct served model names (of the generating instances), in order of first appearance."""
        return tuple(dict.fromkeys(inst.model for inst in self.instances))

    def embedding_models(self) -> tuple[str, ...]:
        """Distinct model names of the embed instances, in order of first appearance."""
        return tuple(dict.fromkeys(inst.model for inst in self.embedders))

    def instance(self, name: str) -> Instance:
        """The instance called ``name``; KeyError if there is none."""
        return self._by_name[name]

    def weights(self, preset: str) -> Weights:
        """The weights of a named preset; KeyError if there is none."""
        return self.scheduler.presets[preset]

    def options(self, table: str) -> Any:
        """The options of ``[policies.<table>]``: as configured, else the registered defaults."""
        found = self.policies.get(table)
        return found if found is not None else registry.options_class(table)()

    def with_options(self, table: str, **changes: Any) -> Config:
        """This config with fields of ``[policies.<table>]`` changed (experiments, ablations)."""
        options = dataclasses.replace(self.options(table), **changes)
        return dataclasses.replace(self, policies=types.MappingProxyType({**self.policies, table: options}))


# --------------------------------------------------------------------------
# Loading


def parse_config(data: dict[str, Any], source: str = "<config>") -> Config:
    """Validate already-parsed TOML data; ConfigError names ``source`` and the key."""
    try:
        data = dict(data)
        _moved_keys(data)
        policies = _policy_tables(data.pop("policies", {}))
        return dataclasses.replace(build_section(Config, data, ""), policies=policies)
    except ConfigError as err:
        raise ConfigError(err.reason, err.key, source) from None


def _policy_tables(data: Any) -> Mapping[str, Any]:
    if not isinstance(data, dict):
        raise ConfigError("expected a table of policy tables", "policies")
    tables = {}
    for table, values in data.items():
        try:
            cls = registry.options_class(table)
        except KeyError:
            known = ", ".join(registry.tables()) or "none"
            raise ConfigError(f"no policy has a table of this name (known: {known})", f"policies.{table}") from None
        tables[table] = build_section(cls, values, f"policies.{table}")
    return types.MappingProxyType(tables)


def _moved_keys(data: dict[str, Any]) -> None:
    for key, where in MOVED.items():
        *tables, name = key.split(".")
        table: Any = data
        for t in tables:
            table = table.get(t) if isinstance(table, dict) else None
        if isinstance(table, dict) and name in table:
            raise ConfigError(f"moved to {where}", key)
