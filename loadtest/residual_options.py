"""The residual at 30 req/s under each embedder setting: which lever moves it, measured side by side in one run.

    python loadtest/residual_options.py                          # every option, 60 s each
    python loadtest/residual_options.py --options fp32,int8 --seconds 30
    python loadtest/residual_options.py --options fp32 --arrivals poisson,azure --seeds 3 \
        --out loadtest/results/residual_arrivals.json            # the default on both arrival processes, 3 runs each

Starts `routebalance emulate` (the built-in pool) once, then for each option `routebalance serve` with the
built-in config and that option's `[estimators]` (fp32 at 256 tokens with 2 onnxruntime threads, the
default; 1 thread; int8; 128 tokens), runs loadtest/residual.py against it (held-out prompts on Poisson
arrivals, or each of --arrivals, once per seed: a fresh gateway for every run) and reads the CPU the
gateway and the emulator used over the run (psutil: each process with its children). The int8 and
128-token options need their estimators built: `python -m gateway.lab.experiments.embedder_frontier`
builds them (models-precision-int8/, models-max_tokens-128/).
Writes loadtest/results/residual_options.json (or --out): a row per run, and per option and arrival process
the mean over seeds with its smallest and largest run. Loopback only; every run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from ports import stop_all  # loadtest/, this script's directory
from residual import result_name
from routed_efficiency import ROOT, gateway_cpu_s, wait_ready

from gateway.config.store import default_config_path, load_config
from gateway.lab.experiments.embedder_frontier import option_config, option_models_dir
from gateway.lab.sim.arrivals import KINDS

# option -> its [estimators] changes (the estimators' directory follows from them, as embedder_frontier builds it)
OPTIONS = {"fp32": {}, "fp32-1-thread": {"threads": 1}, "int8": {"precision": "int8"},
           "fp32-128-tokens": {"max_tokens": 128}}
GATEWAY = "http://127.0.0.1:8000"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of: {', '.join(OPTIONS)}")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--arrivals", default="poisson", help=f"comma-separated, of: {', '.join(KINDS)}")
    parser.add_argument("--seeds", type=int, default=1, help="runs of each option and arrival process (1..10)")
    parser.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "residual_options.json")
    args = parser.parse_args()
    chosen = [o.strip() for o in args.options.split(",")]
    if unknown := [o for o in chosen if o not in OPTIONS]:
        sys.exit(f"unknown options {unknown}; known: {list(OPTIONS)}")
    kinds = [k.strip() for k in args.arrivals.split(",")]
    if unknown := [k for k in kinds if k not in KINDS]:
        sys.exit(f"unknown arrivals {unknown}; known: {list(KINDS)}")
    if not 1 <= args.seeds <= 10:
        sys.exit("--seeds 1..10")
    if not 1 <= args.seconds <= 600:
        sys.exit("--seconds 1..600")
    cli = str(Path(sys.executable).parent / "routebalance")
    work = Path(tempfile.mkdtemp(prefix="residual-options-"))
    text = default_config_path().read_text()
    base = load_config(default_config_path()).estimators.models_dir
    emulator = subprocess.Popen([cli, "emulate"], cwd=ROOT, stdout=open(work / "emulate.log", "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT)
    rows: list[dict] = []  # one flat row per run (the docs' table)
    stage_rows: dict[str, list[dict]] = {}  # "option arrivals seed" -> residual.py's stages
    runs = [(seed, name, kind) for seed in range(args.seeds) for name in chosen for kind in kinds]
    try:
        for seed, name, kind in runs:  # seed by seed, so drift over the session hits every option alike
            changes = OPTIONS[name]
            models_dir = option_models_dir(base, changes)
            if not (ROOT / models_dir / "manifest.json").is_file():
                print(f"{name}: {models_dir}/ is not built; skipped (see this script's docstring)")
                continue
            config = work / f"{len(rows)}.toml"
            config.write_text(option_config(text, models_dir, changes))
            gateway = subprocess.Popen([cli, "serve", "--config", str(config)], cwd=ROOT,
                                       stdout=open(work / f"{config.stem}.log", "wb"),  # noqa: SIM115
                                       stderr=subprocess.STDOUT)
            try:
                wait_ready(GATEWAY + "/health", gateway)
                time.sleep(3)  # warm-up decisions and the first scrapes settle
                cpu = [psutil.Process(gateway.pid), psutil.Process(emulator.pid)]
                before = gateway_cpu_s(cpu[0]), gateway_cpu_s(cpu[1]), time.perf_counter()
                out = work / config.stem
                subprocess.run([sys.executable, str(ROOT / "loadtest" / "residual.py"), "--url", GATEWAY, "--rate",
                                str(args.rate), "--seconds", str(args.seconds), "--arrivals", kind, "--seed",
                                str(seed), "--out", str(out)], cwd=ROOT,
                               check=True, stdout=subprocess.DEVNULL, timeout=args.seconds + 300)
                after = gateway_cpu_s(cpu[0]), gateway_cpu_s(cpu[1]), time.perf_counter()
            finally:
                stop_all([gateway], timeout_s=30)
            wall = after[2] - before[2]
            result = json.loads((out / f"{result_name(kind)}.json").read_text())
            stages = {s["stage"]: s for s in result["stages"]}
            decision = stages["arrival to decision"]
            rows.append({"option": name, "arrivals": kind, "seed": seed, "gateway_cores": (after[0] - before[0]) / wall,
                         "emulator_cores": (after[1] - before[1]) / wall, "served": result["served"],
                         "failed": result["failed"], "wait_ms": stages["wait for the batch"]["mean_ms"],
                         "estimate_ms": stages["estimate (embed + KNN)"]["mean_ms"],
                         "decide_ms": stages["decide (score + assign)"]["mean_ms"],
                         "decision_mean_ms": decision["mean_ms"], "decision_p50_ms": decision["p50_ms"],
                         "decision_p99_ms": decision["p99_ms"]})
            stage_rows[f"{name} {kind} {seed}"] = result["stages"]
            print(f"{name:18} {kind:8} seed {seed}: arrival to decision mean {decision['mean_ms']:.1f} ms, "
                  f"p50 <= {decision['p50_ms']:g}, p99 <= {decision['p99_ms']:g}; gateway "
                  f"{rows[-1]['gateway_cores']:.2f} cores, emulator {rows[-1]['emulator_cores']:.2f}", flush=True)
            time.sleep(2)
    finally:
        stop_all([emulator], timeout_s=30)
    path = args.out.resolve()
    path.write_text(json.dumps({"rate": args.rate, "seconds": args.seconds, "summary": summary(rows), "rows": rows,
                                "stages": stage_rows}, indent=1) + "\n")
    print(f"wrote {path}; logs in {work}")


def summary(rows: list[dict]) -> list[dict]:
    """Per option and arrival process: the runs' mean arrival-to-decision time (their mean, smallest and
    largest) and the largest p50 and p99 bucket bounds any run had."""
    out = []
    for option, kind in dict.fromkeys((r["option"], r["arrivals"]) for r in rows):
        mine = [r for r in rows if (r["option"], r["arrivals"]) == (option, kind)]
        means = [r["decision_mean_ms"] for r in mine]
        out.append({"option": option, "arrivals": kind, "runs": len(mine), "decision_mean_ms": statistics.mean(means),
                    "decision_mean_min_ms": min(means), "decision_mean_max_ms": max(means),
                    "decision_p50_ms": max(r["decision_p50_ms"] for r in mine),
                    "decision_p99_ms": max(r["decision_p99_ms"] for r in mine),
                    "served": sum(r["served"] for r in mine), "failed": sum(r["failed"] for r in mine)})
    return out


if __name__ == "__main__":
    main()
