"""The residual at 30 req/s under each embedder setting: which lever moves it, measured side by side in one run.

    python loadtest/residual_options.py                          # every option, 60 s each
    python loadtest/residual_options.py --options fp32,int8 --seconds 30

Starts `routebalance emulate` (the built-in pool) once, then for each option `routebalance serve` with the
built-in config and that option's `[estimators]` (fp32 at 256 tokens with 2 onnxruntime threads, the
default; 1 thread; int8; 128 tokens), runs loadtest/residual.py against it (Poisson arrivals of held-out
prompts) and reads the CPU the gateway and the emulator used over the run (psutil: each process with its
children). The int8 and 128-token options need their estimators built: `python -m
gateway.lab.experiments.embedder_frontier` builds them (models-precision-int8/, models-max_tokens-128/).
Writes loadtest/results/residual_options.json. Loopback only; every run is bounded by --seconds.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from routed_efficiency import ROOT, gateway_cpu_s, wait_ready  # loadtest/, this script's directory

from gateway.config.store import default_config_path, load_config
from gateway.lab.experiments.embedder_frontier import option_config, option_models_dir

# option -> its [estimators] changes (the estimators' directory follows from them, as embedder_frontier builds it)
OPTIONS = {"fp32": {}, "fp32-1-thread": {"threads": 1}, "int8": {"precision": "int8"},
           "fp32-128-tokens": {"max_tokens": 128}}
GATEWAY = "http://127.0.0.1:8000"


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of: {', '.join(OPTIONS)}")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=30.0)
    args = parser.parse_args()
    chosen = [o.strip() for o in args.options.split(",")]
    if unknown := [o for o in chosen if o not in OPTIONS]:
        sys.exit(f"unknown options {unknown}; known: {list(OPTIONS)}")
    if not 1 <= args.seconds <= 600:
        sys.exit("--seconds 1..600")
    cli = str(Path(sys.executable).parent / "routebalance")
    work = Path(tempfile.mkdtemp(prefix="residual-options-"))
    text = default_config_path().read_text()
    base = load_config(default_config_path()).estimators.models_dir
    emulator = subprocess.Popen([cli, "emulate"], cwd=ROOT, stdout=open(work / "emulate.log", "wb"),  # noqa: SIM115
                                stderr=subprocess.STDOUT)
    rows: list[dict] = []  # one flat row per option (the docs' table)
    stage_rows: dict[str, list[dict]] = {}  # option -> residual.py's stages
    try:
        for name in chosen:
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
                                str(args.rate), "--seconds", str(args.seconds), "--out", str(out)], cwd=ROOT,
                               check=True, stdout=subprocess.DEVNULL, timeout=args.seconds + 300)
                after = gateway_cpu_s(cpu[0]), gateway_cpu_s(cpu[1]), time.perf_counter()
            finally:
                stop(gateway)
            wall = after[2] - before[2]
            result = json.loads((out / "residual.json").read_text())
            stages = {s["stage"]: s for s in result["stages"]}
            decision = stages["arrival to decision"]
            rows.append({"option": name, "gateway_cores": (after[0] - before[0]) / wall,
                         "emulator_cores": (after[1] - before[1]) / wall, "served": result["served"],
                         "failed": result["failed"], "wait_ms": stages["wait for the batch"]["mean_ms"],
                         "estimate_ms": stages["estimate (embed + KNN)"]["mean_ms"],
                         "decide_ms": stages["decide (score + assign)"]["mean_ms"],
                         "decision_mean_ms": decision["mean_ms"], "decision_p50_ms": decision["p50_ms"],
                         "decision_p99_ms": decision["p99_ms"]})
            stage_rows[name] = result["stages"]
            print(f"{name:18} arrival to decision mean {decision['mean_ms']:.1f} ms, p50 <= {decision['p50_ms']:g}, "
                  f"p99 <= {decision['p99_ms']:g}; gateway {rows[-1]['gateway_cores']:.2f} cores, emulator "
                  f"{rows[-1]['emulator_cores']:.2f}", flush=True)
            time.sleep(2)
    finally:
        stop(emulator)
    path = ROOT / "loadtest" / "results" / "residual_options.json"
    path.write_text(json.dumps({"rate": args.rate, "seconds": args.seconds, "rows": rows, "stages": stage_rows},
                               indent=1) + "\n")
    print(f"wrote {path.relative_to(ROOT)}; logs in {work}")


if __name__ == "__main__":
    main()
