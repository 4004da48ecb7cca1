"""Progressive mode against the large model answering whole, on held-out prompts, one request at a time.

    routebalance up &                       # the emulated pool (any policy: neither arm is routed by it)
    python loadtest/progressive_compare.py --url http://127.0.0.1:8000 --requests 20

Normal arm: the 72B model named directly (what the sketch model would have answered alone). Progressive arm:
`routing.mode = "progressive"` on "auto". Prints per-arm latency (mean, p50, p95), tokens and cost, how many
progressive requests fell back to normal routing, and how often the fallback rule fires over the whole
held-out set (the rule alone, no length estimate, as the gateway applies it).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import httpx

from gateway.config import default_config_path, load_config
from gateway.scheduling.progressive import fallback_reason
from gateway.sim.evalset import EVAL_PROMPTS
from gateway.workload.synthetic import generate

LARGE = "Qwen/Qwen2.5-72B-Instruct"


def held_out() -> list[str]:
    est = load_config(default_config_path()).estimators
    return [r.prompt for r in generate(est.train_records + EVAL_PROMPTS, seed=est.seed)[est.train_records:]]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--requests", type=int, default=20)
    ap.add_argument("--key", default="unused")
    args = ap.parse_args()
    prompts = held_out()
    reasons = collections.Counter(str(fallback_reason(p, None) or "progressive") for p in prompts)
    print(f"fallback rule over {len(prompts)} held-out prompts: {dict(reasons.most_common())}")
    chosen = prompts[:args.requests]
    headers = {"Authorization": f"Bearer {args.key}"}
    with httpx.Client(base_url=args.url + "/v1", headers=headers, timeout=120) as c:
        arms: dict[str, list[tuple[float, int, float]]] = {"normal-72B": [], "progressive": []}
        fell_back = 0
        for p in chosen:
            for arm in arms:
                body = {"model": LARGE if arm == "normal-72B" else "auto",
                        "messages": [{"role": "user", "content": p}]}
                if arm == "progressive":
                    body["routing"] = {"mode": "progressive"}
                t = time.perf_counter()
                r = c.post("/chat/completions", json=body)
                dt = time.perf_counter() - t
                r.raise_for_status()
                u = r.json()["usage"]
                arms[arm].append((dt, u["total_tokens"], u.get("cost_usd", 0.0)))
                if arm == "progressive" and r.headers.get("X-Route-Mode") != "progressive":
                    fell_back += 1
    for arm, rows in arms.items():
        lat = sorted(x[0] for x in rows)
        print(f"{arm:12s} n={len(rows)} latency mean {statistics.mean(lat):.2f}s p50 {lat[len(lat) // 2]:.2f}s "
              f"p95 {lat[min(len(lat) - 1, int(0.95 * len(lat)))]:.2f}s  tokens/request "
              f"{statistics.mean(x[1] for x in rows):.0f}  cost/request {statistics.mean(x[2] for x in rows):.7f} USD")
    print(f"progressive requests that fell back to normal routing: {fell_back}/{len(chosen)}")


if __name__ == "__main__":
    main()
