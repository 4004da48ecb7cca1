"""Progressive mode against the 72B answering whole, live on the emulated pool, under load.

    routebalance up &          # the emulated pool behind the gateway
    python loadtest/progressive_compare.py --url http://127.0.0.1:8000 --rate 1 --requests 60 --rounds 2

Both arms name the 72B, so they hold the same quality estimate: the normal arm is the 72B answering whole
(PICE's cloud-only), the progressive arm asks `routing.mode = "progressive"`, and what the fallback rule
sends back is that same 72B answer. Arms alternate (A B A B ...), each round the same held-out prompts at
the same Poisson arrival times (seeded), never more than --concurrency in flight, every request bounded by
--timeout. Per arm: served requests over the span (first send to last answer), latency (mean, p50, p95),
tokens and cost per request, and the share that went progressive (the rest: the fallback rule's reasons,
from X-Route-Fallback). Then the fallback rule over the whole held-out set without a length estimate.
Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import random
import statistics
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from gateway.config.store import default_config_path, load_config
from gateway.core.progressive import fallback_reason
from gateway.lab.sim.evalset import EVAL_PROMPTS, evaluation_records

LARGE = "Qwen/Qwen2.5-72B-Instruct"
ARMS = ("normal-72B", "progressive")


def held_out() -> list[str]:
    return [r.prompt for r in evaluation_records(load_config(default_config_path()), EVAL_PROMPTS)]


def require_loopback(url: str) -> None:
    """Exit unless `url` is on this machine: load tests target loopback addresses only."""
    if urlsplit(url).hostname not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("load tests target loopback addresses only")


@dataclass
class Arm:
    latency: list[float] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    cost: list[float] = field(default_factory=list)
    modes: collections.Counter = field(default_factory=collections.Counter)
    spans: list[float] = field(default_factory=list)
    errors: int = 0


async def one_round(c: httpx.AsyncClient, arm: str, prompts: list[str], gaps: list[float], concurrency: int,
                    into: Arm) -> None:
    gate = asyncio.Semaphore(concurrency)
    ends: list[float] = []

    async def send(prompt: str) -> None:
        body = {"model": LARGE, "messages": [{"role": "user", "content": prompt}]}
        if arm == "progressive":
            body["routing"] = {"mode": "progressive"}
        async with gate:
            t = time.perf_counter()
            try:
                r = await c.post("/chat/completions", json=body)
                r.raise_for_status()
            except httpx.HTTPError:
                into.errors += 1
                return
            ends.append(time.perf_counter())
            into.latency.append(ends[-1] - t)
        u = r.json()["usage"]
        into.tokens.append(u["total_tokens"])
        into.cost.append(u.get("cost_usd", 0.0))
        into.modes[r.headers.get("X-Route-Fallback") or r.headers.get("X-Route-Mode", "?")] += 1

    start = time.perf_counter()
    tasks = []
    for prompt, gap in zip(prompts, gaps, strict=True):
        await asyncio.sleep(gap)
        tasks.append(asyncio.create_task(send(prompt)))
    await asyncio.gather(*tasks)
    if ends:
        into.spans.append((max(ends) - start, len(ends)))


async def run(args) -> dict[str, Arm]:
    prompts = held_out()[:args.requests]
    rng = random.Random(args.seed)
    gaps = [0.0] + [rng.expovariate(args.rate) for _ in prompts[1:]]
    arms = {a: Arm() for a in ARMS}
    headers = {"Authorization": f"Bearer {args.key}"}
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url + "/v1", headers=headers, timeout=args.timeout,
                                 limits=limits) as c:
        for k in range(args.rounds):
            for arm in ARMS:
                t = time.perf_counter()
                await one_round(c, arm, prompts, gaps, args.concurrency, arms[arm])
                print(f"  round {k + 1} {arm}: {time.perf_counter() - t:.1f} s", flush=True)
    return arms


def report(arms: dict[str, Arm], args) -> None:
    print(f"{args.requests} held-out prompts x {args.rounds} rounds per arm at {args.rate:g} req/s (Poisson), "
          f"both naming {LARGE}:")
    for name, a in arms.items():
        lat = sorted(a.latency)
        served = sum(n for _, n in a.spans)
        thru = served / sum(s for s, _ in a.spans) if a.spans else 0.0
        share = a.modes.get("progressive", 0) / max(len(lat), 1)
        print(f"{name:12s} served {served} ({a.errors} errors), {thru:.2f} req/s; latency mean "
              f"{statistics.mean(lat):.2f} s, p50 {lat[len(lat) // 2]:.2f} s, p95 "
              f"{lat[min(len(lat) - 1, int(0.95 * len(lat)))]:.2f} s; tokens/request {statistics.mean(a.tokens):.0f}, "
              f"cost/request {statistics.mean(a.cost) * 1e6:.1f} micro-USD; progressive {share:.0%}"
              + (f" (routed whole: {dict(a.modes - collections.Counter(progressive=a.modes['progressive']))})"
                 if name == "progressive" else ""))
    prompts = held_out()
    reasons = collections.Counter(str(fallback_reason(p, None) or "progressive") for p in prompts)
    print(f"the fallback rule without a length estimate, over {len(prompts)} held-out prompts: "
          f"{dict(reasons.most_common())}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=60, help="held-out prompts per round (bounds the run)")
    ap.add_argument("--rounds", type=int, default=2, help="rounds per arm, alternating")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals per second")
    ap.add_argument("--concurrency", type=int, default=64, help="most requests in flight")
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per request")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--key", default="unused")
    args = ap.parse_args()
    require_loopback(args.url)
    if not (1 <= args.requests <= 3534 and 1 <= args.rounds <= 10 and 0 < args.rate <= 50):
        raise SystemExit("--requests 1..3534, --rounds 1..10, --rate in (0, 50]")
    report(asyncio.run(run(args)), args)


if __name__ == "__main__":
    main()
