"""`routebalance profile`: a tier-local rate sweep against a live OpenAI-compatible instance.

Sends Poisson streams of completions at each rate, with answer lengths fixed
by max_tokens + ignore_eos (a vLLM extension the emulator honours), scrapes
the instance's /metrics on its own clock, and records for every request the
features the gateway would have seen at dispatch and the TPOT it then got.
Every load loop is bounded in requests and time; every call has a timeout.
"""

from __future__ import annotations

import asyncio
import logging
import random
from types import SimpleNamespace

import aiohttp
import orjson

from gateway.core.pool_state import InstanceState
from gateway.core.view import tier_key
from gateway.estimators.latency import FEATURES
from gateway.lab.training.traces import trace_row
from gateway.serving.telemetry import ScrapeLog, diagnose, scrape_once

log = logging.getLogger("routebalance.profile")
# Said when the profiled instance has no usable /metrics: the features of its traces then come from
# the profiler's own accounting alone, as the gateway's view of such an instance does.
WITHOUT_METRICS = "the traces carry only the profiler's own accounting of what it sent (dead reckoning)"
FILLER = "please summarise the following notes about the project plan and its risks "


def prompt_of(tokens: int, rid: int) -> str:
    """A prompt of about `tokens` tokens (about four characters a token), opening with its request id: no two
    share a prefix, so an instance that caches prefixes computes each one whole, as the traces count it."""
    text = f"{rid}: " + FILLER * (tokens * 4 // len(FILLER) + 1)
    return text[: max(4, tokens * 4)]


async def _scrape_forever(session, url: str, view: InstanceState, interval_s: float, timeout: aiohttp.ClientTimeout):
    """The instance's /metrics into `view` on its own clock, as the gateway scrapes (stale features when a
    scrape fails); a page that is missing or not vLLM's is said once, not every interval."""
    loop = asyncio.get_running_loop()
    scrape_log = ScrapeLog(consequence=WITHOUT_METRICS)
    target = SimpleNamespace(name=url, url=url)
    while True:
        if scrape_log.due(target, loop.time()):
            try:
                snap = await scrape_once(session, url, timeout)
            except (TimeoutError, aiohttp.ClientError, ValueError) as e:
                scrape_log.failed(target, diagnose(e, url, timeout.total), loop.time())
            else:
                scrape_log.succeeded(target, loop.time())
                view.scraped(snap, loop.time())
        await asyncio.sleep(interval_s)


async def _one_request(session, url: str, model: str, rid: int, prompt_tokens: int, output_tokens: int,
                       view: InstanceState, timeout: aiohttp.ClientTimeout, rate: float, tier: str) -> dict | None:
    loop = asyncio.get_running_loop()
    feats = view.features(prompt_tokens, output_tokens)
    view.dispatched(rid, prompt_tokens, output_tokens)
    body = {"model": model, "prompt": prompt_of(prompt_tokens, rid), "max_tokens": output_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    start = loop.time()
    first = last = None
    events = 0
    usage = None
    try:
        async with session.post(url + "/v1/completions", data=orjson.dumps(body), timeout=timeout,
                                headers={"Content-Type": "application/json"}) as resp:
            if resp.status != 200:
                log.warning("request %d: status %d", rid, resp.status)
                return None
            async for line in resp.content:
                if not line.startswith(b"data: {"):
                    continue
                data = orjson.loads(line[6:])
                if data.get("usage"):
                    usage = data["usage"]
                if data.get("choices") and data["choices"][0].get("text"):
                    last = loop.time()
                    first = first or last
                    events += 1
                    view.streamed(rid, events)
    except (TimeoutError, aiohttp.ClientError, orjson.JSONDecodeError) as e:
        log.warning("request %d failed: %s", rid, e)
        return None
    finally:
        view.done(rid)
    n = (usage or {}).get("completion_tokens", events)
    if first is None or n < 2:
        return None
    feats[FEATURES.index("prompt_tokens")] = (usage or {}).get("prompt_tokens", prompt_tokens)
    return trace_row(tier, rate, feats, arrival=start, first_token=first, finish=last, tokens=n)


async def live_sweep(url: str, model: str, gpu: str, lengths: list[tuple[int, int]], *, rates: list[float],
                     requests_per_rate: int = 200, scrape_interval_s: float = 0.5, request_timeout_s: float = 300.0,
                     max_concurrency: int = 512, seed: int = 0) -> list[dict]:
    """Sweep one instance at each rate (req/s); returns trace rows (see traces.py)."""
    rng = random.Random(seed)
    tier = tier_key(model, gpu)
    view = InstanceState()
    timeout = aiohttp.ClientTimeout(total=request_timeout_s, sock_connect=5)
    scrape_timeout = aiohttp.ClientTimeout(total=max(1.0, scrape_interval_s * 2))
    slots = asyncio.Semaphore(max_concurrency)
    rows: list[dict] = []
    async with aiohttp.ClientSession() as session:
        scraper = asyncio.create_task(_scrape_forever(session, url, view, scrape_interval_s, scrape_timeout))
        try:
            rid = 0
            for rate in rates:
                log.info("profiling %s at %.2f req/s (%d requests)", tier, rate, requests_per_rate)
                tasks = []

                async def run(*args):
                    async with slots:
                        row = await _one_request(session, url, model, *args)
                    if row:
                        rows.append(row)

                for _ in range(requests_per_rate):
                    await asyncio.sleep(rng.expovariate(rate))
                    prompt_tokens, output_tokens = lengths[rid % len(lengths)]
                    tasks.append(asyncio.create_task(run(rid, prompt_tokens, output_tokens, view, timeout, rate, tier)))
                    rid += 1
                await asyncio.gather(*tasks)
        finally:
            scraper.cancel()
    return rows
