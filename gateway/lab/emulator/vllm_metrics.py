"""The /metrics page of one emulated vLLM instance.

Anything that scrapes a real vLLM (v1 engine) must read an emulated instance
the same way, so this module reproduces the metric families vLLM's
``PrometheusStatLogger`` (``vllm/v1/metrics/loggers.py``) registers: the same
names, types, label names (``model_name``, ``engine``, plus
``finished_reason`` on ``vllm:request_success``) and histogram bucket
boundaries. The page is rendered with prometheus_client, the library vLLM
itself uses, so the text format (``_total`` on counters, ``_created`` series,
``le`` formatting, label order) is byte-for-byte the same kind of page.

Version notes. vLLM renamed a few metrics over time and readers in the wild
use either name, so both generations are exposed where they differ:

* ``vllm:kv_cache_usage_perc`` (0.9+) and ``vllm:gpu_cache_usage_perc``
  (older; hidden from 0.11) carry the same value, a fraction in 0..1.
* ``vllm:inter_token_latency_seconds`` (0.11+) and
  ``vllm:time_per_output_token_seconds`` (older; hidden from 0.12) are
  observed together, as vLLM 0.11 does; both are per-token gaps.
* ``vllm:request_time_per_output_token_seconds`` (0.11+): one observation per
  finished request, ``decode_time / (generation_tokens - 1)`` (0 when the
  request produced at most one token), as vLLM computes it.

Cost. Every recording method is a handful of locked float additions: the
label children are bound once at construction, and histogram observations
find their bucket with ``bisect`` instead of prometheus_client's linear scan.
``observe_inter_token(gap, count)`` records ``count`` equal gaps with one
bucket increment, so a decode step over a batch of B sequences is one call.

Single instance, single registry: each ``VllmMetrics`` owns a private
``CollectorRegistry`` (never the process-global one), so N emulated instances
in one process do not collide.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

__all__ = [
    "CONTENT_TYPE",
    "FINISH_REASONS",
    "ITERATION_TOKENS_BUCKETS",
    "PARAMS_N_BUCKETS",
    "REQUEST_LATENCY_BUCKETS",
    "TOKEN_LATENCY_BUCKETS",
    "TTFT_BUCKETS",
    "VllmMetrics",
    "build_1_2_5_buckets",
]

#: Content type of the page. The classic text format (what generate_latest
#: writes), the one vLLM serves with the prometheus_client versions it pins.
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

# Bucket boundaries, as in vllm/v1/metrics/loggers.py.
#: vllm:time_to_first_token_seconds (22 boundaries; note: no 2.0).
TTFT_BUCKETS: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
#: Per-token latency histograms: vllm:inter_token_latency_seconds,
#: vllm:time_per_output_token_seconds, vllm:request_time_per_output_token_seconds
#: (19 boundaries).
TOKEN_LATENCY_BUCKETS: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
#: Per-request phase histograms: e2e, queue, inference, prefill, decode
#: (21 boundaries).
REQUEST_LATENCY_BUCKETS: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
    40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
)
#: vllm:iteration_tokens_total (tokens per engine step).
ITERATION_TOKENS_BUCKETS: tuple[int, ...] = (
    1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
)
#: vllm:request_params_n.
PARAMS_N_BUCKETS: tuple[int, ...] = (1, 2, 5, 10, 20)

#: Finish reasons whose request_success series exist from the start (vLLM
#: pre-creates one per FinishReason; "error" is the newest of them).
FINISH_REASONS: tuple[str, ...] = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to and including ``max_value``.

    The bucket rule vLLM uses for the token-count histograms, bounded by the
    instance's max_model_len.
    """
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value > max_value:
                return out
            out.append(value)
        scale *= 10


class _FastHistogram:
    """A bound histogram child with a cheap observe.

    prometheus_client keeps per-bucket (non-cumulative) counts in
    ``child._buckets`` and the running sum in ``child._sum``; bumping those
    directly lets one call add ``count`` equal observations and find the
    bucket by bisection. If a future client stops exposing them, this falls
    back to the public ``observe`` (looped for ``count``).
    """

    __slots__ = ("_child", "_bounds", "_buckets", "_sum", "fast")

    def __init__(self, child: Any) -> None:
        self._child = child
        bounds = getattr(child, "_upper_bounds", None)
        buckets = getattr(child, "_buckets", None)
        total = getattr(child, "_sum", None)
        self.fast = bool(
            isinstance(bounds, list)
            and isinstance(buckets, list)
            and len(bounds) == len(buckets)
            and bounds
            and bounds[-1] == float("inf")
            and all(hasattr(b, "inc") for b in buckets)
            and hasattr(total, "inc")
        )
        self._bounds = list(bounds) if self.fast else []
        self._buckets = buckets if self.fast else []
        self._sum = total if self.fast else None

    def observe(self, value: float) -> None:
        if self.fast:
            # bisect_left: first bound >= value, i.e. the bucket "value <= le".
            self._buckets[bisect_left(self._bounds, value)].inc(1)
            self._sum.inc(value)
        else:
            self._child.observe(value)

    def observe_n(self, value: float, count: int) -> None:
        if count <= 0:
            return
        if self.fast:
            self._buckets[bisect_left(self._bounds, value)].inc(count)
            self._sum.inc(value * count)
        else:
            observe = self._child.observe
            for _ in range(count):
                observe(value)


class VllmMetrics:
    """Prometheus metrics of one emulated vLLM instance (one engine).

    Recording methods are meant for the emulator's step loop; ``render()``
    produces the /metrics body (serve it with ``CONTENT_TYPE``).
    """

    def __init__(
        self,
        model_name: str,
        engine: str = "0",
        *,
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        num_gpu_blocks: int,
        gpu_memory_utilization: float,
        enable_prefix_caching: bool = True,
        extra_cache_info: Mapping[str, object] | None = None,
    ) -> None:
        if max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if block_size < 1 or num_gpu_blocks < 0:
            raise ValueError("block_size must be >= 1 and num_gpu_blocks >= 0")
        self.model_name = str(model_name)
        self.engine = str(engine)
        self.max_num_seqs = int(max_num_seqs)
        self.max_model_len = int(max_model_len)
        self.block_size = int(block_size)
        self.num_gpu_blocks = int(num_gpu_blocks)
        self.gpu_memory_utilization = float(gpu_memory_utilization)
        self.enable_prefix_caching = bool(enable_prefix_caching)

        reg = self.registry = CollectorRegistry()
        labelnames = ("model_name", "engine")
        lv = (self.model_name, self.engine)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name, doc, labelnames, registry=reg).labels(*lv)

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, labelnames, registry=reg).labels(*lv)

        def histogram(name: str, doc: str, buckets: tuple[float, ...] | list[int]) -> _FastHistogram:
            return _FastHistogram(
                Histogram(name, doc, labelnames, buckets=buckets, registry=reg).labels(*lv)
            )

        # Scheduler state.
        self._running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self._waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        # KV cache (the old name carries the same value).
        self._gpu_cache_usage = gauge(
            "vllm:gpu_cache_usage_perc",
            "GPU KV-cache usage. 1 means 100 percent usage. "
            "DEPRECATED: Use vllm:kv_cache_usage_perc instead.",
        )
        self._kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self._prefix_queries = counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self._prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")

        # Counters.
        self._preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self._prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self._generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success_family = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labelnames + ("finished_reason",),
            registry=reg,
        )
        self._success: dict[str, Any] = {
            reason: self._success_family.labels(*lv, reason) for reason in FINISH_REASONS
        }

        # Histograms of counts.
        token_buckets = build_1_2_5_buckets(self.max_model_len)
        self._h_prompt_tokens = histogram(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", token_buckets
        )
        self._h_prefill_computed = histogram(
            "vllm:request_prefill_kv_computed_tokens",
            "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
            token_buckets,
        )
        self._h_generation_tokens = histogram(
            "vllm:request_generation_tokens", "Number of generation tokens processed.", token_buckets
        )
        self._h_iteration_tokens = histogram(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", ITERATION_TOKENS_BUCKETS
        )
        self._h_max_num_generation_tokens = histogram(
            "vllm:request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            token_buckets,
        )
        self._h_params_n = histogram("vllm:request_params_n", "Histogram of the n request parameter.", PARAMS_N_BUCKETS)
        self._h_params_max_tokens = histogram(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.", token_buckets
        )

        # Histograms of timing intervals.
        self._h_ttft = histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._h_tpot = histogram(
            "vllm:time_per_output_token_seconds",
            "Histogram of time per output token in seconds. "
            "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._h_itl = histogram(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS
        )
        self._h_request_tpot = histogram(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            TOKEN_LATENCY_BUCKETS,
        )
        self._h_e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS
        )
        self._h_queue = histogram(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._h_inference = histogram(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._h_prefill = histogram(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )
        self._h_decode = histogram(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_LATENCY_BUCKETS,
        )

        # Cache config, an info-style gauge fixed at 1. vLLM labels it with
        # every CacheConfig field as str() plus engine; model_name is added
        # here so a reader can select it like every other family.
        self.cache_info = self._cache_info_labels(extra_cache_info)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            tuple(self.cache_info),
            registry=reg,
        )
        info.labels(**self.cache_info).set(1)

    def _cache_info_labels(self, extra: Mapping[str, object] | None) -> dict[str, str]:
        # Field names and str() forms as vLLM's CacheConfig.metrics_info()
        # produces them (booleans "True"/"False", unset values "None").
        info: dict[str, object] = {
            "block_size": self.block_size,
            "gpu_memory_utilization": self.gpu_memory_utilization,
            "swap_space": 4,
            "cache_dtype": "auto",
            "is_attention_free": False,
            "num_gpu_blocks_override": None,
            "sliding_window": None,
            "enable_prefix_caching": self.enable_prefix_caching,
            "prefix_caching_hash_algo": "sha256",
            "cpu_offload_gb": 0,
            "calculate_kv_scales": False,
            "kv_cache_memory_bytes": None,
            "num_gpu_blocks": self.num_gpu_blocks,
            "num_cpu_blocks": None,
            "kv_cache_size_tokens": self.num_gpu_blocks * self.block_size,
        }
        if extra:
            info.update(extra)
        info["model_name"] = self.model_name
        info["engine"] = self.engine
        return {str(k): str(v) for k, v in info.items()}

    # ------------------------------------------------------------------
    # Recording (hot loop).

    def set_state(self, num_running: int, num_waiting: int, kv_cache_usage: float) -> None:
        """Scheduler snapshot: batch size, queue length, KV usage fraction (0..1)."""
        self._running.set(num_running)
        self._waiting.set(num_waiting)
        self._kv_cache_usage.set(kv_cache_usage)
        self._gpu_cache_usage.set(kv_cache_usage)

    def add_tokens(self, prompt: int, generation: int) -> None:
        """Add to the prompt / generation token counters."""
        if prompt:
            self._prompt_tokens.inc(prompt)
        if generation:
            self._generation_tokens.inc(generation)

    def record_step(self, prompt: int, generation: int) -> None:
        """One engine step, as vLLM records an iteration: the token counters
        plus one ``vllm:iteration_tokens_total`` observation of their sum.
        Use this or ``add_tokens`` for a step, not both."""
        self.add_tokens(prompt, generation)
        self._h_iteration_tokens.observe(prompt + generation)

    def add_preemptions(self, n: int) -> None:
        if n:
            self._preemptions.inc(n)

    def add_prefix_cache(self, queries: int, hits: int) -> None:
        """Prefix-cache lookups in tokens: prompt tokens looked up, and of those found cached. vLLM registers
        both counters whether or not it caches, so an instance that does not stays at 0."""
        if queries:
            self._prefix_queries.inc(queries)
        if hits:
            self._prefix_hits.inc(hits)

    def observe_ttft(self, seconds: float) -> None:
        """Time to first token, recorded when the first token appears (vLLM's
        timing). Pass ``ttft_s=None`` to ``observe_finished`` if you use it."""
        self._h_ttft.observe(seconds if seconds > 0.0 else 0.0)

    def observe_inter_token(self, seconds: float, count: int = 1) -> None:
        """``count`` inter-token gaps of ``seconds`` each (e.g. one decode
        step over a batch of ``count`` sequences). Observed in both
        ``vllm:inter_token_latency_seconds`` and the older
        ``vllm:time_per_output_token_seconds``."""
        if seconds < 0.0:
            seconds = 0.0
        if count == 1:
            self._h_itl.observe(seconds)
            self._h_tpot.observe(seconds)
        else:
            self._h_itl.observe_n(seconds, count)
            self._h_tpot.observe_n(seconds, count)

    def observe_finished(
        self,
        *,
        finished_reason: str,
        ttft_s: float | None,
        e2e_s: float,
        queue_s: float,
        prefill_s: float,
        decode_s: float,
        inference_s: float,
        prompt_tokens: int,
        generation_tokens: int,
        max_tokens: int | None,
        n: int | None = 1,
        cached_tokens: int = 0,
    ) -> None:
        """A finished request, as vLLM records one; with ``n`` None, one
        sample of a request for several answers, whose ``n`` and longest
        answer `observe_request` records once its last sample has finished.

        Intervals follow vLLM's definitions: queue = queued -> first
        scheduled; prefill = first scheduled -> first token; decode = first ->
        last token; inference = first scheduled -> last token (prefill +
        decode); e2e = arrival -> finish; ttft = arrival -> first token.
        ``ttft_s`` is observed here unless it is None (then either the request
        never produced a token, or ``observe_ttft`` already recorded it).
        ``max_tokens`` is observed only when the client set it (truthy), as in
        vLLM. Negative intervals are clamped to 0. ``cached_tokens``: of the
        prompt, found in the prefix cache (the rest is the KV computed).
        """
        success = self._success.get(finished_reason)
        if success is None:
            success = self._success[finished_reason] = self._success_family.labels(
                self.model_name, self.engine, finished_reason
            )
        success.inc()
        if ttft_s is not None:
            self._h_ttft.observe(ttft_s if ttft_s > 0.0 else 0.0)
        self._h_e2e.observe(e2e_s if e2e_s > 0.0 else 0.0)
        self._h_queue.observe(queue_s if queue_s > 0.0 else 0.0)
        self._h_prefill.observe(prefill_s if prefill_s > 0.0 else 0.0)
        self._h_inference.observe(inference_s if inference_s > 0.0 else 0.0)
        decode = decode_s if decode_s > 0.0 else 0.0
        self._h_decode.observe(decode)
        self._h_prompt_tokens.observe(prompt_tokens)
        self._h_prefill_computed.observe(max(prompt_tokens - cached_tokens, 0))
        self._h_generation_tokens.observe(generation_tokens)
        # Mean time per output token excludes the token the prefill produced.
        self._h_request_tpot.observe(decode / (generation_tokens - 1) if generation_tokens > 1 else 0.0)
        if n is not None:
            self.observe_request(n, generation_tokens)
        if max_tokens:
            self._h_params_max_tokens.observe(max_tokens)

    def observe_request(self, n: int, max_generation_tokens: int) -> None:
        """A request whose ``n`` samples have all finished, the longest with
        ``max_generation_tokens`` tokens: vLLM records these once per request
        (ParentRequest.observe_finished_request), its samples each as a
        finished request of its own."""
        self._h_max_num_generation_tokens.observe(max_generation_tokens)
        self._h_params_n.observe(n)

    # ------------------------------------------------------------------
    # Exposition.

    def render(self) -> bytes:
        """The /metrics body (Prometheus text format)."""
        return generate_latest(self.registry)
