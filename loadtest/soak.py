"""Soak: a long steady load, watching the gateway process's memory and file descriptors.

    .venv/bin/python loadtest/soak.py [--minutes 10] [--rate 30] [--config PATH] [--policy NAME]

Starts `routebalance up` as a child on free loopback ports with a temporary copy
of the config (as loadtest/chaos.py does; default policy passthrough+round_robin,
which needs no estimators), and, once its /health/ready answers 200 (the
start-up's 503s are not counted), sends open-loop Poisson arrivals at --rate of
the held-out synthetic prompts (the ones the simulator and the load tests
replay; the emulator answers them at their labelled lengths): chat requests to
`auto`, half of them streamed with usage. Every --sample-every seconds it reads
the process's RSS (/proc/<pid>/status VmRSS) and open file descriptors
(/proc/<pid>/fd). `routebalance up` runs the emulated pool and the gateway in
ONE process, so the figures are the two together.

Prints each sample as it is taken, then start/end/max RSS and fds, the request
counts (succeeded, failed properly, lost: as loadtest/chaos.py classifies them)
and the RSS growth from the first sample after --warmup seconds to the last
sample under load. Exit status 1 if that growth exceeds --max-growth percent or
any request was lost. Loopback only; bounded by time, request count and
concurrency; the child is stopped on exit, Ctrl-C and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time

import httpx
from chaos import (
    FAILED,
    LOST,
    OK,
    SLOW,
    Stack,
    Tally,
    add_stack_arguments,
    close_workdir,
    format_table,
    good_request,
    held_out_prompts,
    open_stack,
    print_outcomes,
    proc_sample,
    report_stack,
    run_script,
    scrape_metrics,
    spawn,
)

KINDS = ("chat", "chat stream")


async def soak(args, stack: Stack, prompts: list[str]) -> tuple[Tally, list[dict], dict]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    duration = args.minutes * 60
    end = t0 + duration
    rng = random.Random(args.seed)
    tally = Tally()
    tasks: set[asyncio.Task] = set()
    samples: list[dict] = []

    def sample(phase: str) -> dict:
        s = {"t": loop.time() - t0, "phase": phase, **proc_sample(stack.pid), "in_flight": len(tasks),
             "sent": len(tally.outcomes) + len(tasks),
             "lost": sum(o.result == LOST for o in tally.outcomes)}
        samples.append(s)
        print(f"  t={s['t']:6.0f} s  RSS {s['rss_mb']:7.1f} MB  fds {s['fds']:4d}  threads {s['threads']:3d}  "
              f"in flight {s['in_flight']:4d}  requests {s['sent']:6d}  lost {s['lost']}  ({phase})", flush=True)
        return s

    limits = httpx.Limits(max_connections=args.concurrency + 16, max_keepalive_connections=128)
    async with httpx.AsyncClient(base_url=stack.root, timeout=args.timeout, limits=limits, trust_env=False) as client:

        async def traffic() -> None:
            sem = asyncio.Semaphore(args.concurrency)
            next_at = t0
            for k in range(int(args.rate * duration * 1.2) + 100):  # bounded count
                next_at += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                if loop.time() >= end:
                    return
                kind, prompt = KINDS[k % 2], prompts[k % len(prompts)]
                await spawn(tasks, sem, kind, lambda kind=kind, prompt=prompt:  # noqa: B023
                            good_request(client, kind, "auto", prompt, args.timeout, t0, args.max_tokens,
                                         args.deadline), tally)

        async def sampler() -> None:
            for k in range(int(duration / args.sample_every) + 2):
                sample("warm-up" if k * args.sample_every < args.warmup else "load")
                next_at = t0 + (k + 1) * args.sample_every
                if next_at > end:
                    return
                await asyncio.sleep(max(0.0, next_at - loop.time()))

        driver = loop.create_task(traffic())
        watcher = loop.create_task(sampler())
        try:
            await asyncio.gather(driver, watcher)
            if tasks:  # every request has its own deadline; this is a backstop
                await asyncio.wait(set(tasks), timeout=args.deadline + 10)
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.wait(set(tasks), timeout=5)
        finally:
            driver.cancel()
            watcher.cancel()
        await asyncio.sleep(2.0)
        drained = sample("after drain")
    return tally, samples, drained


def main() -> int:
    from gateway.lab.sim.evalset import EVAL_PROMPTS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="minutes of load")
    ap.add_argument("--rate", type=float, default=30.0, help="requests per second (Poisson, open loop)")
    add_stack_arguments(ap, concurrency=512)
    ap.add_argument("--sample-every", type=float, default=10.0, help="seconds between two RSS/fd samples")
    ap.add_argument("--warmup", type=float, default=60.0, help="growth is measured from the first sample after this")
    ap.add_argument("--max-growth", type=float, default=10.0, help="exit 1 if RSS grows more than this, percent")
    args = ap.parse_args()
    if not (0.5 <= args.minutes <= 240 and 0 < args.rate <= 500 and args.warmup < args.minutes * 60):
        ap.error("--minutes must be in 0.5..240, --rate in (0, 500], --warmup shorter than the run")

    workdir, config, data, stack = open_stack(args, "soak")
    print(f"gateway {stack.root}, {len(data['instances'])} emulated instances, policy {args.policy}; "
          f"{args.minutes:g} min at {args.rate:g} req/s (chat, `auto`, half streamed); every request times out after "
          f"{args.timeout:g} s. RSS and fds are of the ONE process `routebalance up` runs: gateway AND emulator.",
          flush=True)
    try:
        prompts = held_out_prompts(config, EVAL_PROMPTS)
        took = stack.start(ready_timeout_s=600)
        print(f"stack ready in {took:.1f} s (pid {stack.pid}); samples every {args.sample_every:g} s:", flush=True)
        started = time.monotonic()
        tally, samples, drained = asyncio.run(asyncio.wait_for(
            soak(args, stack, prompts), timeout=args.minutes * 60 + 2 * args.deadline + 60))
        wall = time.monotonic() - started
        metrics = scrape_metrics(stack.root)
    except BaseException:
        print(f"kept {workdir} (config.toml, stack.log)", file=sys.stderr)
        raise
    finally:
        code = stack.stop()

    loaded = [s for s in samples if s["phase"] != "after drain"]
    first, last = loaded[0], loaded[-1]
    warm = next((s for s in loaded if s["phase"] == "load"), last)
    growth = 100 * (last["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"]
    after = [s for s in loaded if s["t"] >= warm["t"]]
    slope = 0.0
    if len(after) >= 3:  # least-squares trend of RSS after warm-up, MB per 10 minutes
        mt = sum(s["t"] for s in after) / len(after)
        mr = sum(s["rss_mb"] for s in after) / len(after)
        var = sum((s["t"] - mt) ** 2 for s in after)
        slope = 600 * sum((s["t"] - mt) * (s["rss_mb"] - mr) for s in after) / var if var else 0.0
    print(f"\nran {wall:.0f} s; stack exit status {code}")
    print(format_table(tally.rows(KINDS)))
    outcomes = tally.outcomes
    n_ok = sum(o.result == OK for o in outcomes)
    n_failed = sum(o.result == FAILED for o in outcomes)
    n_lost = sum(o.result == LOST for o in outcomes)
    n_slow = sum(o.result == SLOW for o in outcomes)
    elapsed = sorted(o.elapsed_s for o in outcomes if o.result == OK)
    p = (lambda q: elapsed[min(len(elapsed) - 1, int(q * len(elapsed)))]) if elapsed else (lambda q: 0.0)
    print(f"\nrequests: {len(outcomes)} sent ({len(outcomes) / (args.minutes * 60):.1f} req/s), {n_ok} succeeded "
          f"({n_ok / max(len(outcomes), 1):.2%}), {n_failed} failed properly, {n_slow} slow, {n_lost} lost; "
          f"E2E of the successes p50 {p(0.5):.2f} s, p99 {p(0.99):.2f} s")
    print(f"process (gateway + emulator, one process, pid {stack.pid}):")
    print(f"  {'':<22} {'RSS MB':>8} {'fds':>5} {'threads':>8}")
    for label, s in ((f"start (t={first['t']:.0f} s)", first), (f"after warm-up (t={warm['t']:.0f} s)", warm),
                     (f"end (t={last['t']:.0f} s)", last), ("after drain", drained)):
        print(f"  {label:<22} {s['rss_mb']:>8.1f} {s['fds']:>5} {s['threads']:>8}")
    print(f"  {'max':<22} {max(s['rss_mb'] for s in samples):>8.1f} {max(s['fds'] for s in samples):>5} "
          f"{max(s['threads'] for s in samples):>8}")
    print(f"  RSS growth from after warm-up to end: {growth:+.1f}% (limit {args.max_growth:g}%); "
          f"trend after warm-up {slope:+.1f} MB per 10 min; peak RSS (VmHWM) {drained['hwm_mb']:.1f} MB")
    tracebacks = report_stack(stack, metrics)
    print_outcomes("LOST", [o for o in outcomes if o.result == LOST], 12)
    print_outcomes("SLOW (bytes still coming: reported, not lost)", [o for o in outcomes if o.result == SLOW], 12)
    failed = growth > args.max_growth or n_lost > 0
    close_workdir(workdir, failed or args.keep or tracebacks > 0)
    print(f"\n{'FAIL' if failed else 'PASS'}: RSS growth {growth:+.1f}% (limit {args.max_growth:g}%), "
          f"fds {warm['fds']} -> {last['fds']} under load ({drained['fds']} after drain), {n_lost} lost")
    return 1 if failed else 0


if __name__ == "__main__":
    run_script(main)
