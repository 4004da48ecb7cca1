"""Reading a vLLM /metrics page into the few numbers the scheduler uses.

Both metric generations are read: `vllm:kv_cache_usage_perc` (v1) or
`vllm:gpu_cache_usage_perc` (older), counters with or without `_total`, and
data-parallel ranks (one `engine` label each) summed into one instance.

An instance without a usable page (llama.cpp's server has none, and nor do
many OpenAI-compatible servers) is still routed, on the gateway's own
accounting of what it dispatched there: `ScrapeLog` says so once per instance
and problem, again every REPEAT_WARNING_S while it lasts, and when scraping
recovers.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from gateway.core.pool_state import EngineSnapshot, PoolState

log = logging.getLogger("routebalance.telemetry")


_GAUGES = {
    "vllm:num_requests_running": "running",
    "vllm:num_requests_waiting": "waiting",
    "vllm:kv_cache_usage_perc": "kv",
    "vllm:gpu_cache_usage_perc": "kv_old",
}
_COUNTERS = {"vllm:generation_tokens": "generation", "vllm:prompt_tokens": "prompt",
             "vllm:prefix_cache_queries": "prefix_queries", "vllm:prefix_cache_hits": "prefix_hits"}
_CACHE_CONFIG = "vllm:cache_config"  # vllm:cache_config_info: the KV capacity is its num_gpu_blocks label
# Histograms read by their _sum and _count (the prefill rate's measurements, core/prefill_rate.py)
_HISTOGRAMS = {"vllm:request_prefill_time_seconds": "prefill", "vllm:request_prefill_kv_computed_tokens": "computed"}


_WANTED = (*_GAUGES, *_COUNTERS, *_HISTOGRAMS, _CACHE_CONFIG)


def _wanted_lines(text: str) -> str:
    """Only the families read here: a vLLM page has dozens of histograms that cost parsing time."""
    keep = []
    for line in text.splitlines():
        name = line[7:] if line.startswith(("# HELP ", "# TYPE ")) else line
        if name.startswith(_WANTED):
            keep.append(line)
    return "\n".join(keep) + "\n"


def _families(text: str) -> list:
    try:
        return list(text_string_to_metric_families(_wanted_lines(text)))
    except ValueError as e:  # the parser's own words ("invalid metric name") do not say what was read
        raise ValueError(f"not a vLLM metrics page: not Prometheus text ({e})") from None


def parse_vllm_metrics(text: str) -> EngineSnapshot:
    """Raises ValueError if the page is not Prometheus text or lacks the running gauge."""
    sums: dict[str, float] = {}
    kv: dict[str, list[float]] = {"kv": [], "kv_old": []}
    blocks = 0
    for family in _families(text):
        name = family.name
        if name.endswith("_total"):  # some parsers keep the suffix on the family
            name = name[:-6]
        if name.startswith(_CACHE_CONFIG):  # one sample per engine (data-parallel rank), each its own KV cache
            blocks = sum(_int_label(s.labels, "num_gpu_blocks") for s in family.samples)
            continue
        if name in _HISTOGRAMS:
            for sample in family.samples:
                if sample.name.endswith(("_sum", "_count")):
                    key = _HISTOGRAMS[name] + sample.name[sample.name.rindex("_"):]
                    sums[key] = sums.get(key, 0.0) + sample.value
            continue
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
        raise ValueError("not a vLLM metrics page: it has no vllm:num_requests_running")
    usage = kv["kv"] or kv["kv_old"]
    return EngineSnapshot(
        running=sums["running"],
        waiting=sums.get("waiting", 0.0),
        kv_usage=sum(usage) / len(usage) if usage else 0.0,
        generation_tokens=sums.get("generation", 0.0),
        prompt_tokens=sums.get("prompt", 0.0),
        num_gpu_blocks=blocks,
        prefix_queries=sums.get("prefix_queries", 0.0),
        prefix_hits=sums.get("prefix_hits", 0.0),
        prefills=sums.get("prefill_count", 0.0),
        prefill_seconds=sums.get("prefill_sum", 0.0),
        prefill_computed_tokens=sums.get("computed_sum", 0.0),
    )


def _int_label(labels: dict, name: str) -> int:
    """A label holding a count (0 when it is missing or not a count: "None" where vLLM has no value)."""
    try:
        return max(int(labels.get(name, 0)), 0)
    except ValueError:
        return 0


class MetricsPageError(ValueError):
    """/metrics answered something other than 200."""

    def __init__(self, status: int):
        super().__init__(f"/metrics answered {status}")
        self.status = status


async def scrape_once(session: aiohttp.ClientSession, url: str, timeout: aiohttp.ClientTimeout) -> EngineSnapshot:
    """One instance's /metrics. Raises aiohttp.ClientError, TimeoutError or ValueError (MetricsPageError
    for a status other than 200)."""
    async with session.get(url + "/metrics", timeout=timeout) as resp:
        if resp.status != 200:
            raise MetricsPageError(resp.status)
        return parse_vllm_metrics(await resp.text())


# A problem that lasts is warned about again this often: so it shows in any recent stretch of
# the log someone reads, without flooding it (at the default 0.5 s interval, one line per 1,200 scrapes).
REPEAT_WARNING_S = 600.0
# A page that is missing (404) or not vLLM's does not appear by itself, so such an instance is
# asked this often rather than every interval; a vLLM put behind the same url is still seen soon.
MISSING_PAGE_RETRY_S = 30.0
CONSEQUENCE = "routing it on the gateway's own accounting of what it dispatched (dead reckoning) only"


@dataclass(frozen=True, slots=True)
class ScrapeProblem:
    kind: str  # each distinct kind is reported when it starts ("http 404", "not vllm", "refused", ...)
    what: str  # what was wrong, for the log
    lasting: bool  # the page is missing or not vLLM's: asking every interval would only waste requests


def diagnose(error: Exception, url: str, timeout_s: float) -> ScrapeProblem:
    """What a failed scrape of `url` means, in words an operator can act on."""
    page = f"{url}/metrics"
    if isinstance(error, MetricsPageError):
        if error.status == 404:
            return ScrapeProblem("http 404", f"{page} answered 404: the server has no metrics page "
                                 "(llama.cpp's server and many OpenAI-compatible servers have none)", True)
        return ScrapeProblem(f"http {error.status}", f"{page} answered HTTP {error.status}", False)
    if isinstance(error, TimeoutError):  # before ClientError: aiohttp's ServerTimeoutError is both
        return ScrapeProblem("timeout", f"{page} did not answer within {timeout_s:g} s", False)
    if isinstance(error, aiohttp.ClientConnectorError):
        if isinstance(error.os_error, ConnectionRefusedError):
            return ScrapeProblem("refused", f"{url} refused the connection (is the server up?)", False)
        return ScrapeProblem("cannot connect", f"cannot connect to {url}: {error.os_error}", False)
    if isinstance(error, aiohttp.ClientError):
        return ScrapeProblem("connection", f"{page} failed: {error.__class__.__name__}: {error}", False)
    return ScrapeProblem("not vllm", f"{page}: {error}", True)  # parse_vllm_metrics says what it missed


@dataclass(slots=True)
class _Trouble:
    kind: str
    since: float  # when scraping the instance first failed
    warned_at: float
    retry_at: float = 0.0


class ScrapeLog:
    """Reports scrape failures per instance without flooding the log, and spaces out the scrapes
    of a page that is missing. Time is passed in; instances are keyed by (name, url), so an
    instance moved to another url starts afresh."""

    def __init__(self, consequence: str = CONSEQUENCE) -> None:
        self.consequence = consequence  # what the missing readings mean, said with each warning
        self._troubles: dict[tuple[str, str], _Trouble] = {}

    def due(self, inst, now: float) -> bool:
        trouble = self._troubles.get((inst.name, inst.url))
        return trouble is None or now >= trouble.retry_at

    def failed(self, inst, problem: ScrapeProblem, now: float) -> None:
        key = (inst.name, inst.url)
        trouble = self._troubles.get(key)
        if trouble is None or trouble.kind != problem.kind:
            log.warning("instance %s: %s; %s (repeated every %.0f min while it lasts)", inst.name, problem.what,
                        self.consequence, REPEAT_WARNING_S / 60)
            trouble = self._troubles[key] = _Trouble(problem.kind, trouble.since if trouble else now, now)
        elif now - trouble.warned_at >= REPEAT_WARNING_S:
            log.warning("instance %s: still no metrics after %.0f min: %s; %s", inst.name,
                        (now - trouble.since) / 60, problem.what, self.consequence)
            trouble.warned_at = now
        trouble.retry_at = now + MISSING_PAGE_RETRY_S if problem.lasting else now

    def succeeded(self, inst, now: float) -> None:
        trouble = self._troubles.pop((inst.name, inst.url), None)
        if trouble is not None:
            log.info("instance %s: /metrics readable again (after %.1f s of %s); routing it on its reported load "
                     "again", inst.name, now - trouble.since, trouble.kind)

    def keep_only(self, instances) -> None:
        """Forget instances a reload removed."""
        current = {(i.name, i.url) for i in instances}
        for key in self._troubles.keys() - current:
            del self._troubles[key]


async def scrape_forever(session: aiohttp.ClientSession, store, pool_state: PoolState) -> None:
    """Scrape every instance of the current config each interval, concurrently, into the `pool_state`.

    A failed scrape leaves the last reading to go stale (the scheduler then
    relies on its own accounting of what it dispatched); an instance that refuses connections
    cools down (gateway/core/pool_state.py, InstanceHealth), as after a refused dispatch.
    """
    loop = asyncio.get_running_loop()
    scrape_log = ScrapeLog()

    async def one(inst, timeout) -> None:
        try:
            snap = await scrape_once(session, inst.url, timeout)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:
            if isinstance(e, aiohttp.ClientConnectorError):  # refused: it is down
                pool_state.unreachable(inst.name, loop.time(), store.current.health)
            scrape_log.failed(inst, diagnose(e, inst.url, timeout.total), loop.time())
            return
        scrape_log.succeeded(inst, loop.time())
        pool_state.of(inst.name).scraped(snap, loop.time())

    while True:
        cfg = store.current
        timeout = aiohttp.ClientTimeout(total=cfg.telemetry.scrape_timeout_s)
        started = loop.time()
        scrape_log.keep_only(cfg.instances)
        await asyncio.gather(*(one(inst, timeout) for inst in cfg.instances if scrape_log.due(inst, started)))
        await asyncio.sleep(max(0.0, cfg.telemetry.scrape_interval_s - (loop.time() - started)))
