"""Several gateway replicas behind HAProxy, sharing state through Redis, under real-prompt load.

    bash loadtest/replicas.sh 3                 # N = 1, 2, 3 replicas, 20 s of load each, 2 rounds
    bash loadtest/replicas.sh 2 --seconds 10 --concurrency 16

For each N: the emulated 13-instance pool (one process), one redis-server, N `routebalance serve`
replicas with `[state] backend = "redis"`, and HAProxy in front (round robin, health-checked on
/health/ready). Then two phases, both through HAProxy:
1. throughput: wrk, closed loop at --concurrency, held-out prompts of the synthetic workload in
   turn, short answers (--max-tokens) so the pool is not what limits; full RouteBalance routing.
2. overspend: a key with a small spend limit is hammered by --concurrency clients at once through
   every replica until it is refused (bounded in count and time); what Redis booked for it, less its
   limit, is the overspend, set against one request's worst case.
Needs redis-server, haproxy and wrk (Debian packages; installed when missing and run as root).
Loopback only. Prints a table and writes loadtest/results/replicas.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from peers import ROOT, ensure_wrk, run_wrk, start, start_redis
from ports import free_port, free_ports, move_pool, pool_ports, stop_all

from gateway.config.store import load_config
from gateway.lab.workload.synthetic import generate
from gateway.records import split
from gateway.state.link import RedisLink
from gateway.tenancy.keys import hash_key
from gateway.tenancy.spend.redis import RedisSpendLedger
from gateway.tenancy.spend.request import worst_case_usd
from gateway.tokens import TokenCounter

FREE_KEY, LIMITED_KEY = "rb-replicas-free-" + os.urandom(8).hex(), "rb-replicas-limited-" + os.urandom(8).hex()
PROMPTS = [r.prompt for r in split(generate(2000, seed=0))[1]][:200]  # held out: never trained on
MAX_OVERSPEND_REQUESTS = 3000  # the overspend phase's bounds
OVERSPEND_SECONDS = 90.0


def ensure(binary: str, package: str) -> str:
    found = shutil.which(binary)
    if found:
        return found
    if os.geteuid() != 0:
        sys.exit(f"{binary} is missing: apt-get install -y {package}")
    subprocess.run(["apt-get", "install", "-y", "-q", package], check=True, stdout=subprocess.DEVNULL)
    return shutil.which(binary) or sys.exit(f"{package} did not install")


def pool_config(work: Path) -> tuple[Path, str]:
    """The built-in pool, moved to free ports (the emulator serves each instance on its url's port)."""
    from gateway.config.store import default_config_path

    text = default_config_path().read_text()
    text = move_pool(text, free_ports(len(pool_ports(text))))
    path = work / "pool.toml"
    path.write_text(text)
    return path, text


def replica_config(work: Path, pool_text: str, n: int, port: int, redis_url: str, prefix: str,
                   limit_usd: float) -> Path:
    text = pool_text.replace('backend = "sqlite"', f'backend = "redis"\nurl = "{redis_url}"\nprefix = "{prefix}"', 1)
    text = re.sub(r"(?m)^port = 8000$", f"port = {port}", text, count=1)
    text += f"""
[[auth.keys]]
name = "free"
sha256 = "{hash_key(FREE_KEY)}"

[[auth.keys]]
name = "limited"
sha256 = "{hash_key(LIMITED_KEY)}"
spend_limit_usd = {limit_usd!r}
"""
    path = work / f"replica-{n}.toml"
    path.write_text(text)
    return path


def haproxy_config(work: Path, port: int, replicas: list[int]) -> Path:
    servers = "\n".join(f"    server r{i} 127.0.0.1:{p} check inter 1s" for i, p in enumerate(replicas))
    path = work / "haproxy.cfg"
    path.write_text(f"""global
    maxconn 4096
defaults
    mode http
    timeout connect 2s
    timeout client 120s
    timeout server 120s
frontend gateway
    bind 127.0.0.1:{port}
    default_backend replicas
backend replicas
    balance roundrobin
    option httpchk GET /health/ready
    http-check expect status 200
{servers}
""")
    return path


def wrk_prompts_script(path: Path, max_tokens: int) -> Path:
    bodies = [json.dumps({"model": "auto", "max_tokens": max_tokens,
                          "messages": [{"role": "user", "content": p}]}) for p in PROMPTS]
    path.write_text("\n".join([
        'wrk.method = "POST"',
        'wrk.headers["Content-Type"] = "application/json"',
        f'wrk.headers["Authorization"] = "Bearer {FREE_KEY}"',
        "bodies = {" + ",\n".join(json.dumps(b) for b in bodies) + "}",
        "i = 0",
        "request = function()",
        "  i = i % #bodies + 1",
        "  return wrk.format(nil, nil, nil, bodies[i])",
        "end",
    ]) + "\n")
    return path


async def hammer(url: str, concurrency: int, max_tokens: int) -> dict[str, int]:
    """The limited key from `concurrency` clients at once until refusals show it is spent (bounded)."""
    outcomes: dict[str, int] = {}
    sent = 0
    deadline = time.monotonic() + OVERSPEND_SECONDS
    headers = {"Authorization": f"Bearer {LIMITED_KEY}"}
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=concurrency)) as client:
        async def worker(k: int) -> None:
            nonlocal sent
            while sent < MAX_OVERSPEND_REQUESTS and time.monotonic() < deadline and outcomes.get("402", 0) < 200:
                sent += 1
                body = {"model": "auto", "max_tokens": max_tokens,
                        "messages": [{"role": "user", "content": PROMPTS[(sent + k) % len(PROMPTS)]}]}
                try:
                    status = str((await client.post(url, json=body, headers=headers)).status_code)
                except httpx.HTTPError as e:
                    status = e.__class__.__name__
                outcomes[status] = outcomes.get(status, 0) + 1

        await asyncio.gather(*(worker(k) for k in range(concurrency)))
    return outcomes


async def booked_usd(config: Path) -> tuple[float, int]:
    cfg = load_config(config)
    link = RedisLink(cfg.state.url, cfg.state.prefix, 2.0)
    try:
        [row] = await RedisSpendLedger(link, "refuse", 1).report([k for k in cfg.auth.keys if k.name == "limited"],
                                                                 time.time())
    finally:
        await link.close()
    return row.spent_usd, row.requests


def one_worst_case(config: Path, max_tokens: int) -> float:
    """The most one overspend request can cost: the longest prompt on the dearest instance."""
    cfg = load_config(config)
    count = TokenCounter().count
    longest = max(count(p) for p in PROMPTS) + 16  # the chat template's tokens, generously
    return max(worst_case_usd(i, longest, max_tokens, 1) for i in cfg.instances)


def routed_per_replica(ports: list[int]) -> list[int]:
    counts = []
    for port in ports:
        page = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        counts.append(round(sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines()
                                if line.startswith("routebalance_routed_total{"))))
    return counts


def run_n(n: int, args, work: Path, pool_text: str, redis_url: str, wrk: str, haproxy: str) -> dict:
    logs = Path(tempfile.mkdtemp(prefix=f"n{n}-", dir=work))  # one per run: rounds repeat every N
    prefix = f"replicas-{n}-{os.urandom(4).hex()}:"
    *ports, front = free_ports(n + 1)
    configs = [replica_config(logs, pool_text, k, p, redis_url, prefix, args.limit_usd) for k, p in enumerate(ports)]
    procs: list[subprocess.Popen] = []
    try:
        for k, (port, config) in enumerate(zip(ports, configs, strict=True)):
            procs.append(start(f"replica-{k}", [str(ROOT / ".venv/bin/routebalance"), "--log-level", "WARNING",
                                                "serve", "--config", str(config)], port, logs, "/health/ready",
                               timeout_s=180))
        procs.append(start("haproxy", [haproxy, "-db", "-f", str(haproxy_config(logs, front, ports))], front, logs,
                           "/health"))
        url = f"http://127.0.0.1:{front}/v1/chat/completions"
        time.sleep(2)  # HAProxy's first health checks
        script = wrk_prompts_script(logs / "prompts.lua", args.max_tokens)
        before = routed_per_replica(ports)
        rps, p50, p99, errors = run_wrk(wrk, url, script, args.seconds, args.concurrency)
        spread = [a - b for a, b in zip(routed_per_replica(ports), before, strict=True)]

        outcomes = asyncio.run(hammer(url, args.concurrency, args.max_tokens))
        time.sleep(1)  # the replicas' outboxes
        usd, requests = asyncio.run(booked_usd(configs[0]))
        worst = one_worst_case(configs[0], args.max_tokens)
        return {"replicas": n, "rps": rps, "p50_ms": p50, "p99_ms": p99, "non_2xx": errors,
                "routed_per_replica": spread, "limit_usd": args.limit_usd, "booked_usd": usd,
                "booked_requests": requests, "overspend_usd": usd - args.limit_usd, "one_worst_case_usd": worst,
                "overspend_outcomes": outcomes}
    finally:
        stop_all(procs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("replicas", type=int, nargs="?", default=3, help="runs N = 1 .. this many replicas")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4, help="answer length of every request")
    parser.add_argument("--limit-usd", type=float, default=0.0005, help="the limited key's spend limit")
    parser.add_argument("--rounds", type=int, default=2, help="runs of every N, alternating")
    args = parser.parse_args()
    if not (1 <= args.replicas <= 8 and 1 <= args.seconds <= 600 and 1 <= args.concurrency <= 256
            and 1 <= args.rounds <= 10):
        sys.exit("replicas must be 1..8, --seconds 1..600, --concurrency 1..256, --rounds 1..10")
    redis_server = ensure("redis-server", "redis-server")
    haproxy = ensure("haproxy", "haproxy")
    wrk = ensure_wrk()
    if not (ROOT / "models" / "manifest.json").exists():
        sys.exit("the estimators are not built: run `.venv/bin/routebalance train` first")
    rows = []
    with tempfile.TemporaryDirectory(prefix="rb-replicas-") as tmp:
        work = Path(tmp)
        pool_path, pool_text = pool_config(work)
        first_port = int(pool_ports(pool_text)[0])
        infra = [start("emulator", [str(ROOT / ".venv/bin/routebalance"), "--log-level", "WARNING", "emulate",
                                    "--config", str(pool_path)], first_port, work, "/health")]
        try:
            # its port chosen once the emulator holds the pool's, so it cannot be one of theirs
            redis, redis_url = start_redis(redis_server, free_port(), tmp)
            infra.append(redis)
            for round_ in range(args.rounds):  # N = 1, 2, 3, 1, 2, 3, ...: drift hits every N alike
                for n in range(1, args.replicas + 1):
                    rows.append({"round": round_, **run_n(n, args, work, pool_text, redis_url, wrk, haproxy)})
                    print(line(rows[-1]), flush=True)
        finally:
            stop_all(infra)
    medians = [median_row([r for r in rows if r["replicas"] == n]) for n in range(1, args.replicas + 1)]
    out = ROOT / "loadtest" / "results" / "replicas.json"
    out.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "medians": medians, "rows": rows},
                              indent=1) + "\n")
    print(f"\nmedians of {args.rounds} rounds (overspend: the largest)\n{table(medians)}\n"
          f"written to {out.relative_to(ROOT)}")


def median_row(rows: list[dict]) -> dict:
    """Throughput and latency: the median round; overspend: the worst round."""
    mid = sorted(rows, key=lambda r: r["rps"])[len(rows) // 2]
    worst = max(rows, key=lambda r: r["overspend_usd"])
    return {**mid, **{k: worst[k] for k in ("booked_usd", "booked_requests", "overspend_usd")}}


def line(r: dict) -> str:
    return (f"N={r['replicas']}: {r['rps']:.1f} req/s, p50 {r['p50_ms']:.0f} ms, p99 {r['p99_ms']:.0f} ms, "
            f"non-2xx {r['non_2xx']}, per replica {r['routed_per_replica']}; overspend "
            f"{r['overspend_usd']:+.2e} USD (one worst case {r['one_worst_case_usd']:.2e}) {r['overspend_outcomes']}")


def table(rows: list[dict]) -> str:
    head = ("| replicas | req/s | p50 ms | p99 ms | non-2xx | routed per replica | limit USD | booked USD "
            "| overspend USD | one worst case USD |\n|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['replicas']} | {r['rps']:.1f} | {r['p50_ms']:.0f} | {r['p99_ms']:.0f} | {r['non_2xx']} "
            f"| {' / '.join(map(str, r['routed_per_replica']))} | {r['limit_usd']:.6f} | {r['booked_usd']:.6f} "
            f"| {r['overspend_usd']:+.2e} | {r['one_worst_case_usd']:.2e} |" for r in rows]
    return "\n".join([head, *body])


if __name__ == "__main__":
    main()
