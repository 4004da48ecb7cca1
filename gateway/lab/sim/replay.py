"""Replay a cell's prompts against a live gateway on loopback, as Outcome records.

The live check (loadtest/live_check.py) and the tests drive a real stack with
this client: each prompt is sent at its arrival time, streamed with usage, and
recorded in the shape the simulator's outcomes have, so one summary covers both.
"""

from __future__ import annotations

import asyncio
import math
import time

import httpx
import orjson

from gateway.lab.sim.simulator import DEFAULT_MAX_TOKENS, Outcome

REQUEST_TIMEOUT_S = 180.0


async def one_request(client: httpx.AsyncClient, url: str, prompt: str, preset: str, start: float,
                      at: float, names: dict[str, int], out: Outcome, policy: str | None = None) -> None:
    await asyncio.sleep(max(0.0, start + at - time.monotonic()))
    body = {"model": "auto", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": DEFAULT_MAX_TOKENS, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    out.arrival = sent - start
    headers = {"Content-Type": "application/json", "X-Route-Preset": preset}
    if policy is not None:
        headers["X-Route-Policy"] = policy
    async with client.stream("POST", url, content=orjson.dumps(body), headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"status {resp.status_code}: {(await resp.aread())[:200]!r}")
        out.instance = names[resp.headers["X-Route-Instance"]]
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = orjson.loads(line[6:])
            if event.get("choices") and math.isnan(out.first_token):
                out.first_token = time.monotonic() - start
            usage = event.get("usage")
            if usage:
                out.prompt_tokens, out.completion_tokens = usage["prompt_tokens"], usage["completion_tokens"]
                out.cost_usd = usage.get("cost_usd", 0.0)
    out.finished = time.monotonic() - start


async def replay(base: str, prompts, times, preset: str, names: dict[str, int],
                 policy: str | None = None) -> list[Outcome]:
    """Send prompts[r] at times[r] seconds from now to `base` (the gateway's root URL).

    `names` maps an instance name (the X-Route-Instance header) to its index; `policy`, if given, is asked
    for with X-Route-Policy.
    Raises if any request fails: a live cell with failures is not comparable."""
    outcomes = [Outcome(math.nan) for _ in prompts]
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=REQUEST_TIMEOUT_S, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(one_request(client, base + "/v1/chat/completions", p, preset, start, float(t), names, o,
                                           policy)
                               for p, t, o in zip(prompts, times, outcomes, strict=True)))
    return outcomes
