"""Run one cell live and in the simulator, and compare them.

    python loadtest/live_check.py [--rate 12] [--arrivals poisson] [--requests 600] [--preset uniform] [--config PATH]

Starts `routebalance up` (the emulated pool and the gateway) as a child
process, replays the cell's held-out prompts at the simulator's own arrival
times against it on loopback (every request streamed, with usage), then runs
the same cell in the simulator and prints both with the tolerance each figure
is held to. Exit status 1 if any figure is outside its tolerance. Bounded by
the request count and a deadline.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from ports import wait_ready  # loadtest/, this script's directory

from gateway.config.store import default_config_path, load_config
from gateway.estimators.bundle import Estimators
from gateway.lab.sim.arrivals import KINDS, ArrivalSpec, arrival_times
from gateway.lab.sim.evalset import load_evalset
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.replay import REQUEST_TIMEOUT_S, replay
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.lab.training.build import ensure_built

# How far live may sit from simulated: relative for times, absolute for shares and quality.
TOLERANCE = {"quality": ("abs", 0.01), "e2e_mean": ("rel", 0.15), "e2e_p50": ("rel", 0.15),
             "ttft_mean": ("abs", 0.25), "cost_mean": ("rel", 0.05), "mix": ("abs", 0.05)}

def compare(sim: dict, live: dict) -> tuple[list[str], bool]:
    lines, ok = [f"{'figure':<26} {'simulated':>11} {'live':>11}  tolerance"], True
    for key, (kind, tol) in TOLERANCE.items():
        if key == "mix":
            for model, share in sim["mix"].items():
                other = live["mix"].get(model, 0.0)
                good = abs(other - share) <= tol
                ok &= good
                lines.append(f"{'share ' + model.split('/')[-1]:<26} {share:>11.3f} {other:>11.3f}  ±{tol} "
                             f"{'ok' if good else 'OUT'}")
            continue
        a, b = sim[key], live[key]
        good = abs(b - a) <= (tol * abs(a) if kind == "rel" else tol)
        ok &= good
        shown = f"±{tol:.0%}" if kind == "rel" else f"±{tol}"
        lines.append(f"{key:<26} {a:>11.4g} {b:>11.4g}  {shown} {'ok' if good else 'OUT'}")
    return lines, ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=default_config_path())
    ap.add_argument("--rate", type=float, default=12.0)
    ap.add_argument("--arrivals", default="poisson", choices=KINDS,
                    help="the arrival process at mean --rate (azure: the Azure LLM inference trace's gaps)")
    ap.add_argument("--requests", type=int, default=600)
    ap.add_argument("--preset", default="uniform")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    cfg = load_config(args.config)
    if not ipaddress.ip_address(cfg.server.host).is_loopback or not all(
            ipaddress.ip_address(httpx.URL(i.url).host).is_loopback for i in cfg.instances):
        raise SystemExit("the live check runs on loopback only")
    ensure_built(cfg)
    estimators = Estimators.load(cfg)
    ev = load_evalset(cfg, args.requests, estimators=estimators)
    w = cfg.weights(args.preset)
    spec = CellSpec("routebalance", (w.quality, w.latency, w.cost), ArrivalSpec(args.arrivals, args.rate),
                    args.requests, args.seed)

    base = f"http://{cfg.server.host}:{cfg.server.port}"
    stack = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "up",
                              "--config", str(args.config)], env=os.environ.copy())
    try:
        # /health/ready: `up` answers 503 while it starts, which the replay must not count
        wait_ready([base + "/health/ready", cfg.instances[-1].url + "/health"], 120, stack)
        names = {inst.name: k for k, inst in enumerate(cfg.instances)}
        times = arrival_times(spec.arrivals, args.requests, spec.seed)
        started = time.monotonic()
        outcomes = asyncio.run(asyncio.wait_for(replay(base, ev.prompts, times, args.preset, names),
                                                timeout=float(times[-1]) + 10 * REQUEST_TIMEOUT_S))
        live_s = time.monotonic() - started
    finally:
        stack.send_signal(signal.SIGINT)
        stack.wait(timeout=30)
    for r, o in enumerate(outcomes):  # the judged quality of what each request got: its model's label
        o.dispatched = o.arrival  # not visible from outside; the residual is the simulator's figure only
        o.quality = float(ev.label_score[r, o.instance])
    models = tuple(i.model for i in cfg.instances)
    live = summarise(outcomes, models)
    result = run_cell(cfg, ev, spec, estimators)
    sim = summarise(result.outcomes, result.models)
    lines, ok = compare(sim, live)
    print(f"{args.requests} requests at {args.rate:g} req/s ({spec.arrivals.label()}), preset {args.preset}; "
          f"live run {live_s:.0f} s")
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
