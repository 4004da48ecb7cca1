"""The gateway's residual under load: how long a request spends in the gateway before it is dispatched.

    routebalance up &
    python loadtest/residual.py --rate 30 --seconds 60       # writes loadtest/results/residual.{json,png}
    python loadtest/residual.py --rate 30 --arrivals azure   # the Azure trace's gaps: residual_azure.{json,png}

Sends held-out prompts (non-streamed, max_tokens 16) at the simulator's arrival times (arrivals.py, Poisson
unless --arrivals) from one asyncio process (loopback only, bounded by --seconds and by 10,000 requests),
then reads the scheduler's histograms from /metrics, the difference over the run: per request, the wait for
its batch to fire and arrival to decision; per batch, the estimate (embedding + KNN) and the decision
(scoring + assignment). Quantiles are the upper bound of the histogram bucket that holds them. Run it
against a fresh gateway on a quiet machine: the gateway shares the cores with the emulated pool and this
generator. The Azure trace (--arrivals azure) is CC-BY 4.0: P. Patel et al., "Splitwise", ISCA 2024.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

import httpx
import numpy as np
from decisions import histogram  # loadtest/, this script's directory
from progressive_compare import held_out, require_loopback
from prometheus_client.parser import text_string_to_metric_families

from gateway.lab.sim.arrivals import KINDS, ArrivalSpec, arrival_times

STAGES = (("routebalance_batch_wait_seconds", "wait for the batch", "request"),
          ("routebalance_estimate_seconds", "estimate (embed + KNN)", "batch"),
          ("routebalance_score_seconds", "decide (score + assign)", "batch"),
          ("routebalance_decision_seconds", "arrival to decision", "request"))
TARGETS_MS = {"p50": 30.0, "p99": 100.0}
MAX_REQUESTS = 10_000


def result_name(arrivals: str) -> str:
    """The results' file name (without extension) for an arrival process: other processes' beside Poisson's."""
    return "residual" if arrivals == "poisson" else f"residual_{arrivals}"


def histograms(text: str) -> dict[str, tuple[float, float, dict[float, float]]]:
    """name -> (count, sum, {upper bound: cumulative count}), summed over label sets."""
    wanted = {name for name, _, _ in STAGES}
    out = {}
    for fam in text_string_to_metric_families(text):
        if fam.name in wanted:
            count, total, buckets = histogram(fam)
            out[fam.name] = (count, total, dict(buckets))
    return out


def summary(before, after) -> dict[str, dict]:
    """Each stage over the run: observations, mean and the p50 / p99 bucket bounds, in ms."""
    rows = {}
    for name, label, per in STAGES:
        c0, s0, b0 = before.get(name, (0.0, 0.0, {}))
        c1, s1, b1 = after[name]
        count = c1 - c0
        cumulative = sorted((le, b1[le] - b0.get(le, 0.0)) for le in b1)
        rows[name] = {"stage": label, "per": per, "count": count, "mean_ms": 1000 * (s1 - s0) / max(count, 1),
                      "p50_ms": _bound(cumulative, count, 0.5), "p99_ms": _bound(cumulative, count, 0.99)}
    return rows


def _bound(cumulative: list[tuple[float, float]], count: float, q: float) -> float:
    """The upper bound (ms) of the bucket holding the q-quantile."""
    return next((1000 * le for le, cum in cumulative if cum >= q * count), float("inf"))


async def load(url: str, times: np.ndarray, key: str) -> tuple[int, int]:
    """Prompt k at `times[k]` seconds from the start (on a schedule: a late send does not delay the next)."""
    prompts = held_out()
    ok = failed = 0

    async def one(c: httpx.AsyncClient, prompt: str) -> None:
        nonlocal ok, failed
        try:
            r = await c.post("/chat/completions", json={"model": "auto", "max_tokens": 16,
                                                         "messages": [{"role": "user", "content": prompt}]})
            ok, failed = (ok + 1, failed) if r.status_code == 200 else (ok, failed + 1)
        except httpx.HTTPError:
            failed += 1

    async with httpx.AsyncClient(base_url=url + "/v1", timeout=60, headers={"Authorization": f"Bearer {key}"},
                                 limits=httpx.Limits(max_connections=256)) as c:
        tasks, start = [], time.perf_counter()
        for k, at in enumerate(times):
            await asyncio.sleep(start + at - time.perf_counter())
            tasks.append(asyncio.create_task(one(c, prompts[k % len(prompts)])))
        await asyncio.gather(*tasks)
    return ok, failed


def plot(rows: dict[str, dict], title: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    names = [name for name, _, _ in STAGES]
    xs = range(len(names))
    for offset, figure, colour in ((-0.27, "mean_ms", "tab:blue"), (0.0, "p50_ms", "tab:green"),
                                   (0.27, "p99_ms", "tab:red")):
        ax.bar([x + offset for x in xs], [rows[n][figure] for n in names], width=0.27, color=colour,
               label=figure.replace("_ms", "") + (" (bucket bound)" if figure != "mean_ms" else ""))
    for q, target in TARGETS_MS.items():
        ax.axhline(target, ls="--", lw=1, c="k")
        ax.text(len(names) - 0.5, target, f"target {q} {target:g} ms", va="bottom", ha="right", fontsize=8)
    ax.set_xticks(list(xs), [f"{rows[n]['stage']}\n(per {rows[n]['per']})" for n in names], fontsize=8)
    ax.set(ylabel="ms", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--arrivals", default="poisson", choices=KINDS,
                    help="the arrival process at mean --rate (azure: the Azure LLM inference trace's gaps)")
    ap.add_argument("--seed", type=int, default=0, help="the arrival seed (azure: where in the trace to start)")
    ap.add_argument("--key", default="unused")
    ap.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = ap.parse_args()
    require_loopback(args.url)
    if not (0 < args.rate <= 200 and 0 < args.seconds <= 900):
        raise SystemExit("--rate in (0, 200], --seconds in (0, 900]")
    arrivals = ArrivalSpec(args.arrivals, args.rate)
    times = arrival_times(arrivals, MAX_REQUESTS, args.seed)
    before = histograms(httpx.get(args.url + "/metrics", timeout=5).text)
    ok, failed = asyncio.run(load(args.url, times[times < args.seconds], args.key))
    rows = summary(before, histograms(httpx.get(args.url + "/metrics", timeout=5).text))
    title = (f"Residual at {args.rate:g} req/s ({arrivals.label()} arrivals) for {args.seconds:g} s: {ok} served, "
             f"{failed} failed")
    print(title)
    for r in rows.values():
        print(f"  {r['stage']:<26} per {r['per']:<7} mean {r['mean_ms']:7.2f} ms   p50 <= {r['p50_ms']:g} ms   "
              f"p99 <= {r['p99_ms']:g} ms   ({r['count']:.0f})")
    args.out.mkdir(parents=True, exist_ok=True)
    name = result_name(args.arrivals)
    (args.out / f"{name}.json").write_text(json.dumps({"rate": args.rate, "seconds": args.seconds,
                                                       "arrivals": arrivals.label(), "seed": args.seed, "served": ok,
                                                       "failed": failed, "stages": list(rows.values())}, indent=1))
    try:
        print("wrote", plot(rows, title, args.out / f"{name}.png"))
    except ImportError:
        print("no plot: pip install '.[eval]' for matplotlib")


if __name__ == "__main__":
    main()
