"""Reading a vLLM /metrics page into the few numbers the scheduler uses.

Both metric generations are read: `vllm:kv_cache_usage_perc` (v1) or
`vllm:gpu_cache_usage_perc` (older), counters with or without `_total`, and
data-parallel ranks (one `engine` label each) summed into one instance.
"""

from __future__ import annotations

import asyncio
import logging

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.scheduling.ledger import EngineSnapshot, PoolLedger

log = logging.getLogger("routebalance.telemetry")


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",
}
_COUNTERS = {"vllm:generation_tokens": "generation", "vllm:prompt_tokens": "prompt"}


_WANTED = tuple(_GAUGES) + tuple(_COUNTERS)


def _wanted_lines(text: str) -> str:
    """Only the families read here: a vLLM page has dozens of histograms that cost parsing time."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def parse_vllm_metrics(text: str) -> EngineSnapshot:
    """Raises ValueError if the page is not Prometheus text or lacks the running gauge."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {"kv": [], "kv_old": []}
    for family in text_string_to_metric_families(_wanted_lines(text)):
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


async def scrape_once(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> EngineSnapshot:
    """One instance's /metrics. Raises aiohttp.ClientError, TimeoutError or ValueError."""
    async with session.get(url + "/metrics", timeout=timeout) as resp:
        if resp.status != 200:
            raise ValueError(f"/metrics answered {resp.status}")
        return parse_vllm_metrics(await resp.text())


async def scrape_forever(session: aiohttp.ClientSession, store, ledger: PoolLedger) -> None:
    """Scrape every instance of the current config each interval, concurrently, into the `ledger`.

    A failed scrape leaves the last reading to go stale (the scheduler then
    relies on its own accounting of what it dispatched); an instance that refuses connections is
    also marked down, as a failed dispatch would.
    """
    loop = asyncio.get_running_loop()
    failing: set[str] = set()  # log a failure once, not every interval

    async def one(inst, timeout) -> None:
        try:
            snap = await scrape_once(session, inst.url, timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if isinstance(e, aiohttp.ClientConnectionError) and not isinstance(e, aiohttp.ServerTimeoutError):
                ledger.mark_down(inst.name, loop.time())
            if inst.name not in failing:
                log.warning("scraping %s failed: %s", inst.name, e.__class__.__name__)
                failing.add(inst.name)
            return
        failing.discard(inst.name)
        ledger.mark_up(inst.name)
        ledger.of(inst.name).scraped(snap, loop.time())

    while True:
        cfg = store.current
        timeout = aiohttp.ClientTimeout(total=cfg.telemetry.scrape_timeout_s)
        started = loop.time()
        await asyncio.gather(*(one(inst, timeout) for inst in cfg.instances))
        await asyncio.sleep(max(0.0, cfg.telemetry.scrape_interval_s - (loop.time() - started)))
