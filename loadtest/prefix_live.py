"""Prefix-cache-aware routing live: this gateway against the real vllm-router, side by side in one run, in front
of the same emulated instances of one model.

    python loadtest/prefix_live.py                                   # 2 rounds, 400 rows a workload, 2 req/s
    python loadtest/prefix_live.py --rounds 2 --rows 300 --rate 2 --workload both
    python loadtest/prefix_live.py --workload trace --no-round-robin --instances 4
    python loadtest/prefix_live.py --pool default --targets rb-approximate,rb-off --rows 300   # the 13-instance pool

The pool: --instances (4) emulated instances of --model on --gpu (Qwen/Qwen2.5-3B-Instruct on A30-24GB), their
fields copied from that model's first instance in gateway/config/default.toml, on free loopback ports, served by
`routebalance emulate`. The emulator caches prompt prefixes as vLLM does (16-token blocks, Qwen2.5's own token
ids), answers with `usage.prompt_tokens_details.cached_tokens`, and counts `vllm:prefix_cache_queries_total` /
`vllm:prefix_cache_hits_total` on each instance's /metrics.

The targets, each run on a fresh emulated pool (the emulator is restarted for every run, so no cache carries over
from one target to the next), in alternating rounds (A B C D, A B C D, ...):

  rb-approximate  `routebalance serve`, [scheduler] policy "routebalance", prefix_cache "approximate" (what it
                  sent where: Eq. 1's latency adds the prefill of what an instance does not hold, the request's own
                  counted four times, the default prefill_weight: its first token weighed beside its end-to-end time);
  rb-ties         rb-approximate with [policies.routebalance] tie_tolerance = 3 (a tier-mate holding more of the
                  prompt wins within three times the TPOT heads' error of the best score, not once);
  rb-e2e          rb-approximate with [policies.routebalance] prefill_weight = 1 (a request's own prefill counted
                  once: its end-to-end time alone, as Eq. 1 prices latency);
  rb-prior        rb-approximate with [policies.routebalance] latency_term = "prior" (each tier's TPOT prior in
                  place of the TPOT heads: the decode term is equal over one model's instances, so the prefill of
                  what each does not hold, times its running requests, decides);
  rb-off          the same with prefix_cache "off" (the cache term off: the paper's score);
  rb-events       rb-approximate with prefix_cache "events" (the gateway's index fed by the instances' events);
  vr-cache_aware  vllm-router 0.1.17 --policy cache_aware, its defaults (cache threshold 0.3, balance thresholds
                  abs 64 / rel 1.5): a radix tree of the token ids each instance gives for a request (it asks every
                  instance, vLLM's /tokenize, which the emulator serves); with no ids it takes the least loaded;
  vr-kv_aware     vllm-router --policy kv_aware, its defaults, fed by the instances' KV-cache events
                  (--kv-event-source per instance, --kv-event-block-size 16): the same token ids, matched against
                  the blocks the events say each instance holds;
  vr-round_robin  vllm-router --policy round_robin, the cache-blind reference (--no-round-robin leaves it out).
vllm-router's own decision counters (by outcome) are read from its Prometheus port after each run.

Clients name the pool model (not "auto"), so the gateway balances within that model's instances only.

--pool default runs the default config's whole heterogeneous pool instead (its 13 instances, their own names and
fields, on free loopback ports), through the gateway alone (vllm-router places requests among one model's
workers; the gateway's targets only): clients send "auto", so RouteBalance chooses the model as well, and each
run also reports the requests each model served and the cost of the answers (their usage at the instance's
prices).

Every instance publishes vLLM's KV-cache events (`kv_events`, on a free loopback port; the map encoding vLLM sends
since vllm-project/vllm#42892) in every run, whichever target reads them, so all targets face the same emulator.

Workloads (--workload trace|multi-turn|both): the Mooncake conversation trace's first --rows rows (read_mooncake,
scale 1/8; the window given to it is the instances' max_model_len less 64 tokens, room for the chat template,
so the ~4% of rows it cuts still fit with their answer) and the synthetic multi-turn mix's first --rows rows
(synthetic_prefixed(rows, --seed): conversations, agents, shared system prompts, documents, singles). Each row is
one user message whose text is row_text(row) (its Qwen2.5 tokens reproduce the row's prefix structure), streamed
with stream_options.include_usage, max_tokens = min(the row's output_tokens or 128, 128): answers are kept short
so a run stays bounded and the prefill (what a prefix cache saves) is a large part of each request. Open loop: the
rows' arrival times are scaled so the mean rate is --rate req/s. A run sends at most --rows requests and none
after --max-seconds; every request times out after 60 s (an error).

Measured per run at the client: TTFT (the first content delta) p50 / p99 / mean, E2E mean, errors, the share of
answers whose usage reports cached tokens > 0; from the emulator's counters (read from every instance's /metrics
before and after the run): the pool's prefix hit rate (sum of hits / sum of queries, in tokens), the requests each
instance served, and the emulator's own mean TTFT (its vllm:time_to_first_token_seconds histogram: if the client's
TTFT is far above it, the time is lost in the router, the client or a starved CPU, not in the modelled engine).
Prints a table per workload (every run, then the median over rounds) and writes loadtest/results/prefix_live.json
(every run, the medians and the settings). Everything listens on 127.0.0.1; every subprocess is stopped on exit;
the servers' logs go to a temporary directory whose path is printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import httpx
import numpy as np
import orjson
from peers import peers_venv, start  # loadtest/, this script's directory
from ports import free_ports, stop_all
from prometheus_client.parser import text_string_to_metric_families

from gateway.lab.workload.prefixed import PrefixedRow, read_mooncake, row_text, synthetic_prefixed

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIG = ROOT / "gateway" / "config" / "default.toml"
MODELS_DIR = ROOT / "models"
BIN = Path(sys.executable).parent
REQUEST_TIMEOUT_S = 60.0
MAX_TOKENS = 128
ENGINE_BLOCK = 16  # the emulated engines' KV-cache block (vLLM's default), which kv_aware must be told
# Every prompt opens with the same 24 tokens (Qwen2.5's default system turn, then "<|im_start|>user\n"): one full
# block that any instance which has served anything holds. More cached tokens than that is real reuse.
TEMPLATE_BLOCK = ENGINE_BLOCK
TEMPLATE_ROOM = 64  # tokens of Qwen2.5's chat template around one user message (29 with the default system turn)
TARGETS = ("rb-approximate", "rb-ties", "rb-e2e", "rb-prior", "rb-events", "rb-off", "vr-cache_aware",
           "vr-kv_aware", "vr-round_robin")
# The gateway's targets: [scheduler] prefix_cache and [policies.routebalance]'s options.
GATEWAY_TARGETS = {"rb-approximate": ("approximate", {}), "rb-ties": ("approximate", {"tie_tolerance": 3.0}),
                   "rb-e2e": ("approximate", {"prefill_weight": 1.0}),
                   "rb-prior": ("approximate", {"latency_term": "prior"}),
                   "rb-events": ("events", {}), "rb-off": ("off", {})}
INSTANCE_FIELDS = ("model", "gpu", "gpu_count", "tensor_parallel", "gpu_memory_gb", "gpu_memory_utilization",
                   "max_num_seqs", "max_model_len", "price_input_per_mtok", "price_output_per_mtok", "tpot_prior_ms")


@dataclass
class Sent:
    ok: bool = False
    error: str = ""
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    cached_tokens: int | None = None
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    instance: str = ""  # X-Route-Instance (the gateway only)


@dataclass
class Run:
    workload: str
    target: str
    round: int
    sent: int
    errors: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    ttft_mean_ms: float
    e2e_mean_ms: float
    hit_rate: float  # pool: sum(hits) / sum(queries) over the run, in tokens
    cached_share: float  # of the answers, those whose usage reports cached tokens > 0
    cached_beyond_share: float  # ... more than TEMPLATE_BLOCK (the template every prompt shares)
    emu_ttft_mean_ms: float  # the emulator's own TTFT (its histogram), all instances
    wall_s: float
    per_instance: dict = field(default_factory=dict)  # name -> {"requests", "queries", "hits"}
    gateway: dict = field(default_factory=dict)  # the gateway's own means (ms): batch wait, estimate, score, decision
    # vllm-router's own counters: its prefix decisions by outcome (cache_aware: prefix_hit, or the least loaded on
    # a low match or an imbalance; kv_aware: prefix_cost, it scored the instances' cached blocks; either:
    # missing_tokens, it had no token ids and took the least loaded) and kv_aware's index lookups by result
    router: dict = field(default_factory=dict)
    load: list = field(default_factory=list)  # the machine's 1- and 5-minute load averages at the run's end (2 cores)
    error_kinds: dict = field(default_factory=dict)
    models: dict = field(default_factory=dict)  # model -> requests its instances served (from the emulator's counters)
    cost_per_1k_usd: float = math.nan  # the answers' usage at their instance's prices, per 1,000 answered requests


# --- the pool and the targets' configs ------------------------------------------------------------------------------

def instance_fields(model: str, gpu: str) -> dict:
    """An instance entry's fields (all but name and url) from the default pool's first instance of model on gpu."""
    for _, fields in default_pool():
        if fields["model"] == model and fields["gpu"] == gpu:
            return fields
    sys.exit(f"{DEFAULT_CONFIG} has no instance of {model} on {gpu}")


def toml_value(v) -> str:
    return json.dumps(v) if isinstance(v, (str, bool)) else repr(v)


def toml_lines(table: dict) -> str:
    return "".join(f"{key} = {toml_value(v)}\n" for key, v in table.items())


def one_model_pool(fields: dict, n: int) -> list[tuple[str, dict]]:
    """n instances of one model: (name, fields) each."""
    tag = fields["model"].split("/")[-1].lower().replace(".", "")
    return [(f"{tag}-{k}", fields) for k in range(n)]


def default_pool() -> list[tuple[str, dict]]:
    """The default config's whole pool: (name, fields) of each of its instances."""
    return [(inst["name"], {k: inst[k] for k in INSTANCE_FIELDS if k in inst})
            for inst in tomllib.loads(DEFAULT_CONFIG.read_text())["instances"]]


def pool_toml(entries: list[tuple[str, dict]], ports: list[int], event_ports: list[int]) -> str:
    return "".join(f'\n[[instances]]\nname = "{name}"\nurl = "http://127.0.0.1:{port}"\n'
                   f'kv_events = "{events_endpoint(events)}"\n'
                   + toml_lines(fields)
                   for (name, fields), port, events in zip(entries, ports, event_ports, strict=True))


def events_endpoint(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def gateway_toml(port: int, prefix_cache: str, pool: str, options: dict | None = None) -> str:
    return f"""[server]
host = "127.0.0.1"
port = {port}

[scheduler]
policy = "routebalance"
prefix_cache = "{prefix_cache}"

[policies.routebalance]
{toml_lines(options or {})}
[estimators]
models_dir = "{MODELS_DIR}"
{pool}"""


ROUTER_COUNTERS = {"vllm_router_prefix_routing_decisions_total": "outcome",
                   "vllm_router_kv_placement_lookups_total": "result"}


def router_counters(port: int) -> dict[str, float]:
    """vllm-router's prefix decisions by outcome and kv_aware's index lookups by result, from its Prometheus
    port."""
    out: dict[str, float] = {}
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            label = ROUTER_COUNTERS.get(s.name)
            if label is not None:
                key = f"{'decision' if label == 'outcome' else 'lookup'} {s.labels.get(label, '?')}"
                out[key] = out.get(key, 0.0) + s.value
    return out


# --- the emulator's counters ------------------------------------------------------------------------------------------

GATEWAY_HISTOGRAMS = {"batch_wait": "routebalance_batch_wait_seconds", "estimate": "routebalance_estimate_seconds",
                      "score": "routebalance_score_seconds", "decision": "routebalance_decision_seconds"}


def gateway_means(base: str) -> dict[str, float]:
    """The gateway's own timings over its life (ms; per request: batch wait and decision; per batch: estimate
    (embedding + KNN) and score), and its mean batch size."""
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(f"{base}/metrics", timeout=10).text):
        for s in family.samples:
            sums[s.name] = sums.get(s.name, 0.0) + s.value
    out = {}
    for key, name in GATEWAY_HISTOGRAMS.items():
        n = sums.get(f"{name}_count", 0.0)
        out[f"{key}_ms"] = 1000 * sums.get(f"{name}_sum", 0.0) / n if n else math.nan
    n = sums.get("routebalance_batch_size_count", 0.0)
    out["batch_size"] = sums.get("routebalance_batch_size_sum", 0.0) / n if n else math.nan
    return out


def scrape(urls: dict[str, str]) -> dict[str, dict[str, float]]:
    """Per instance: prefix-cache queries and hits (tokens), finished requests, and the TTFT histogram's sum and
    count, from its /metrics."""
    out = {}
    for name, url in urls.items():
        text = httpx.get(f"{url}/metrics", timeout=10).text
        got = {"queries": 0.0, "hits": 0.0, "requests": 0.0, "ttft_sum": 0.0, "ttft_count": 0.0}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "vllm:prefix_cache_queries_total":
                    got["queries"] += s.value
                elif s.name == "vllm:prefix_cache_hits_total":
                    got["hits"] += s.value
                elif s.name == "vllm:request_success_total":
                    got["requests"] += s.value
                elif s.name == "vllm:time_to_first_token_seconds_sum":
                    got["ttft_sum"] += s.value
                elif s.name == "vllm:time_to_first_token_seconds_count":
                    got["ttft_count"] += s.value
        out[name] = got
    return out


# --- the client ------------------------------------------------------------------------------------------------------

def workload_rows(kind: str, rows: int, seed: int, max_model_len: int) -> list[PrefixedRow]:
    if kind == "trace":
        return list(read_mooncake(max_model_len=max_model_len - TEMPLATE_ROOM, requests=rows).rows)
    return list(synthetic_prefixed(rows, seed, max_model_len=max_model_len).rows)


def schedule(rows: list[PrefixedRow], rate: float) -> np.ndarray:
    """Arrival offsets (s) from the first row, scaled so that the mean rate is `rate`."""
    t = np.array([r.arrival_s for r in rows]) - rows[0].arrival_s
    span = t[-1]
    if len(rows) < 2 or span <= 0:
        return np.arange(len(rows)) / rate
    return t * ((len(rows) - 1) / span) / rate


async def one(session: aiohttp.ClientSession, url: str, body: bytes, start: float, at: float, out: Sent) -> None:
    await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
    sent = time.perf_counter()
    try:
        async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
            if r.status != 200:
                out.error = f"status {r.status}"
                await r.read()
                return
            out.instance = r.headers.get("X-Route-Instance", "")
            async for raw in r.content:
                line = raw.strip()
                if not line.startswith(b"data: ") or line == b"data: [DONE]":
                    continue
                event = orjson.loads(line[6:])
                choices = event.get("choices") or []
                if math.isnan(out.ttft_s) and any((c.get("delta") or {}).get("content") for c in choices):
                    out.ttft_s = time.perf_counter() - sent
                usage = event.get("usage")
                if usage:
                    out.prompt_tokens = usage.get("prompt_tokens")
                    out.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    out.cached_tokens = details.get("cached_tokens")
                if event.get("error"):
                    out.error = "error event"
                    return
        out.e2e_s = time.perf_counter() - sent
        if math.isnan(out.ttft_s):
            out.error = "no content"
        else:
            out.ok = True
    except TimeoutError:
        out.error = "timeout"
    except aiohttp.ClientError as e:
        out.error = type(e).__name__


async def replay(url: str, bodies: list[bytes], times: np.ndarray, max_seconds: float) -> list[Sent]:
    keep = [k for k, t in enumerate(times) if t <= max_seconds]
    outs = [Sent() for _ in keep]
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one(session, url, bodies[k], start, float(times[k]), o)
                                                for k, o in zip(keep, outs, strict=True))),
                               timeout=max_seconds + REQUEST_TIMEOUT_S + 30)
    return outs


def check(base: str, model: str, timeout_s: float = 120.0) -> None:
    """Until one short streamed request through `base` answers 200 with content (bounded)."""
    body = {"model": model, "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 4, "stream": True,
            "stream_options": {"include_usage": True}}
    deadline = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < deadline:
        try:
            r = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=10)
            if r.status_code == 200 and '"content"' in r.text:
                return
            last = f"{r.status_code} {r.text[:300]}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(1.0)
    sys.exit(f"{base}: no good answer in {timeout_s:.0f} s: {last}")


# --- one run ---------------------------------------------------------------------------------------------------------

def stop(procs: list[subprocess.Popen]) -> None:
    stop_all(procs)
    procs.clear()


def run_once(target: str, workload: str, rnd: int, rows: list[PrefixedRow], times: np.ndarray, args,
             entries: list[tuple[str, dict]], model: str, router: Path, logs: Path,
             procs: list[subprocess.Popen]) -> Run:
    """One target on a fresh pool of `entries`, clients naming `model` (a pool model, or "auto")."""
    count = len(entries)
    ports = free_ports(2 * count + 2)
    front, metrics_port = ports[0], ports[1]  # vllm-router's own Prometheus port (29000 unless told)
    backends, event_ports = ports[2:count + 2], ports[count + 2:]
    pool = pool_toml(entries, backends, event_ports)
    names = [name for name, _ in entries]
    urls = {n: f"http://127.0.0.1:{p}" for n, p in zip(names, backends, strict=True)}
    tag = f"{workload}-{target}-r{rnd}"
    emu_cfg = logs / f"{tag}-pool.toml"
    emu_cfg.write_text(f"[emulator]\nseed = {args.seed}\n{pool}")
    try:
        procs.append(start(f"{tag}-emulator", [str(BIN / "routebalance"), "--log-level", "WARNING", "emulate",
                                               "--config", str(emu_cfg)], backends[-1], logs, "/health"))
        for url in urls.values():
            httpx.get(f"{url}/health", timeout=5).raise_for_status()
        if target.startswith("rb-"):
            cfg = logs / f"{tag}-gateway.toml"
            prefix_cache, options = GATEWAY_TARGETS[target]
            cfg.write_text(gateway_toml(front, prefix_cache, pool, options))
            procs.append(start(f"{tag}-gateway", [str(BIN / "routebalance"), "--log-level", "WARNING", "serve",
                                                  "--config", str(cfg)], front, logs, "/health", timeout_s=180.0))
        else:
            policy = target.removeprefix("vr-")
            events = [] if policy != "kv_aware" else [
                *(a for url, port in zip(urls.values(), event_ports, strict=True)
                  for a in ("--kv-event-source", f"{url}={events_endpoint(port)}")),
                "--kv-event-model", model, "--kv-event-block-size", str(ENGINE_BLOCK)]
            procs.append(start(f"{tag}-vllm-router", [str(router), "--host", "127.0.0.1", "--port", str(front),
                                                      "--worker-urls", *urls.values(), "--policy", policy, *events,
                                                      "--prometheus-port", str(metrics_port), "--log-level",
                                                      "warning"],
                               front, logs, "/health", timeout_s=120.0, env={"HF_HUB_OFFLINE": "1"}))
        base = f"http://127.0.0.1:{front}"
        check(base, model)
        time.sleep(1.0)
        before = scrape(urls)
        started = time.perf_counter()
        bodies = [orjson.dumps({"model": model, "messages": [{"role": "user", "content": row_text(r)}],
                                "max_tokens": min(r.output_tokens or MAX_TOKENS, MAX_TOKENS), "stream": True,
                                "stream_options": {"include_usage": True}}) for r in rows]
        outs = asyncio.run(replay(f"{base}/v1/chat/completions", bodies, times, args.max_seconds))
        wall = time.perf_counter() - started
        time.sleep(0.5)
        after = scrape(urls)
        gw = gateway_means(base) if target.startswith("rb-") else {}
        kv = router_counters(metrics_port) if target.startswith("vr-") else {}
    finally:
        stop(procs)
    run = summarise(target, workload, rnd, outs, before, after, wall)
    run.models, run.cost_per_1k_usd = by_model(entries, run.per_instance), answers_cost(entries, outs)
    run.gateway = gw
    run.router = kv
    run.load = [round(x, 2) for x in os.getloadavg()[:2]]
    return run


def summarise(target, workload, rnd, outs: list[Sent], before, after, wall) -> Run:
    good = [o for o in outs if o.ok]
    ttft = np.array([o.ttft_s for o in good]) * 1000
    e2e = np.array([o.e2e_s for o in good]) * 1000
    delta = {n: {k: after[n][k] - before[n][k] for k in after[n]} for n in after}
    queries = sum(d["queries"] for d in delta.values())
    hits = sum(d["hits"] for d in delta.values())
    ttft_n = sum(d["ttft_count"] for d in delta.values())
    kinds: dict[str, int] = {}
    for o in outs:
        if not o.ok:
            kinds[o.error] = kinds.get(o.error, 0) + 1
    reported = [o for o in good if o.cached_tokens is not None]

    def pct(a: np.ndarray, q: float) -> float:
        return float(np.percentile(a, q)) if len(a) else math.nan

    return Run(workload, target, rnd, len(outs), len(outs) - len(good), pct(ttft, 50), pct(ttft, 99),
               float(ttft.mean()) if len(ttft) else math.nan, float(e2e.mean()) if len(e2e) else math.nan,
               hits / queries if queries else math.nan,
               sum(o.cached_tokens > 0 for o in reported) / len(reported) if reported else math.nan,
               sum(o.cached_tokens > TEMPLATE_BLOCK for o in reported) / len(reported) if reported else math.nan,
               1000 * sum(d["ttft_sum"] for d in delta.values()) / ttft_n if ttft_n else math.nan, wall,
               {n: {"requests": int(d["requests"]), "queries": int(d["queries"]), "hits": int(d["hits"])}
                for n, d in delta.items()}, kinds)


def by_model(entries: list[tuple[str, dict]], per_instance: dict) -> dict[str, int]:
    """Requests each model's instances served."""
    out: dict[str, int] = {}
    for name, fields in entries:
        out[fields["model"]] = out.get(fields["model"], 0) + per_instance.get(name, {}).get("requests", 0)
    return out


def answers_cost(entries: list[tuple[str, dict]], outs: list[Sent]) -> float:
    """USD per 1,000 answered requests: each answer's usage at its instance's prices (NaN when the router does not
    say which instance answered)."""
    prices = {name: (f["price_input_per_mtok"] / 1e6, f["price_output_per_mtok"] / 1e6) for name, f in entries}
    priced = [o for o in outs if o.ok and o.instance in prices and o.prompt_tokens is not None]
    if not priced:
        return math.nan
    usd = sum(o.prompt_tokens * prices[o.instance][0] + (o.completion_tokens or 0) * prices[o.instance][1]
              for o in priced)
    return 1000 * usd / len(priced)


# --- the report ------------------------------------------------------------------------------------------------------

NUMERIC = ("ttft_p50_ms", "ttft_p99_ms", "ttft_mean_ms", "e2e_mean_ms", "hit_rate", "cached_share",
           "cached_beyond_share", "emu_ttft_mean_ms", "errors", "sent")


def medians(runs: list[Run], workloads: list[str], targets: list[str]) -> list[dict]:
    out = []
    for w in workloads:
        for t in targets:
            mine = [r for r in runs if r.workload == w and r.target == t]
            if mine:
                out.append({"workload": w, "target": t, "rounds": len(mine),
                            **{k: statistics.median(getattr(r, k) for r in mine) for k in NUMERIC}})
    return out


HEAD = (f"{'target':<15} {'rnd':>3} {'TTFT p50':>9} {'p99':>8} {'mean':>8} {'E2E mean':>9} {'hit rate':>8} "
        f"{'cached>0':>8} {'>16':>6} {'emu TTFT':>8} {'errors':>6}  requests per instance")


def line(d: dict, rnd: str, split: str = "") -> str:
    return (f"{d['target']:<15} {rnd:>3} {d['ttft_p50_ms']:>9.1f} {d['ttft_p99_ms']:>8.1f} {d['ttft_mean_ms']:>8.1f} "
            f"{d['e2e_mean_ms']:>9.1f} {d['hit_rate']:>8.1%} {d['cached_share']:>8.1%} "
            f"{d['cached_beyond_share']:>6.1%} "
            f"{d['emu_ttft_mean_ms']:>8.1f} {d['errors']:>6.0f}  {split}")


def split_of(r: Run) -> str:
    split = "/".join(str(v["requests"]) for v in r.per_instance.values())
    if len(r.models) > 1:
        split += "  by model " + "/".join(f"{m.split('/')[-1]} {k}" for m, k in r.models.items())
        split += f"  USD {r.cost_per_1k_usd:.4f} per 1k"
    if r.gateway:
        g = r.gateway
        split += (f"  gw: wait {g['batch_wait_ms']:.0f} decision {g['decision_ms']:.0f} estimate/batch "
                  f"{g['estimate_ms']:.0f} ms, batch {g['batch_size']:.1f}")
    if r.router:
        split += "  router: " + ", ".join(f"{k} {v:.0f}" for k, v in sorted(r.router.items()))
    return split


def tables(runs: list[Run], meds: list[dict], workloads: list[str], args) -> str:
    out = []
    for w in workloads:
        pool = "the default pool" if args.pool == "default" else f"{args.instances} x {args.model} on {args.gpu}"
        out.append(f"\n{w}: {args.rows} rows at {args.rate:g} req/s, {pool}, "
                   f"max_tokens <= {MAX_TOKENS}; times in ms")
        out.append(HEAD)
        for r in sorted((r for r in runs if r.workload == w), key=lambda r: (TARGETS.index(r.target), r.round)):
            out.append(line(asdict(r), str(r.round + 1), split_of(r)))
        out.append("median over rounds")
        for m in (m for m in meds if m["workload"] == w):
            out.append(line(m, "med"))
    return "\n".join(out)


def write(out: Path, settings: dict, meds: list[dict], runs: list[Run], partial: bool) -> None:
    """The results file (rewritten after every run with partial = true, so a stopped run leaves what it had)."""
    out.write_text(json.dumps({"config": settings, "partial": partial, "medians": meds,
                               "runs": [asdict(r) for r in runs]}, indent=1, default=str))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--instances", type=int, default=4)
    ap.add_argument("--pool", choices=("one", "default"), default="one",
                    help="one: --instances of --model on --gpu; default: the default config's whole pool, through "
                         "the gateway alone, clients sending \"auto\"")
    ap.add_argument("--rows", type=int, default=400, help="rows of each workload (at most)")
    ap.add_argument("--rate", type=float, default=2.0, help="mean request rate (req/s)")
    ap.add_argument("--workload", choices=("trace", "multi-turn", "both"), default="both")
    ap.add_argument("--no-round-robin", action="store_true", help="leave vllm-router round_robin out")
    ap.add_argument("--targets", help=f"comma-separated subset of {', '.join(TARGETS)} (default: all)")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="no request sent later than this in a run")
    ap.add_argument("--seed", type=int, default=0, help="of the synthetic workload and the emulator")
    ap.add_argument("--model", default="Qwen/Qwen2.5-3B-Instruct")
    ap.add_argument("--gpu", default="A30-24GB")
    ap.add_argument("--out", type=Path, default=ROOT / "loadtest" / "results" / "prefix_live.json")
    args = ap.parse_args()
    if not (1 <= args.rounds <= 10 and 1 <= args.instances <= 16 and 2 <= args.rows <= 5000
            and 0 < args.rate <= 50 and 1 <= args.max_seconds <= 3600):
        sys.exit("--rounds 1..10, --instances 1..16, --rows 2..5000, --rate in (0, 50], --max-seconds 1..3600")
    if not (MODELS_DIR / "manifest.json").is_file():
        sys.exit(f"{MODELS_DIR}/manifest.json is missing: build the estimators first (routebalance train)")
    if args.pool == "default":
        entries, model = default_pool(), "auto"
    else:
        entries, model = one_model_pool(instance_fields(args.model, args.gpu), args.instances), args.model
    max_model_len = min(f["max_model_len"] for _, f in entries)
    chosen = set(args.targets.split(",")) if args.targets else set(TARGETS)
    if chosen - set(TARGETS):
        sys.exit(f"unknown target(s) {', '.join(sorted(chosen - set(TARGETS)))}: the targets are {', '.join(TARGETS)}")
    targets = [t for t in TARGETS if t in chosen and not (args.no_round_robin and t == "vr-round_robin")]
    if args.pool == "default" and any(not t.startswith("rb-") for t in targets):
        sys.exit("--pool default runs the gateway's targets alone (rb-...): give --targets")
    # vllm-router (installed into .peers-venv on first use) only where a target is one of its policies
    router = peers_venv() / "bin" / "vllm-router" if any(t.startswith("vr-") for t in targets) else Path()
    workloads = ["trace", "multi-turn"] if args.workload == "both" else [args.workload]
    data = {w: workload_rows(w, args.rows, args.seed, max_model_len) for w in workloads}
    times = {w: schedule(rows, args.rate) for w, rows in data.items()}
    logs = Path(tempfile.mkdtemp(prefix="prefix-live-"))
    print(f"logs in {logs}", flush=True)
    for w in workloads:
        sent = int((times[w] <= args.max_seconds).sum())
        print(f"{w}: {len(data[w])} rows, {sent} within {args.max_seconds:g} s, over {times[w][-1]:.0f} s; mean "
              f"prompt {np.mean([r.prompt_tokens for r in data[w]]):.0f} tokens", flush=True)
    runs: list[Run] = []
    procs: list[subprocess.Popen] = []
    settings = {"rows": args.rows, "rate": args.rate, "pool": args.pool, "instances": len(entries),
                "model": model, "gpu": args.gpu if args.pool == "one" else "the default pool's",
                "rounds": args.rounds, "workloads": workloads, "targets": targets,
                "max_seconds": args.max_seconds, "max_tokens": MAX_TOKENS, "seed": args.seed,
                "request_timeout_s": REQUEST_TIMEOUT_S, "instance_fields": dict(entries),
                "vllm_router": "vllm-router==0.1.17", "kv_events": "every instance publishes (map encoding)"}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    # A SIGTERM ends the run through the finally below (the servers stopped), not with orphans left behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for rnd in range(args.rounds):
            for w in workloads:
                for t in targets:
                    r = run_once(t, w, rnd, data[w], times[w], args, entries, model, router, logs, procs)
                    runs.append(r)
                    print(f"round {rnd + 1} {w:<10} " + line(asdict(r), "", split_of(r))
                          + f"  load {r.load[0]:.2f}" + (f" {r.error_kinds}" if r.error_kinds else ""), flush=True)
                    write(args.out, settings, medians(runs, workloads, targets), runs, partial=True)
    finally:
        stop(procs)
    meds = medians(runs, workloads, targets)
    print(tables(runs, meds, workloads, args))
    write(args.out, settings, meds, runs, partial=False)
    print(f"\nwrote {args.out}; logs in {logs}")


if __name__ == "__main__":
    main()
