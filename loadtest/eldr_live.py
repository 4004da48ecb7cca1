"""ELDR live on the emulated mixture-of-experts pool: eldr against round robin, request by request.

    python loadtest/eldr_live.py [--rate 16] [--requests 400] [--config gateway/examples/moe.toml]
                                 [--models-dir DIR]

Starts `routebalance up` on the MoE example pool (the emulator serves its
instances' MoE engines, routing each known prompt's tokens to the experts
of its kind and of its kind's hidden subdomain), replays the same held-out prompts at the same Poisson arrival
times twice, once with `X-Route-Policy: eldr` and once with
`passthrough+round_robin` (every request streamed), and prints each run's
decode TPOT (first token to last, over the tokens after the first), E2E and
where the requests went. `--models-dir` runs the stack on a copy of the
estimators (the MoE tier's TPOT head is fitted there on first use, so the
shared models/ manifest is left alone). Loopback only; bounded by the request
count and a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from ports import wait_ready  # loadtest/, this script's directory

from gateway.config.store import load_config
from gateway.lab.sim.arrivals import ArrivalSpec, arrival_times
from gateway.lab.sim.evalset import evaluation_records
from gateway.lab.sim.pools import MOE_EXAMPLE
from gateway.lab.sim.replay import REQUEST_TIMEOUT_S, replay

POLICIES = ("eldr", "passthrough+round_robin")


def figures(outcomes) -> dict:
    done = [o for o in outcomes if o.instance >= 0 and o.completion_tokens > 1]
    tpot = np.array([(o.finished - o.first_token) / (o.completion_tokens - 1) for o in done])
    e2e = np.array([o.finished - o.arrival for o in outcomes if o.instance >= 0])
    ttft = np.array([o.first_token - o.arrival for o in outcomes if o.instance >= 0])
    return {"served": len(e2e), "ttft_mean_s": float(ttft.mean()), "tpot_p50_ms": 1000 * float(np.median(tpot)),
            "tpot_p99_ms": 1000 * float(np.percentile(tpot, 99)), "e2e_mean_s": float(e2e.mean()),
            "per_instance": np.bincount([o.instance for o in outcomes if o.instance >= 0]).tolist()}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=MOE_EXAMPLE)
    ap.add_argument("--rate", type=float, default=16.0)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--models-dir", help="estimators directory to use instead of the config's")
    ap.add_argument("--port", type=int, help="the gateway's port; the instances take the ports after it")
    args = ap.parse_args()
    text = args.config.read_text()  # the example has no [server] or [estimators] table: they may be added
    if args.models_dir:
        text += f'\n[estimators]\nmodels_dir = "{args.models_dir}"\n'
    if args.port:
        ports = iter(range(args.port + 1, args.port + 1000))
        text = re.sub(r'url = "http://127\.0\.0\.1:\d+"', lambda _: f'url = "http://127.0.0.1:{next(ports)}"', text)
        text += f"\n[server]\nport = {args.port}\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "moe.toml"
        path.write_text(text)
        cfg = load_config(path)
        prompts = [r.prompt for r in evaluation_records(cfg, args.requests)]
        times = arrival_times(ArrivalSpec(rate=args.rate), args.requests, args.seed)
        base = f"http://{cfg.server.host}:{cfg.server.port}"
        names = {inst.name: k for k, inst in enumerate(cfg.instances)}
        stack = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "up",
                                  "--config", str(path)], env=os.environ.copy())
        results = {}
        try:
            wait_ready([base + "/health/ready", cfg.instances[-1].url + "/health"], 600, stack)
            for policy in POLICIES:
                started = time.monotonic()
                outcomes = asyncio.run(asyncio.wait_for(
                    replay(base, prompts, times, "uniform", names, policy=policy),
                    timeout=float(times[-1]) + 10 * REQUEST_TIMEOUT_S))
                results[policy] = figures(outcomes) | {"wall_s": time.monotonic() - started}
                time.sleep(2.0)  # the pool drains between the runs
        finally:
            stack.send_signal(signal.SIGINT)
            stack.wait(timeout=30)
    print(f"{args.requests} held-out prompts at {args.rate:g} req/s (Poisson, seed {args.seed}) on {args.config}")
    for policy, r in results.items():
        print(f"{policy:<26} TPOT p50 {r['tpot_p50_ms']:6.2f} ms  p99 {r['tpot_p99_ms']:6.2f} ms  "
              f"E2E mean {r['e2e_mean_s']:5.2f} s  TTFT mean {r['ttft_mean_s']:5.3f} s  served {r['served']}  "
              f"per instance {r['per_instance']}  "
              f"({r['wall_s']:.0f} s)")
    a, b = (results[p]["tpot_p50_ms"] for p in POLICIES)
    print(f"median TPOT, eldr against round robin: {a / b - 1:+.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
