"""Reading a vLLM /metrics page into the few numbers the scheduler uses.

Both metric generations are read: `vllm:kv_cache_usage_perc` (v1) or
`vllm:gpu_cache_usage_perc` (older), counters with or without `_total`, and
data-parallel ranks (one `engine` label each) summed into one instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    running: float
    waiting: float
    kv_usage: float  # 0..1, the mean over ranks
    generation_tokens: float  # cumulative counter
    prompt_tokens: float


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",
}
_COUNTERS = {"vllm:generation_tokens": "generation", "vllm:prompt_tokens": "prompt"}


def parse_vllm_metrics(text: str) -> EngineSnapshot:
    """Raises ValueError if the page is not Prometheus text or lacks the running gauge."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {"kv": [], "kv_old": []}
    for family in text_string_to_metric_families(text):
        name = family.name
        if name.endswith("_total"):  # some parsers keep the suffix on the family
            name = name[:-6]
        key = _GAUGES.get(name) or _COUNTERS.get(name)
        if key is None:
            continue
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket", "_count", "_sum")):
                continue
            if key in kv:
                kv[key].append(sample.value)
            else:
                sums[key] = sums.get(key, 0.0) + sample.value
    if "running" not in sums:
        raise ValueError("not a vLLM metrics page: vllm:num_requests_running is missing")
    usage = kv["kv"] or kv["kv_old"]
    return EngineSnapshot(
        running=sums["running"],
        waiting=sums.get("waiting", 0.0),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        generation_tokens=sums.get("generation", 0.0),
        prompt_tokens=sums.get("prompt", 0.0),
    )
