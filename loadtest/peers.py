"""This gateway in passthrough against its peers, side by side: the Rust vllm-router and LiteLLM's proxy,
each in front of the same instant backend (instant_backend.py), under the same load, in alternating
rounds (A B, then B A), streamed and not.

    bash loadtest/peers.sh                      # 3 rounds x 10 s per router and mode, concurrency 32
    bash loadtest/peers.sh --rounds 5 --seconds 20 --no-litellm
    bash loadtest/peers.sh --client python --backends 13 --no-litellm   # a Python load generator, 13 backends
    bash loadtest/peers.sh --no-litellm --baseline /tmp/base   # and an earlier commit's gateway, same rounds

The peers are installed once in their own virtual environment (.peers-venv, or $PEERS_VENV), wrk from
Debian's package if it is missing. `--client python` loads with an asyncio aiohttp client in this process
instead of wrk (closed loop, --concurrency connections, bounded by --seconds and MAX_REQUESTS a run);
`--backends N` makes the instant backend answer on N ports, every router in front of all N (the pool's 13
instances: 13). Every target is checked with one real request of each mode first
(a router that answers errors fast must not win); wrk's non-2xx count is reported too. Everything
listens on loopback and every run is bounded by --seconds. Prints req/s and p50/p99 latency per target
(the median of its rounds), the p50 added over going direct, and the ratio to vllm-router; writes
loadtest/results/peers.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp
import httpx
import uvloop
from ports import free_ports, stop_all  # loadtest/, this script's directory

ROOT = Path(__file__).resolve().parent.parent
PEERS = ("vllm-router==0.1.17", "litellm[proxy]==1.108.7")
BODY = {"model": "instant", "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 8}
UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}
MAX_REQUESTS = 200_000  # per run of the Python client, whatever --seconds allows
LITELLM_KEY = "sk-peers-" + os.urandom(16).hex()  # LiteLLM's proxy refuses to start without a master key


@dataclass
class Run:
    target: str
    mode: str
    round: int
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int


def peers_venv() -> Path:
    """The peers' own virtual environment, made once."""
    venv = Path(os.environ.get("PEERS_VENV", ROOT / ".peers-venv"))
    marker = venv / ".installed"
    if marker.is_file() and marker.read_text() == "\n".join(PEERS):
        return venv
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    subprocess.run([str(venv / "bin" / "pip"), "install", "-q", *PEERS], check=True)
    marker.write_text("\n".join(PEERS))
    return venv


def ensure_wrk() -> str:
    found = shutil.which("wrk")
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit("wrk is missing: apt-get install -y wrk")
    if subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], stdout=subprocess.DEVNULL).returncode:
        subprocess.run(["apt-get", "update", "-q"], check=True, stdout=subprocess.DEVNULL)  # a fresh machine's lists
        subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], check=True, stdout=subprocess.DEVNULL)
    return shutil.which("wrk") or sys.exit("wrk did not install")


def start(name: str, cmd: list[str], port: int, logs: Path, ready_path: str, timeout_s: float = 90.0,
          env: dict | None = None) -> subprocess.Popen:
    """Start a server and wait until GET ready_path answers (bounded)."""
    log = open(logs / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                            cwd=ROOT)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"{name} exited at start; see {logs / (name + '.log')}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}{ready_path}", timeout=1.0).status_code < 500:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    sys.exit(f"{name} did not come up in {timeout_s:.0f} s; see {logs / (name + '.log')}")


def start_redis(binary: str, port: int, directory: Path | str) -> tuple[subprocess.Popen, str]:
    """A throwaway redis-server on loopback (nothing persisted; its files in `directory`): the process and its
    URL. Callers stop it with the rest of their processes."""
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(directory)], stdout=subprocess.DEVNULL)
    return proc, f"redis://127.0.0.1:{port}/0"


def every_worker(port: int, workers: int, timeout_s: float = 60.0) -> None:
    """Until each of a gateway's workers has answered on its port (new connections reach one the kernel picks)."""
    seen: set[int] = set()
    deadline = time.monotonic() + timeout_s
    while workers > 1 and len(seen) < workers:
        if time.monotonic() > deadline:
            sys.exit(f"only workers {sorted(seen)} of {workers} answered on port {port}")
        seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=1.0).json()["worker"]["index"])


def auth(target: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {LITELLM_KEY}"} if target == "litellm" else {}


def check(name: str, base: str) -> None:
    """One real request of each mode: a 200 with the backend's answer, and a stream that ends in [DONE]."""
    r = httpx.post(f"{base}/v1/chat/completions", json=BODY, headers=auth(name), timeout=10)
    if r.status_code != 200 or "ok" not in r.json()["choices"][0]["message"]["content"]:
        sys.exit(f"{name}: a plain request failed: {r.status_code} {r.text[:300]}")
    r = httpx.post(f"{base}/v1/chat/completions", json={**BODY, "stream": True}, headers=auth(name), timeout=10)
    if r.status_code != 200 or "[DONE]" not in r.text:
        sys.exit(f"{name}: a streamed request failed: {r.status_code} {r.text[:300]}")


def wrk_script(path: Path, stream: bool, headers: dict[str, str]) -> Path:
    body = json.dumps({**BODY, "stream": stream})
    lines = ['wrk.method = "POST"', 'wrk.headers["Content-Type"] = "application/json"',
             f"wrk.body = {json.dumps(body)}"]
    lines += [f"wrk.headers[{json.dumps(k)}] = {json.dumps(v)}" for k, v in headers.items()]
    path.write_text("\n".join(lines) + "\n")
    return path


def run_wrk(wrk: str, url: str, script: Path, seconds: int, concurrency: int) -> tuple[float, float, float, int]:
    out = subprocess.run([wrk, "-t1", f"-c{concurrency}", f"-d{seconds}s", "--latency", "--timeout", "10s",
                          "-s", str(script), url], capture_output=True, text=True, timeout=seconds + 30).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))

    def pct(p: str) -> float:
        value, unit = re.search(rf"^\s+{p}%\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * UNITS[unit]

    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return rps, pct("50"), pct("99"), int(errors.group(1)) if errors else 0


def run_python(url: str, stream: bool, seconds: int, concurrency: int,
               headers: dict[str, str]) -> tuple[float, float, float, int]:
    """wrk's figures from an asyncio aiohttp client: `concurrency` connections each sending the next request
    when its answer has been read whole, for `seconds` (and at most MAX_REQUESTS)."""
    return uvloop.run(_python_load(url, json.dumps({**BODY, "stream": stream}).encode(), seconds, concurrency,
                                   {"Content-Type": "application/json", **headers}))


async def _python_load(url: str, body: bytes, seconds: int, concurrency: int,
                       headers: dict[str, str]) -> tuple[float, float, float, int]:
    latencies: list[float] = []
    errors = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        end = start + seconds

        async def one_connection() -> None:
            nonlocal errors
            while time.perf_counter() < end and len(latencies) + errors < MAX_REQUESTS:
                sent = time.perf_counter()
                try:
                    async with session.post(url, data=body, headers=headers) as r:
                        await r.read()
                        ok = r.status == 200
                except (aiohttp.ClientError, TimeoutError):
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - sent)
                else:
                    errors += 1

        await asyncio.gather(*(one_connection() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    ms = sorted(x * 1000 for x in latencies) or [float("nan")]
    return len(latencies) / elapsed, ms[len(ms) // 2], ms[min(len(ms) - 1, int(0.99 * len(ms)))], errors


def gateway_config(path: Path, port: int, backends: list[int], redis_url: str | None = None) -> Path:
    state = f'\n[state]\nbackend = "redis"\nurl = "{redis_url}"\nprefix = "peers:"\n' if redis_url else ""
    instances = "".join(f"""
[[instances]]
name = "instant{k}"
url = "http://127.0.0.1:{backend}"
model = "instant"
gpu = "A100-80GB"
price_input_per_mtok = 0.0
price_output_per_mtok = 0.0
tpot_prior_ms = 1.0
""" for k, backend in enumerate(backends))
    path.write_text(f"""[server]
port = {port}
{state}
[scheduler]
policy = "passthrough+round_robin"
{instances}""")
    return path


def litellm_config(path: Path, backends: list[int]) -> Path:
    models = "".join(f"""  - model_name: instant
    litellm_params:
      model: openai/instant
      api_base: http://127.0.0.1:{backend}/v1
      api_key: none
""" for backend in backends)
    path.write_text(f"""model_list:
{models}general_settings:
  master_key: {LITELLM_KEY}
litellm_settings:
  telemetry: false
""")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=int, default=10, help="per router, mode and round")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--no-litellm", action="store_true", help="leave LiteLLM's proxy out")
    parser.add_argument("--client", choices=("wrk", "python"), default="wrk",
                        help="the load generator: wrk, or an asyncio aiohttp client in this process")
    parser.add_argument("--backends", type=int, default=1,
                        help="ports the instant backend answers on, every router in front of all (the pool: 13)")
    parser.add_argument("--gateway-workers", default="1",
                        help="this gateway's process counts to measure, comma-separated (e.g. 1,2: `serve --workers "
                             "2` beside one process; more than 1 starts a redis-server for their shared state)")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                        help="another checkout of this gateway (e.g. `git worktree add /tmp/base <commit>`), run "
                             "in the same rounds as the target routebalance@base: one process, its code first on "
                             "PYTHONPATH, this environment's packages")
    parser.add_argument("--out", type=Path, help="default: loadtest/results/peers.json (wrk), peers_python.json "
                                                 "(python), peers_base.json (--baseline)")
    args = parser.parse_args()
    if args.baseline is not None and not (args.baseline / "gateway" / "__init__.py").is_file():
        sys.exit(f"--baseline: no gateway package in {args.baseline}")
    if not (1 <= args.rounds <= 20 and 1 <= args.seconds <= 120 and 1 <= args.backends <= 64):
        sys.exit("--rounds 1..20, --seconds 1..120 and --backends 1..64")
    args.out = args.out or ROOT / "loadtest" / "results" / ("peers_base.json" if args.baseline else "peers.json"
                                                            if args.client == "wrk" else "peers_python.json")
    wrk = ensure_wrk() if args.client == "wrk" else ""
    venv = peers_venv()
    logs = Path(tempfile.mkdtemp(prefix="peers-"))
    procs: list[subprocess.Popen] = []
    counts = [int(w) for w in args.gateway_workers.split(",")]
    gateways = {("routebalance" if w == 1 else f"routebalance-w{w}"): w for w in counts}
    code = {}  # a gateway target run from another checkout: its PYTHONPATH
    if args.baseline is not None:
        gateways["routebalance@base"] = 1
        code["routebalance@base"] = {"PYTHONPATH": str(args.baseline.resolve())}
    names = ("vllm-router", "litellm", "redis", *gateways)
    chosen = free_ports(len(names) + args.backends)
    ports, backends = dict(zip(names, chosen, strict=False)), chosen[len(names):]
    targets = {"direct": backends[0], "vllm-router": ports["vllm-router"], **{g: ports[g] for g in gateways}}
    if not args.no_litellm:
        targets["litellm"] = ports["litellm"]
    try:
        procs.append(start("backend", [sys.executable, "loadtest/instant_backend.py", "--ports",
                                       ",".join(map(str, backends))], backends[0], logs, "/health"))
        procs.append(start("vllm-router", [str(venv / "bin" / "vllm-router"), "--host", "127.0.0.1", "--port",
                                           str(ports["vllm-router"]), "--worker-urls",
                                           *(f"http://127.0.0.1:{b}" for b in backends), "--policy", "round_robin",
                                           "--log-level", "error"], ports["vllm-router"], logs, "/health"))
        redis_url = None
        if max(counts) > 1:
            redis = shutil.which("redis-server") or sys.exit("--gateway-workers > 1 needs redis-server: "
                                                             "apt-get install -y redis-server")
            redis_proc, redis_url = start_redis(redis, ports["redis"], logs)
            procs.append(redis_proc)
        for name, workers in gateways.items():
            config = gateway_config(logs / f"{name}.toml", ports[name], backends, redis_url if workers > 1 else None)
            procs.append(start(name, [str(Path(sys.executable).parent / "routebalance"), "serve", "--config",
                                      str(config), "--workers", str(workers)], ports[name], logs, "/health",
                               env=code.get(name)))
            every_worker(ports[name], workers)
        if not args.no_litellm:
            procs.append(start("litellm", [str(venv / "bin" / "litellm"), "--config",
                                           str(litellm_config(logs / "litellm.yaml", backends)), "--host",
                                           "127.0.0.1", "--port", str(ports["litellm"]), "--num_workers", "1"],
                               ports["litellm"], logs, "/health/liveliness", timeout_s=180.0,
                               env={"LITELLM_LOG": "ERROR"}))
        for name, port in targets.items():
            check(name, f"http://127.0.0.1:{port}")
        scripts = {(mode, name): wrk_script(logs / f"{mode}-{name}.lua", mode == "stream", auth(name))
                   for mode in ("plain", "stream") for name in targets}
        runs = []
        for rnd in range(args.rounds):
            # Every other round in reverse order, so that no target always runs right after the same other one.
            order = list(targets.items())[::-1 if rnd % 2 else 1]
            for mode in ("plain", "stream"):
                for name, port in order:
                    url = f"http://127.0.0.1:{port}/v1/chat/completions"
                    if args.client == "wrk":
                        rps, p50, p99, errors = run_wrk(wrk, url, scripts[(mode, name)], args.seconds,
                                                        args.concurrency)
                    else:
                        rps, p50, p99, errors = run_python(url, mode == "stream", args.seconds, args.concurrency,
                                                           auth(name))
                    runs.append(Run(name, mode, rnd, rps, p50, p99, errors))
                    print(f"  round {rnd + 1} {mode:6} {name:13} {rps:8.0f} req/s  p50 {p50:6.2f} ms  "
                          f"p99 {p99:6.2f} ms" + (f"  {errors} errors" if errors else ""), flush=True)
    finally:
        stop_all(procs)
    summary = summarise(runs, list(targets))
    print(table(summary, args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": {"rounds": args.rounds, "seconds": args.seconds,
                                                 "concurrency": args.concurrency, "client": args.client,
                                                 "backends": args.backends, "peers": PEERS},
                                    "summary": summary, "runs": [asdict(r) for r in runs]}, indent=1))
    print(f"wrote {args.out}; server logs in {logs}")


def summarise(runs: list[Run], targets: list[str]) -> list[dict]:
    """Per target and mode: the median over rounds, the p50 added over direct, the ratio to vllm-router."""
    rows = []
    for mode in ("plain", "stream"):
        med = {t: {k: statistics.median(getattr(r, k) for r in runs if r.target == t and r.mode == mode)
                   for k in ("rps", "p50_ms", "p99_ms")} for t in targets}
        for t in targets:
            rows.append({"target": t, "mode": mode, **med[t],
                         "errors": sum(r.errors for r in runs if r.target == t and r.mode == mode),
                         "added_p50_ms": med[t]["p50_ms"] - med["direct"]["p50_ms"],
                         "vs_vllm_router": med[t]["rps"] / med["vllm-router"]["rps"]})
    return rows


def table(rows: list[dict], args) -> str:
    lines = [f"{args.rounds} rounds x {args.seconds} s, concurrency {args.concurrency}, {args.client}, "
             f"instant backend on {args.backends} port(s); medians",
             f"{'mode':<7} {'target':<13} {'req/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'+p50 ms':>8} "
             f"{'x vllm-router':>13} {'errors':>7}"]
    for r in rows:
        lines.append(f"{r['mode']:<7} {r['target']:<13} {r['rps']:>8.0f} {r['p50_ms']:>8.2f} {r['p99_ms']:>8.2f} "
                     f"{r['added_p50_ms']:>8.2f} {r['vs_vllm_router']:>13.2f} {r['errors']:>7}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
