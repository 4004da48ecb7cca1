"""What a routed request costs the gateway, beside what its embedding alone costs, in one run.

    python loadtest/routed_efficiency.py                     # both prompt sets, one gateway process
    python loadtest/routed_efficiency.py --workers 2         # `serve --workers 2` (starts a redis-server)
    python loadtest/routed_efficiency.py --workers 1,2,4,8,16 --sets synthetic   # the scaling, on a big machine
    python loadtest/routed_efficiency.py --rate 30           # Poisson arrivals at 30 req/s instead of saturation
    python loadtest/routed_efficiency.py --prompts 300 --sets synthetic
    python loadtest/routed_efficiency.py --workers 1,2 --threads 1   # two estimating workers of one thread each
    python loadtest/routed_efficiency.py --prefix-cache off          # without the prefix index (A/B its cost)
    python loadtest/routed_efficiency.py --tracing                   # [tracing] on, exported to the backends

Per prompt set (held-out synthetic prompts; the real-label prompts of ../shared/data/real-labels/), never
pooled, on the same prompts and the same cores:

1. the full routed path: `routebalance serve` (the config's RouteBalance on the built estimators, the
   embedding cache off so that every prompt is embedded, learning and metrics on as deployed) in front of
   instant backends on the pool's 13 ports (loadtest/instant_backend.py, one process). Each prompt is sent
   once (a repeat would be a cache hit, not routing), non-streamed, by a closed loop of --concurrency
   clients in this process: routed req/s, and CPU per request summed over every gateway process (the
   load generator and the backends are other processes and are not counted); the residual's stages from
   the gateway's own histograms over the run;
2. the embedder alone: this process embeds the same prompts at the gateway's batch shape (the mean batch
   the routed run formed) with the gateway's embedder settings, on the cores the gateway's processes use
   (onnxruntime threads: the gateway's times its workers, up to the machine's cores): CPU per prompt (this
   process's CPU time, onnxruntime's threads included) and prompts/s.

It prints both side by side with the ratios against the targets (gateway CPU per request at most 1.3x the
embedder's CPU per prompt; routed req/s at least 75% of the embedder's prompts/s) and writes
loadtest/results/routed_efficiency[-wN...].json; with several worker counts, a table of the scaling too.
`--profile` samples the gateway's processes with py-spy during each routed run and prints its busiest
frames. Loopback only; every phase is bounded in count and time.
The estimators must be built (`routebalance train`, or a first `routebalance up`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import psutil
from peers import every_worker, start_redis  # loadtest/, this script's directory
from ports import free_ports, move_pool, stop_all
from progressive_compare import held_out
from residual import histograms, summary

from gateway.config.store import default_config_path, load_config
from gateway.estimators.bundle import Estimators
from gateway.lab.experiments.embedder_frontier import option_config

ROOT = Path(__file__).resolve().parent.parent
REAL_LABELS = ROOT.parent / "shared" / "data" / "real-labels" / "zeroeval_crux_math_dev.jsonl"
TARGET_CPU_RATIO, TARGET_RATE_RATIO = 1.3, 0.75
MAX_PROMPTS = 5000
PHASE_TIMEOUT_S = 600.0
WARM_UP = 24  # distinct prompts sent before measuring (not in the measured set)


def prompt_sets(names: list[str], n: int) -> dict[str, list[str]]:
    sets = {}
    if "synthetic" in names:
        sets["synthetic"] = list(dict.fromkeys(held_out()))
    if "real" in names:
        if not REAL_LABELS.exists():
            sys.exit(f"{REAL_LABELS} is missing (../shared/data beside the repository)")
        rows = [json.loads(line) for line in REAL_LABELS.read_text().splitlines() if line.strip()]
        sets["real"] = list(dict.fromkeys(r["prompt"] for r in rows))
    for name, prompts in sets.items():
        if len(prompts) < n + WARM_UP:
            sys.exit(f"the {name} set has {len(prompts)} distinct prompts: ask for at most {len(prompts) - WARM_UP}")
    return {name: prompts[:n + WARM_UP] for name, prompts in sets.items()}


def gateway_config(work: Path, port: int, backends: list[int], redis_url: str | None,
                   threads: int | None = None, prefix_cache: str | None = None, tracing: bool = False) -> Path:
    text = move_pool(default_config_path().read_text(), backends)
    if prefix_cache is not None:
        text = text.replace('prefix_cache = "approximate"', f'prefix_cache = "{prefix_cache}"', 1)
    if tracing:  # every span exported over OTLP/HTTP, to the instant backend's /v1/traces (it answers at once)
        text = text.replace('enabled = false\n# The collector', 'enabled = true\n# The collector', 1).replace(
            'otlp_endpoint = "http://127.0.0.1:4318/v1/traces"',
            f'otlp_endpoint = "http://127.0.0.1:{backends[0]}/v1/traces"', 1)
        if f"127.0.0.1:{backends[0]}/v1/traces" not in text or "enabled = true\n# The collector" not in text:
            sys.exit("--tracing: the default config's [tracing] table is not as this script expects")
    text = re.sub(r"(?m)^port = 8000$", f"port = {port}", text, count=1)
    text = option_config(text, str(ROOT / "models"),
                         {"embed_cache_entries": 0, **({"threads": threads} if threads is not None else {})})
    text = text.replace('path = "data/labels.db"', f'path = "{work / "labels.db"}"', 1)
    state = f'backend = "redis"\nurl = "{redis_url}"\nprefix = "efficiency:"' if redis_url else \
        f'backend = "sqlite"\npath = "{work / "state.db"}"'
    text = text.replace('backend = "sqlite"\npath = "data/state.db"', state, 1)
    path = work / "gateway.toml"
    path.write_text(text)
    return path


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"the process serving {url} exited with code {proc.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    sys.exit(f"{url} was not ready within {timeout_s:.0f} s")


def gateway_cpu_s(root: psutil.Process) -> float:
    """User + system CPU seconds of the gateway's processes (the supervisor and its workers)."""
    total = 0.0
    for proc in [root, *root.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            continue
    return total


async def send_all(base: str, prompts: list[str], concurrency: int, rate: float | None = None) -> tuple[float, int]:
    """Each prompt once through the gateway: closed loop at `concurrency`, or (with `rate`) Poisson arrivals at
    that many per second; (wall seconds, errors)."""
    queue = list(reversed(prompts))
    errors = 0
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(prompt: str) -> None:
            nonlocal errors
            body = {"model": "auto", "max_tokens": 8, "messages": [{"role": "user", "content": prompt}]}
            try:
                async with session.post(base + "/chat/completions", json=body) as r:
                    await r.read()
                    errors += r.status != 200
            except (aiohttp.ClientError, TimeoutError):
                errors += 1

        async def client() -> None:
            while queue:
                await one(queue.pop())

        async def paced() -> None:
            gaps = np.random.default_rng(0).exponential(1 / rate, len(queue))
            start, tasks = time.perf_counter(), []
            for at in np.cumsum(gaps):
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                tasks.append(asyncio.create_task(one(queue.pop())))
            await asyncio.gather(*tasks)

        started = time.perf_counter()
        work = paced() if rate else asyncio.gather(*(client() for _ in range(concurrency)))
        await asyncio.wait_for(work, PHASE_TIMEOUT_S)
        return time.perf_counter() - started, errors


def routed(root: str, gateway: psutil.Process, prompts: list[str], concurrency: int,
           profile: Path | None = None, rate: float | None = None) -> dict:
    base = root + "/v1"
    asyncio.run(send_all(base, prompts[:WARM_UP], min(concurrency, WARM_UP)))
    measured = prompts[WARM_UP:]
    before_page = httpx.get(root + "/metrics", timeout=10).text
    spy = None
    if profile is not None:  # py-spy samples every gateway process while the load runs
        binary = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
        spy = subprocess.Popen([binary or sys.exit("--profile needs py-spy: pip install py-spy"),
                                "record", "--pid", str(gateway.pid), "--subprocesses", "--format", "raw",
                                "--rate", "200", "--output", str(profile)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    cpu0 = gateway_cpu_s(gateway)
    wall, errors = asyncio.run(send_all(base, measured, concurrency, rate))
    cpu = gateway_cpu_s(gateway) - cpu0
    if spy is not None:
        spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        spy.wait(60)
    after_page = httpx.get(root + "/metrics", timeout=10).text
    stages = summary(histograms(before_page), histograms(after_page))
    batches = _batch_sizes(before_page, after_page)
    return {"requests": len(measured), "errors": errors, "seconds": wall, "req_per_s": len(measured) / wall,
            "cpu_ms_per_request": 1000 * cpu / len(measured), "mean_batch": batches,
            "stages": {v["stage"]: {k: v[k] for k in ("per", "count", "mean_ms", "p50_ms", "p99_ms")}
                       for v in stages.values()}}


def _batch_sizes(before: str, after: str) -> float:
    def count_sum(page: str) -> tuple[float, float]:
        c = re.search(r"(?m)^routebalance_batch_size_count (\S+)$", page)
        s = re.search(r"(?m)^routebalance_batch_size_sum (\S+)$", page)
        return (float(c.group(1)) if c else 0.0), (float(s.group(1)) if s else 0.0)

    (c0, s0), (c1, s1) = count_sum(before), count_sum(after)
    return (s1 - s0) / max(c1 - c0, 1.0)


def embedder_alone(embedder, prompts: list[str], batch: int) -> dict:
    embedder.embed(prompts[:WARM_UP])
    measured = prompts[WARM_UP:]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i in range(0, len(measured), batch):
        embedder.embed(measured[i:i + batch])
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"prompts": len(measured), "batch": batch, "seconds": wall, "prompts_per_s": len(measured) / wall,
            "cpu_ms_per_prompt": 1000 * cpu / len(measured)}


def profile_summary(path: Path, top: int = 25) -> str:
    """The frames that hold the most samples of running (not idle) code, from py-spy's collapsed stacks:
    self samples (the frame on top) and total samples (the frame anywhere on the stack), as shares."""
    own: dict[str, int] = {}
    anywhere: dict[str, int] = {}
    samples = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = [f for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames or not count.isdigit() or _idle(frames[-1]):
            continue
        n = int(count)
        samples += n
        own[frames[-1]] = own.get(frames[-1], 0) + n
        for frame in set(frames):
            anywhere[frame] = anywhere.get(frame, 0) + n
    lines = [f"{samples} busy samples; the busiest frames (self %, total %):"]
    for frame, n in sorted(own.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {100 * n / samples:5.1f} {100 * anywhere[frame] / samples:5.1f}  {frame[:150]}")
    return "\n".join(lines)


def _idle(frame: str) -> bool:
    """A thread waiting (on the event loop's poll, a lock or a queue), not working."""
    return any(word in frame for word in ("(select", "poll (", "wait (", "_worker (concurrent", "acquire", "sleep"))


def report(name: str, row: dict, rate: float | None = None) -> str:
    r, e = row["routed"], row["embedder"]
    rates = (f"req/s {row['rate_ratio']:.0%} of the embedder's (target >= {TARGET_RATE_RATIO:.0%})" if rate is None
             else f"arrivals paced at {rate:g} req/s: the req/s target applies to the closed loop")
    lines = [f"\n== {name} ({r['requests']} distinct, each sent once; mean batch {r['mean_batch']:.1f})",
             f"{'':28}{'CPU ms/request':>16}{'req/s':>10}",
             f"{'embedder alone':28}{e['cpu_ms_per_prompt']:>16.1f}{e['prompts_per_s']:>10.1f}",
             f"{'routed through the gateway':28}{r['cpu_ms_per_request']:>16.1f}{r['req_per_s']:>10.1f}"
             + (f"   ({r['errors']} errors)" if r["errors"] else ""),
             f"ratios: CPU {row['cpu_ratio']:.2f}x the embedder's (target <= {TARGET_CPU_RATIO}); {rates}",
             "residual stages (ms):  " + "; ".join(f"{s} mean {v['mean_ms']:.1f} p50 {v['p50_ms']:g} p99 "
                                                   f"{v['p99_ms']:g}" for s, v in r["stages"].items())]
    return "\n".join(lines)


def run_gateway(workers: int, sets: dict[str, list[str]], args, work: Path, backends: list[int],
                ports: list[int]) -> dict:
    """One gateway of `workers` processes (and its redis-server when more than one): every set through it."""
    procs: list[subprocess.Popen] = []
    redis_port, port = ports
    try:
        redis_url = None
        if workers > 1:
            binary = shutil.which("redis-server") or sys.exit("--workers > 1 needs redis-server: "
                                                              "apt-get install -y redis-server")
            redis, redis_url = start_redis(binary, redis_port, work)
            procs.append(redis)
            time.sleep(0.5)
        config = gateway_config(work, port, backends, redis_url, args.threads, args.prefix_cache, args.tracing)
        gateway = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "serve",
                                    "--config", str(config), "--workers", str(workers)], cwd=ROOT)
        procs.append(gateway)
        root = f"http://127.0.0.1:{port}"
        wait_ready(root + "/health/ready", gateway)
        every_worker(port, workers, timeout_s=180.0)
        cfg = load_config(config)
        # The embedder alone gets the cores the gateway's processes use: its threads times the workers, up to
        # the machine's (two workers of one thread each are measured against one embedder of two threads).
        alone_threads = min(os.cpu_count() or 1, cfg.estimators.threads * workers)
        alone = dataclasses.replace(cfg.estimators, threads=alone_threads)
        embedder = Estimators.load(dataclasses.replace(cfg, estimators=alone)).embedder
        results = {}
        for name, prompts in sets.items():
            spy_file = work / f"profile-{name}.txt" if args.profile else None
            r = routed(root, psutil.Process(gateway.pid), prompts, args.concurrency, spy_file, args.rate)
            e = embedder_alone(embedder, prompts, max(1, round(r["mean_batch"])))
            results[name] = {"routed": r, "embedder": e,
                             "cpu_ratio": r["cpu_ms_per_request"] / e["cpu_ms_per_prompt"],
                             "rate_ratio": r["req_per_s"] / e["prompts_per_s"]}
            print(report(f"{name} prompts, {workers} worker{'s' * (workers > 1)}", results[name], args.rate),
                  flush=True)
            if spy_file is not None and spy_file.exists():
                kept = ROOT / "loadtest" / "results" / f"profile-routed-{name}-w{workers}.txt"
                shutil.copy(spy_file, kept)
                print(profile_summary(kept), flush=True)
        return {"threads": cfg.estimators.threads, "embedder_alone_threads": alone_threads, "sets": results}
    finally:
        stop_all(procs, timeout_s=30)


def scaling_table(runs: dict[int, dict]) -> str:
    names = list(next(iter(runs.values()))["sets"])
    lines = ["\n== scaling: routed req/s (CPU ms per request) by worker processes"]
    lines.append(f"{'workers':>8}" + "".join(f"{n:>26}" for n in names))
    for workers, run in runs.items():
        cells = [f"{run['sets'][n]['routed']['req_per_s']:.1f} ({run['sets'][n]['routed']['cpu_ms_per_request']:.1f})"
                 for n in names]
        lines.append(f"{workers:>8}" + "".join(f"{c:>26}" for c in cells))
    return "\n".join(lines)


def flat_rows(runs: dict[int, dict]) -> list[dict]:
    """One row per worker count and prompt set (the docs' table)."""
    return [{"workers": w, "set": name, "embed_cpu_ms": row["embedder"]["cpu_ms_per_prompt"],
             "embed_per_s": row["embedder"]["prompts_per_s"], "routed_cpu_ms": row["routed"]["cpu_ms_per_request"],
             "routed_per_s": row["routed"]["req_per_s"], "cpu_ratio": row["cpu_ratio"],
             "rate_ratio": row["rate_ratio"], "mean_batch": row["routed"]["mean_batch"],
             "errors": row["routed"]["errors"]}
            for w, run in runs.items() for name, row in run["sets"].items()]


def flat_stages(runs: dict[int, dict]) -> list[dict]:
    return [{"workers": w, "set": name, "stage": stage, **values}
            for w, run in runs.items() for name, row in run["sets"].items()
            for stage, values in row["routed"]["stages"].items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=500, help="distinct prompts per set (default 500)")
    parser.add_argument("--sets", default="synthetic,real", help="comma-separated: synthetic, real")
    parser.add_argument("--workers", default="1", help="gateway processes (serve --workers); a comma-separated "
                                                       "list (1,2,4,8,16) measures the scaling, one gateway each")
    parser.add_argument("--concurrency", type=int, default=32, help="closed-loop clients (saturation)")
    parser.add_argument("--rate", type=float, help="Poisson arrivals at this many req/s instead of the closed loop "
                                                   "(CPU per request at a given load; req/s is then the offered rate)")
    parser.add_argument("--threads", type=int, help="[estimators] threads of the gateway and of the embedder alone "
                                                    "(default: the config's)")
    parser.add_argument("--prefix-cache", choices=("approximate", "events", "off"),
                        help="[scheduler] prefix_cache of the gateway (default: the config's, approximate): off "
                             "measures the routed path without hashing prompts or reading the prefix index")
    parser.add_argument("--tracing", action="store_true",
                        help="[tracing] enabled, every request's spans exported over OTLP/HTTP to a loopback "
                             "collector that answers at once (needs the tracing extra)")
    parser.add_argument("--profile", action="store_true",
                        help="sample the gateway with py-spy during each routed run and print where its CPU goes")
    args = parser.parse_args()
    if not 1 <= args.prompts <= MAX_PROMPTS:
        sys.exit(f"--prompts must be in [1, {MAX_PROMPTS}]")
    counts = [int(w) for w in args.workers.split(",")]
    sets = prompt_sets([s.strip() for s in args.sets.split(",")], args.prompts)
    work = Path(tempfile.mkdtemp(prefix="routed-efficiency-"))
    backend = None
    try:
        *backends, redis_port, port = free_ports(15)
        backend = subprocess.Popen([sys.executable, str(ROOT / "loadtest" / "instant_backend.py"), "--ports",
                                    ",".join(map(str, backends))])
        wait_ready(f"http://127.0.0.1:{backends[0]}/health", backend)
        runs = {w: run_gateway(w, sets, args, work, backends, [redis_port, port]) for w in counts}
        if len(counts) > 1:
            print(scaling_table(runs))
        suffix = "" if counts == [1] else "-w" + "-".join(map(str, counts))
        suffix += f"-r{args.rate:g}" if args.rate else ""
        suffix += f"-t{args.threads}" if args.threads else ""
        suffix += f"-prefix-{args.prefix_cache}" if args.prefix_cache else ""
        suffix += "-tracing" if args.tracing else ""
        out = ROOT / "loadtest" / "results" / f"routed_efficiency{suffix}.json"
        out.write_text(json.dumps({"cores": os.cpu_count(), "concurrency": None if args.rate else args.concurrency,
                                   "rate": args.rate, "prompts": args.prompts,
                                   "targets": {"cpu_ratio_at_most": TARGET_CPU_RATIO,
                                               "rate_ratio_at_least": TARGET_RATE_RATIO},
                                   "rows": flat_rows(runs), "stages": flat_stages(runs),
                                   "runs": {str(w): run for w, run in runs.items()}}, indent=2) + "\n")
        print(f"\nwrote {out.relative_to(ROOT)}")
    finally:
        if backend is not None:
            backend.terminate()
            backend.wait(30)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
