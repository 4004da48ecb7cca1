"""Check the Grafana dashboard (deploy/grafana/dashboards/routebalance.json) against a real run, and draw it.

    python loadtest/dashboard_check.py [--seconds 60] [--rate 4] [--replicas 1] [--redis]

Starts, on free loopback ports: the emulated pool of deploy/config.toml (plus one flaky
3B instance, so instance health moves), the gateway (or --replicas N of them, sharing a Redis
that --redis starts from Debian's redis-server), and Debian's `prometheus` scraping every 1 s
into a temporary directory. Drives a bounded load through the openai SDK with two API keys, a mix
of presets and end-to-end SLOs, half of it streamed. Then evaluates every panel's queries over
the run with Prometheus's HTTP API (query_range), draws the panels as a PNG grid with matplotlib
(Grafana is not packaged for Debian; this renders the same queries), and exits 1 naming every
panel without data. Everything it started is stopped on exit, error or Ctrl-C included.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import math
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
import urllib.parse
import urllib.request
from pathlib import Path

from ports import free_ports  # loadtest/, this script's directory
from tomli_w import dumps as dump_toml

REPO = Path(__file__).resolve().parent.parent
DASHBOARD = REPO / "deploy/grafana/dashboards/routebalance.json"
BASE_CONFIG = REPO / "deploy/config.toml"
SCRAPE_S = 1
# Grafana sets $__rate_interval to at least four scrape intervals; with 1 s scrapes, 10 s keeps
# the curves smooth enough and still shows the run's phases.
RATE_INTERVAL = "10s"
STEP_S = 2
MESSAGES_CAP = 400  # characters of a synthetic prompt sent
UNITS = {"reqps": "requests/s", "s": "seconds", "currencyUSD": "USD", "percentunit": "share", "none": ""}


class Stack:
    """The processes of one run; stop() ends them all (SIGINT, then SIGKILL after a grace period)."""

    def __init__(self, workdir: Path):
        self.workdir = workdir
        self.procs: list[tuple[str, subprocess.Popen]] = []

    def start(self, name: str, cmd: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs.append((name, proc))
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}: {self.tail(name)}")

    def tail(self, name: str, lines: int = 15) -> str:
        path = self.workdir / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 15
        for name, proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                print(f"{name} ignored SIGINT for 15 s: killed", file=sys.stderr)
                proc.kill()
                proc.wait(timeout=5)


def wait_http(url: str, stack: Stack, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s") from None
        stack.check_alive()
        time.sleep(0.3)


def make_configs(ports: dict, replicas: int, redis_url: str | None, keys: dict[str, str]) -> list[dict]:
    """deploy/config.toml moved to loopback: one config per replica (its own ports), all on one pool."""
    from gateway.tenancy.keys import hash_key

    base = tomllib.loads(BASE_CONFIG.read_text())
    base["server"] = {"host": "127.0.0.1"}
    base["state"] = {"backend": "redis", "url": redis_url} if redis_url else {"backend": "memory"}
    base["auth"] = {"allow_anonymous": False, "keys": [
        # team-a's requests that name no SLO get 20 s (its key's default); team-b has a spend limit.
        {"name": "team-a", "sha256": hash_key(keys["team-a"]), "slo_s": 20.0},
        {"name": "team-b", "sha256": hash_key(keys["team-b"]), "spend_limit_usd": 100.0},
    ]}
    base["slo"] = {"classes": {"interactive": 30.0, "batch": 600.0}}
    instances = base.pop("instances")
    # A second 3B instance that fails half its requests: it cools down and comes back (failover).
    instances.append(dict(instances[-1], name="qwen3b-a30-flaky", faults={"error_rate": 0.5}))
    for inst, port in zip(instances, ports["pool"], strict=True):
        inst["url"] = f"http://127.0.0.1:{port}"
    configs = []
    for i in range(replicas):
        cfg = dict(base, instances=instances)
        cfg["server"] = dict(base["server"], port=ports["gateway"][i], metrics_port=ports["metrics"][i])
        configs.append(cfg)
    return configs


def drive_load(bases: list[str], keys: dict[str, str], seconds: float, rate: float) -> dict:
    """Poisson arrivals at `rate` for `seconds` (at most rate * seconds * 1.5 requests), each on a
    worker thread; returns counts per key and outcome."""
    import openai

    from gateway.lab.workload.synthetic import generate
    from gateway.records import split

    prompts = [r.prompt[:MESSAGES_CAP] for r in split(generate(600, seed=1))[1]]
    clients = {(b, k): openai.OpenAI(base_url=b, api_key=v, timeout=60, max_retries=0)
               for b in bases for k, v in keys.items()}
    rng = random.Random(0)
    counts: dict[str, int] = {}
    lock = threading.Lock()

    def one(base: str, key: str, prompt: str, routing: dict, stream: bool) -> None:
        client = clients[(base, key)]
        try:
            kwargs = dict(model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=200,
                          extra_body={"routing": routing} if routing else None)
            if stream:
                for _ in client.chat.completions.create(stream=True, stream_options={"include_usage": True},
                                                        **kwargs):
                    pass
            else:
                client.chat.completions.create(**kwargs)
            outcome = "ok"
        except openai.APIStatusError as e:
            outcome = f"http {e.status_code}"
        except openai.APIError as e:
            outcome = type(e).__name__
        with lock:
            counts[f"{key} {outcome}"] = counts.get(f"{key} {outcome}", 0) + 1

    bound = int(rate * seconds * 1.5) + 1
    start = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        futures, at = [], 0.0
        while len(futures) < bound:
            at += rng.expovariate(rate)
            if at >= seconds:
                break
            time.sleep(max(0.0, start + at - time.monotonic()))
            key = rng.choice(list(keys))
            # A mix that moves every panel: presets shift the tier mix, SLOs from tight (often
            # missed) to batch, team-a's unnamed SLO is its key's default.
            routing = {}
            if rng.random() < 0.3:
                routing["preset"] = rng.choice(["cost", "quality", "latency"])
            if rng.random() < 0.6:
                routing["slo_s"] = rng.choice([1.5, 4.0, 15.0, 120.0])
            futures.append(pool.submit(one, bases[len(futures) % len(bases)], key, rng.choice(prompts), routing,
                                       rng.random() < 0.5))
        concurrent.futures.wait(futures, timeout=90)
    for client in clients.values():
        client.close()
    return dict(sorted(counts.items()))


def query_range(prom: str, expr: str, start: float, end: float) -> list[dict]:
    qs = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": STEP_S})
    with urllib.request.urlopen(f"{prom}/api/v1/query_range?{qs}", timeout=30) as r:
        body = json.load(r)
    if body["status"] != "success":
        raise RuntimeError(f"{expr}: {body}")
    return body["data"]["result"]


def legend(fmt: str, labels: dict) -> str:
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), "?"), fmt) if fmt else str(labels)


def evaluate(prom: str, dashboard: dict, start: float, end: float) -> list[dict]:
    """Every panel with its series: [(label, times, values)], and the targets that returned nothing."""
    panels = []
    for panel in dashboard["panels"]:
        series, empty = [], []
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", RATE_INTERVAL)
            result = query_range(prom, expr, start, end)
            points = 0
            for s in result:
                t = [float(x) - start for x, _ in s["values"]]
                v = [float(y) for _, y in s["values"]]
                points += sum(math.isfinite(x) for x in v)
                series.append((legend(target.get("legendFormat", ""), s["metric"]), t, v))
            if not points:
                empty.append(target["expr"])
        panels.append({"panel": panel, "series": series, "empty": empty})
    return panels


def short(label: str) -> str:
    return label.replace("Qwen/Qwen2.5-", "").replace("-Instruct", "")


def render(panels: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 3
    rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(6 * cols, 3.6 * rows), squeeze=False)
    for ax, p in zip(axes.flat, panels, strict=False):
        panel, defaults = p["panel"], p["panel"]["fieldConfig"]["defaults"]
        stacked = defaults.get("custom", {}).get("stacking", {}).get("mode") == "normal"
        if stacked and p["series"]:
            grid = sorted({t for _, ts, _ in p["series"] for t in ts})
            ys = [[dict(zip(ts, vs, strict=True)).get(t, 0.0) for t in grid] for _, ts, vs in p["series"]]
            ax.stackplot(grid, [[0.0 if math.isnan(y) else y for y in row] for row in ys],
                         labels=[short(lbl) for lbl, _, _ in p["series"]], alpha=0.7)
        else:
            for label, ts, vs in p["series"]:
                ax.plot(ts, vs, label=short(label), linewidth=1.4)
        if "min" in defaults:
            ax.set_ylim(defaults["min"] - 0.05, defaults["max"] + 0.05)
        ax.set_title(panel["title"] + ("   [NO DATA]" if p["empty"] else ""), fontsize=11,
                     color="red" if p["empty"] else "black")
        ax.set_ylabel(UNITS.get(defaults.get("unit", ""), defaults.get("unit", "")), fontsize=8)
        ax.set_xlabel("s since the load started", fontsize=8)
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=8)
        if p["series"]:
            ax.legend(fontsize=7, loc="upper left", ncol=2 if len(p["series"]) > 4 else 1)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=12)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)


def _peak_rss_mb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) // 1024
    return -1


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=60.0, help="load duration (default 60)")
    ap.add_argument("--rate", type=float, default=4.0, help="offered requests per second (default 4)")
    ap.add_argument("--replicas", type=int, default=1, help="gateway processes; more than one implies --redis")
    ap.add_argument("--redis", action="store_true", help="[state] backend = redis, with a redis-server started here")
    ap.add_argument("--out", type=Path, default=REPO / "loadtest/results/dashboard.png")
    ap.add_argument("--keep", action="store_true", help="keep the work directory (logs, configs, Prometheus data)")
    args = ap.parse_args()
    if not 1 <= args.replicas <= 4 or not 0 < args.seconds <= 600 or not 0 < args.rate <= 30:
        ap.error("bounds: 1-4 replicas, up to 600 s, up to 30 req/s")
    use_redis = args.redis or args.replicas > 1
    for tool in ["prometheus"] + (["redis-server"] if use_redis else []):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed: apt-get install {tool.split('-')[0]}")

    from gateway.tenancy.keys import new_key

    bin_dir = Path(sys.executable).parent
    routebalance = str(bin_dir / "routebalance") if (bin_dir / "routebalance").exists() else "routebalance"
    n_pool = len(tomllib.loads(BASE_CONFIG.read_text())["instances"]) + 1
    ports = free_ports(n_pool + 2 * args.replicas + 2)
    plan = {"pool": ports[:n_pool], "gateway": ports[n_pool:n_pool + args.replicas],
            "metrics": ports[n_pool + args.replicas:n_pool + 2 * args.replicas],
            "prometheus": ports[-2], "redis": ports[-1]}
    keys = {"team-a": new_key(), "team-b": new_key()}
    workdir = Path(tempfile.mkdtemp(prefix="rb-dashboard-"))
    stack = Stack(workdir)
    # SIGTERM (a CI timeout) unwinds like Ctrl-C, so the finally below stops everything.
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        redis_url = None
        if use_redis:
            stack.start("redis", ["redis-server", "--port", str(plan["redis"]), "--bind", "127.0.0.1", "--save", "",
                                  "--appendonly", "no", "--dir", str(workdir)])
            redis_url = f"redis://127.0.0.1:{plan['redis']}/0"
        configs = make_configs(plan, args.replicas, redis_url, keys)
        paths = []
        for i, cfg in enumerate(configs):
            paths.append(workdir / f"gateway-{i}.toml")
            paths[-1].write_text(dump_toml(cfg))
        stack.start("emulator", [routebalance, "--log-level", "WARNING", "emulate", "--config", str(paths[0])])
        for i, path in enumerate(paths):
            stack.start(f"gateway-{i}", [routebalance, "--log-level", "WARNING", "serve", "--config", str(path)])
        prom_cfg = {"global": {"scrape_interval": f"{SCRAPE_S}s", "evaluation_interval": f"{SCRAPE_S}s"},
                    "scrape_configs": [
                        {"job_name": "gateway", "static_configs": [
                            {"targets": [f"127.0.0.1:{p}" for p in plan["metrics"]]}]},
                        {"job_name": "emulator", "static_configs": [
                            {"targets": [f"127.0.0.1:{p}" for p in plan["pool"]]}]}]}
        (workdir / "prometheus.yml").write_text(json.dumps(prom_cfg))  # JSON is YAML
        prom = f"http://127.0.0.1:{plan['prometheus']}"
        stack.start("prometheus", ["prometheus", f"--config.file={workdir / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={workdir / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{plan['prometheus']}", "--log.level=warn"])
        for port in plan["pool"][:-1]:  # the flaky one answers /health too; no need to wait for it
            wait_http(f"http://127.0.0.1:{port}/health", stack, 60)
        for port in plan["gateway"]:
            wait_http(f"http://127.0.0.1:{port}/health", stack, 300)  # estimators load (or build)
        wait_http(f"{prom}/-/ready", stack, 60)
        print(f"stack up in {workdir}: {args.replicas} gateway(s) on {plan['gateway']}, pool {plan['pool']}, "
              f"prometheus {plan['prometheus']}" + (f", redis {plan['redis']}" if use_redis else ""))

        time.sleep(3 * SCRAPE_S)  # a few scrapes before the load, so rates start from zero
        start = time.time()
        counts = drive_load([f"http://127.0.0.1:{p}/v1" for p in plan["gateway"]], keys, args.seconds, args.rate)
        time.sleep(4 * SCRAPE_S)  # the last answers scraped
        end = time.time()
        stack.check_alive()
        # Peak memory per process: what deploy/k8s/deployment.yaml's requests and limits rest on.
        peaks = {name: _peak_rss_mb(proc.pid) for name, proc in stack.procs if name.startswith(("gateway", "emulator"))}
        print(f"peak RSS (MB): {peaks}")
        print(f"load: {args.seconds:.0f} s at {args.rate} req/s offered, {end - start:.0f} s in all: {counts}")

        dashboard = json.loads(DASHBOARD.read_text())
        panels = evaluate(prom, dashboard, start - 5, end)
        for p in panels:
            last = {short(lbl): round(v[-1], 4) for lbl, _, v in p["series"][:6] if v}
            print(f"  {p['panel']['title']:<28} {len(p['series']):>2} series  last: {last}"
                  + (f"  NO DATA: {p['empty']}" if p["empty"] else ""))
        render(panels, args.out, f"RouteBalance dashboard, rendered from Prometheus after a {args.seconds:.0f} s run "
               f"at {args.rate} req/s, {args.replicas} replica(s), state: {'redis' if use_redis else 'memory'}")
        print(f"wrote {args.out}")
        empty = [p["panel"]["title"] for p in panels if p["empty"]]
        if empty:
            print(f"FAIL: no data for {', '.join(empty)}", file=sys.stderr)
            return 1
        return 0
    except (RuntimeError, OSError) as e:
        print(f"FAIL: {e}", file=sys.stderr)
        for name, _ in stack.procs:
            print(f"--- {name} log:\n{stack.tail(name)}", file=sys.stderr)
        return 1
    finally:
        stack.stop()
        if args.keep:
            print(f"kept {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
