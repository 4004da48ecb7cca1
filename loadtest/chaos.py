"""Chaos run: steady load on the emulated pool while instances are killed, stalled,
made to fail and restarted, with malformed, huge and slow requests alongside.

    .venv/bin/python loadtest/chaos.py [--duration 60] [--rate 20] [--config PATH] [--policy NAME]

Starts `routebalance up` (the 13 emulated vLLM instances and the gateway, one
process) as a child on free loopback ports, with a temporary copy of the config
(default: the packaged one) whose file it then edits to inject faults: every
--fault-every seconds the next instance, in an order that alternates models,
goes down (its port closes: a crash), stalls (+--stall-ms per request) or
answers 500 to everything, for --fault-hold seconds, after which it is restored
(a restart). At most --max-faulted instances are faulty at once, and never the
last healthy instance of a model. The emulator follows the file's reloads
(`config_watch_interval_s` is set to 0.2 s). Load starts once the gateway's
/health/ready answers 200 (its start-up's 503s are not counted).

Meanwhile it sends Poisson arrivals of good requests at --rate (chat and
completions, half streamed with usage, `auto` and each pool model, held-out
prompts, each with max_tokens = --max-tokens, so a run's verdict does not
depend on which prompts it drew) and, every --bad-every seconds, the next kind of bad traffic:
malformed JSON, wrong types, JSON nested 300 and 1,010 levels deep, a body over
`max_body_bytes`, a non-JSON content type, unknown models and paths, a ~900 kB
prompt, a slow body (part, a 2 s pause, the rest), a client that disconnects
mid-stream. /health is probed every 0.5 s.

Each request is classified:
  succeeded        200 and well-formed: a non-stream answer with choices and usage;
                   a stream with content, a usage chunk and [DONE]
  failed properly  a 4xx/5xx (not 500) with an OpenAI error body, or a stream
                   that ends with an error event
  slow             a whole answer still arriving after --deadline (bytes kept
                   coming: a long answer on a slow or stalled instance, not a
                   hang); reported with its duration and tokens, not lost
  lost             anything else: a 200 that is not a success (a stream cut
                   without an error event, no choices), a 500, a malformed error
                   body, a reset or closed connection, a hang (no byte for
                   --timeout seconds)

Prints a table (kind of traffic x sent, succeeded, failed properly, lost) and
exits 1 if anything was lost or the good traffic's success rate is below
--min-success, not counting requests whose instance was killed while it
answered them (a stream past its first byte cannot fail over; a non-streamed
request can, up to [upstream].retries times). Loopback only; bounded by time, request counts and concurrency;
the child is stopped on exit, Ctrl-C and errors.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from ports import free_ports, wait_ready  # loadtest/, this script's directory
from tomli_w import dumps as dump_toml

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_POLICY = "passthrough+round_robin"  # needs no estimators; --policy routebalance builds them (minutes)


# ---- the stack: `routebalance up` as a child process on a temp config ----------------------------------

def write_atomically(path: Path, text: str) -> None:
    """The watcher never reads a half-written file."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def make_config(source: Path, workdir: Path, policy: str, watch_s: float = 0.2,
                models_dir: Path | None = None) -> tuple[Path, dict]:
    """A copy of `source` on free loopback ports (gateway and every instance), with
    fast config watching, the given policy and no faults; returns its path and data.
    `models_dir`: where the estimators are (built there on first use if the policy needs them)."""
    data = tomllib.loads(source.read_text())
    if models_dir is not None:
        data.setdefault("estimators", {})["models_dir"] = str(models_dir.resolve())
    port, *instance_ports = free_ports(1 + len(data["instances"]))
    server = data.setdefault("server", {})
    server.update(host="127.0.0.1", port=port, config_watch_interval_s=watch_s)
    server.pop("metrics_port", None)
    data.setdefault("scheduler", {})["policy"] = policy
    data.setdefault("state", {})["path"] = str(workdir / "state.db")  # only opened with [auth] keys
    for inst, inst_port in zip(data["instances"], instance_ports, strict=True):
        inst["url"] = f"http://127.0.0.1:{inst_port}"
        inst["faults"] = {"error_rate": 0.0, "added_latency_ms": 0.0, "down": False}
    path = workdir / "config.toml"
    write_atomically(path, dump_toml(data))
    return path, data


def _die_with_parent() -> None:
    """In the child: get SIGTERM if this script dies, even by SIGKILL (Linux prctl PR_SET_PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class Stack:
    """`routebalance up` (the emulated pool and the gateway in one process) as a child process."""

    def __init__(self, config: Path, data: dict, log: Path):
        self.config, self.data, self.log = config, data, log
        self.cmd = [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "up", "--config", str(config)]
        self.root = f"http://127.0.0.1:{data['server']['port']}"
        self.instance_urls = {i["name"]: i["url"] for i in data["instances"]}
        self.proc: subprocess.Popen | None = None
        for url in (self.root, *self.instance_urls.values()):
            if urlsplit(url).hostname != "127.0.0.1":
                raise SystemExit(f"refusing {url}: the chaos and soak runs target loopback only")

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, ready_timeout_s: float) -> float:
        """Start the child and wait until the gateway is ready (/health/ready 200: not its start-up's 503s)
        and every instance answers /health; returns the seconds taken."""
        t0 = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True,
                                         preexec_fn=_die_with_parent)
        urls = [self.root + "/health/ready", *(u + "/health" for u in self.instance_urls.values())]
        try:
            wait_ready(urls, ready_timeout_s, self.proc)
        except RuntimeError as e:
            raise RuntimeError(f"`routebalance up` is not ready: {e}\n{self.log_tail()}") from None
        return time.monotonic() - t0

    def stop(self) -> int | None:
        """SIGINT (a clean stop, as Ctrl-C), then SIGKILL if it does not go within 20 s. Idempotent."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def log_problems(self) -> tuple[int, int, list[str]]:
        """(lines, tracebacks, the last few tracebacks' last lines) of the child's log."""
        try:
            text = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return 0, 0, []
        tb = [k for k, line in enumerate(text) if line.startswith("Traceback")]
        last = []
        for k in tb[-3:]:
            end = next((j for j in range(k + 1, len(text)) if text[j] and not text[j].startswith(" ")), k)
            last.append(text[end][:300])
        return len(text), len(tb), last


def proc_sample(pid: int) -> dict:
    """RSS, peak RSS (MB), threads and open file descriptors of a process, from /proc."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.strip()
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "hwm_mb": int(fields["VmHWM"].split()[0]) / 1024,
            "threads": int(fields["Threads"]), "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def install_sigterm() -> None:
    """SIGINT (also when started in the background, where a shell ignores it), SIGTERM and SIGHUP
    end the script through its `finally` blocks, which stop the child."""
    def raise_exit(signum, _frame):
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, raise_exit)
    if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN:  # under nohup it stays ignored
        signal.signal(signal.SIGHUP, raise_exit)


def command_line() -> str:
    return shlex.join([sys.executable, *sys.argv])


# ---- what chaos.py and soak.py share around their runs ----------------------------------------------------

def add_stack_arguments(ap: argparse.ArgumentParser, concurrency: int) -> None:
    """The options of the stack under test and of the requests sent to it."""
    from gateway.config.store import default_config_path

    ap.add_argument("--config", type=Path, default=default_config_path(), help="config to copy (default: packaged)")
    ap.add_argument("--policy", default=DEFAULT_POLICY, help=f"routing policy (default {DEFAULT_POLICY})")
    ap.add_argument("--models-dir", type=Path,
                    help="estimators directory (default: the config's; a policy that needs them builds them there)")
    ap.add_argument("--timeout", type=float, default=60.0,
                    help="a request that receives no byte for this long is lost (a hang), seconds")
    ap.add_argument("--deadline", type=float, default=300.0,
                    help="a request still receiving its answer after this long is stopped and reported slow")
    ap.add_argument("--max-tokens", type=int, default=256,
                    help="max_tokens of every good request (bounds how long an answer may rightly take)")
    ap.add_argument("--concurrency", type=int, default=concurrency, help="requests in flight at most")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (config, log) even when all went well")


def open_stack(args, name: str) -> tuple[Path, Path, dict, Stack]:
    """The run's temp dir, config (and its data) and the stack, not started yet; prints how to rerun."""
    install_sigterm()
    workdir = Path(tempfile.mkdtemp(prefix=f"routebalance-{name}-"))
    config, data = make_config(args.config, workdir, args.policy, models_dir=args.models_dir)
    stack = Stack(config, data, workdir / "stack.log")
    print(f"$ {command_line()}")
    print(f"stack: $ {shlex.join(stack.cmd)}   (cwd {ROOT}; log {stack.log})")
    return workdir, config, data, stack


def report_stack(stack: Stack, metrics: dict[str, float]) -> int:
    """Print the gateway's counters after the run and the problems of the stack's log; returns its tracebacks."""
    if metrics:
        print("gateway /metrics after the run: " + ", ".join(
            f"{k.removeprefix('routebalance_')} {v:g}" for k, v in sorted(metrics.items())))
    lines, tracebacks, last = stack.log_problems()
    print(f"stack log: {lines} lines, {tracebacks} tracebacks" + "".join(f"\n  {t}" for t in last))
    return tracebacks


def print_outcomes(title: str, outcomes: list, kind_width: int) -> None:
    """Up to 25 of `outcomes`, one line each."""
    if not outcomes:
        return
    print(f"\n{title}: {len(outcomes)}")
    for o in outcomes[:25]:
        print(f"  t={o.at_s:6.1f} s {o.kind:<{kind_width}} {o.status:>8} {o.elapsed_s:5.1f} s  {o.reason}"
              f"{'  instance ' + o.instance if o.instance else ''}"
              f"{'  body: ' + o.excerpt[:160].replace(chr(10), ' ') if o.excerpt else ''}")


def close_workdir(workdir: Path, keep: bool) -> None:
    if keep:
        print(f"\nkept {workdir} (config.toml, stack.log)")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


def run_script(main: Callable[[], int]) -> None:
    """Exit with `main`'s status; Ctrl-C has already stopped the child through `main`'s finally blocks."""
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted; the stack was stopped", file=sys.stderr)
        sys.exit(130)


def held_out_prompts(config: Path, n: int) -> list[str]:
    """Held-out prompts of the synthetic workload (as the simulator and the load tests replay them):
    the emulator answers them at their labelled lengths; the estimators never trained on them."""
    from gateway.config.store import load_config
    from gateway.lab.sim.evalset import evaluation_records

    return [r.prompt for r in evaluation_records(load_config(config), n)]


def scrape_metrics(root: str) -> dict[str, float]:
    """Sums of a few gateway counters from /metrics: {metric{label}: value}."""
    out: dict[str, float] = defaultdict(float)
    try:
        text = httpx.get(root + "/metrics", timeout=5, trust_env=False).text
    except httpx.HTTPError:
        return {}
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith("routebalance_"):
            continue
        name, _, value = line.rpartition(" ")
        metric, _, labels = name.partition("{")
        try:
            v = float(value)
        except ValueError:
            continue
        if metric in ("routebalance_in_flight_requests", "routebalance_upstream_retries_total"):
            out[metric] += v
        elif metric in ("routebalance_requests_total", "routebalance_config_reloads_total"):
            for part in labels.rstrip("}").split(","):
                key, _, val = part.partition("=")
                if key in ("status", "result"):
                    out[f"{metric}{{{key}={val.strip(chr(34))}}}"] += v
    return dict(out)


# ---- one request and its classification --------------------------------------------------------------

OK, FAILED, SLOW, LOST = "succeeded", "failed properly", "slow", "lost"


@dataclass
class Outcome:
    kind: str
    result: str  # OK, FAILED, SLOW or LOST
    status: str  # HTTP status, or what happened instead (timeout, reset, ...)
    reason: str = ""
    at_s: float = 0.0
    elapsed_s: float = 0.0
    instance: str = ""
    excerpt: str = ""
    expect: str = "either"  # "ok", "error" or "either": what a correct gateway does with this request
    tokens: int = 0  # answer pieces (stream content events) seen, for a slow answer's report


def openai_error(obj) -> bool:
    """{"error": {"message": str, "type": str, "param": ..., "code": ...}}"""
    err = obj.get("error") if isinstance(obj, dict) else None
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and isinstance(err.get("type"), str)
            and "param" in err and "code" in err)


def judge_error(status: int, body: bytes) -> tuple[str, str]:
    try:
        obj = json.loads(body)
    except ValueError:
        obj = None
    if status == 500:
        return LOST, "HTTP 500"
    if status < 400:
        return LOST, f"HTTP {status}"
    if not openai_error(obj):
        return LOST, f"HTTP {status} without an OpenAI error body"
    return FAILED, f"{obj['error'].get('code') or obj['error']['type']}: {obj['error']['message']}"


def failed_instance(reason: str) -> str:
    """The instance an error message names ("instance qwen7b-a30-2 is unreachable: ...")."""
    match = re.search(r"instance (\S+)", reason)
    return match.group(1) if match else ""


def judge_answer(body: bytes, chat: bool) -> tuple[str, str]:
    try:
        obj = json.loads(body)
    except ValueError:
        return LOST, "200 with a body that is not JSON"
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        return LOST, "200 without choices"
    text = (choices[0].get("message") or {}).get("content") if chat else choices[0].get("text")
    if not isinstance(text, str):
        return LOST, "200 with a choice without content"
    usage = obj.get("usage")
    if not isinstance(usage, dict) or not isinstance(usage.get("completion_tokens"), int):
        return LOST, "200 without usage"
    return OK, ""


class StreamJudge:
    """Follows an SSE stream: [DONE], error events, content, usage."""

    def __init__(self):
        self.buf = b""
        self.pieces = 0  # content events
        self.done = self.content = self.usage = False
        self.error: object = None
        self.after_done = 0

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in self.buf:
            event, self.buf = self.buf.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    self._data(line[5:].strip())

    def _data(self, data: bytes) -> None:
        if self.done:
            self.after_done += 1
        if data == b"[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(data)
        except ValueError:
            return
        if not isinstance(obj, dict):
            return
        if "error" in obj:
            self.error = obj
            return
        for choice in obj.get("choices") or ():
            if isinstance(choice, dict):
                piece = (choice.get("delta") or {}).get("content") if "delta" in choice else choice.get("text")
                self.content |= bool(piece)
                self.pieces += bool(piece)
        if isinstance(obj.get("usage"), dict) and isinstance(obj["usage"].get("completion_tokens"), int):
            self.usage = True

    def verdict(self) -> tuple[str, str]:
        if self.error is not None:
            if not openai_error(self.error):
                return LOST, "malformed error event"
            return FAILED, "error event: " + self.error["error"]["message"]  # type: ignore[index]
        if self.buf.strip():
            return LOST, "stream ended inside an event"
        if not self.done:
            return LOST, "stream ended without [DONE] or an error event"
        if not self.content:
            return LOST, "stream without content"
        if not self.usage:
            return LOST, "stream without the usage chunk it asked for"
        if self.after_done:
            return LOST, "events after [DONE]"
        return OK, ""


class _Idle(Exception):
    """No byte arrived within the idle bound."""


async def _within(awaitable, idle_s: float):
    try:
        return await asyncio.wait_for(awaitable, idle_s)
    except TimeoutError:
        raise _Idle from None


async def _next_chunk(chunks) -> bytes | None:
    """The next chunk of a response body, None at its end."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def send(client: httpx.AsyncClient, kind: str, method: str, path: str, *, content=None,
               headers: dict | None = None, stream: bool = False, chat: bool = True, timeout: float = 60.0,
               deadline: float | None = None, disconnect: bool = False, expect: str = "either",
               t0: float = 0.0) -> Outcome:
    """One request: lost if no byte comes for `timeout` seconds (a hang: the head, or the body stalls), slow
    if its answer is still arriving after `deadline` (default: 5 x timeout); `disconnect` hangs up after the
    first content event."""
    start = time.monotonic()
    out = Outcome(kind, LOST, "?", at_s=start - t0, expect=expect)
    deadline = 5 * timeout if deadline is None else deadline
    judge = StreamJudge()
    try:
        async with asyncio.timeout(deadline):
            request = client.build_request(method, path, content=content, headers=headers)
            resp = await _within(client.send(request, stream=True), timeout)
            try:
                out.status = str(resp.status_code)
                out.instance = resp.headers.get("x-route-instance", "")
                is_sse = resp.headers.get("content-type", "").startswith("text/event-stream")
                chunks = resp.aiter_bytes()
                if resp.status_code == 200 and stream and is_sse:
                    while (chunk := await _within(_next_chunk(chunks), timeout)) is not None:
                        judge.feed(chunk)
                        out.tokens = judge.pieces
                        if disconnect and judge.content:
                            out.result, out.reason = OK, "hung up after the first content"
                            return out
                        if judge.error is not None and len(judge.buf) > 1 << 20:
                            break
                    out.result, out.reason = judge.verdict()
                    if judge.error is not None:
                        out.status = "200+error event"
                    if out.result != OK:
                        out.excerpt = (judge.buf[-200:] or b"").decode(errors="replace")
                    return out
                parts = []
                while (chunk := await _within(_next_chunk(chunks), timeout)) is not None:
                    parts.append(chunk)
                body = b"".join(parts)
                out.excerpt = body[:300].decode(errors="replace")
                if resp.status_code == 200:
                    out.result, out.reason = ((LOST, "200 stream that is not SSE") if stream
                                              else judge_answer(body, chat))
                else:
                    out.result, out.reason = judge_error(resp.status_code, body)
                return out
            finally:
                await resp.aclose()
    except _Idle:
        out.status, out.reason = "timeout", f"hang: no byte for {timeout:g} s"
    except TimeoutError:
        out.result, out.status = SLOW, "slow"
        out.reason = f"answer still arriving after {deadline:g} s ({out.tokens} content events so far)"
    except httpx.TimeoutException as e:
        out.status, out.reason = "timeout", f"hang: {e.__class__.__name__}"
    except httpx.ConnectError as e:
        out.status, out.reason = "refused", f"connect failed: {e}"
    except httpx.RemoteProtocolError as e:
        out.status, out.reason = "closed", f"connection closed without a proper answer: {e}"
    except (httpx.ReadError, httpx.WriteError) as e:
        out.status, out.reason = "reset", f"connection reset: {e.__class__.__name__} {e}"
    except httpx.HTTPError as e:
        out.status, out.reason = "error", f"{e.__class__.__name__}: {e}"
    finally:
        out.elapsed_s = time.monotonic() - start
    return out


def chat_body(model: str, prompt: str, stream: bool = False, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return {**body, **extra}


GOOD_KINDS = ("chat", "chat stream", "completion", "completion stream")


async def good_request(client, kind: str, model: str, prompt: str, timeout: float, t0: float,
                       max_tokens: int = 256, deadline: float | None = None) -> Outcome:
    chat, stream = kind.startswith("chat"), kind.endswith("stream")
    if chat:
        body = chat_body(model, prompt, stream, max_tokens=max_tokens)
    else:
        body = {"model": model, "prompt": prompt, "temperature": 0, "stream": stream, "max_tokens": max_tokens}
        if stream:
            body["stream_options"] = {"include_usage": True}
    return await send(client, kind, "POST", "/v1/chat/completions" if chat else "/v1/completions",
                      content=json.dumps(body).encode(), headers={"Content-Type": "application/json"},
                      stream=stream, chat=chat, timeout=timeout, deadline=deadline, expect="ok", t0=t0)


# ---- bad traffic ------------------------------------------------------------------------------------

JSON = {"Content-Type": "application/json"}

MALFORMED = [b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}', b"not json at all", b"",
             b'{"model": "auto", "messages": [],}', b"\xff\xfe\x00garbage", b'{"model": "auto", "messages": NaN}',
             b'{"model": "auto", "model": "auto", "messages": [{"role": "user", "content": "\\ud800"}]']
WRONG_TYPES = [
    {"model": "auto", "messages": "hello"},
    {"model": "auto", "messages": [{"role": 5, "content": "hi"}]},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "stream": "yes"},
    {"model": 42, "messages": [{"role": "user", "content": "hi"}]},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "routing": {"budget_usd": "-1"}},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "routing": {"weights": {"quality": "x"}}},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "n": 10**9},
    [1, 2, 3],
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5},
    {"model": "auto", "messages": []},
    {"model": "auto", "messages": [{"role": "user", "content": [{"type": "text", "text": 7}]}]},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "routing": {"budget_usd": 1e303}},
    {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**30},
    {"model": "auto", "prompt": {"not": "a prompt"}},
]


class BadTraffic:
    """The kinds of bad traffic, each a coroutine factory; variants rotate per kind."""

    def __init__(self, client: httpx.AsyncClient, prompts: list[str], max_body: int, timeout: float, t0: float,
                 rng: random.Random):
        self.client, self.prompts, self.max_body, self.timeout, self.t0 = client, prompts, max_body, timeout, t0
        self.rng = rng
        self.n: Counter[str] = Counter()
        self.kinds = {
            "malformed JSON": self.malformed, "wrong types": self.wrong_types, "nested 300/1010 deep": self.nested,
            "body over max_body_bytes": self.oversized, "not application/json": self.content_type,
            "unknown model / path": self.unknown, "900 kB prompt": self.huge_prompt,
            "slow body (2 s pause)": self.slow_body, "disconnect mid-stream": self.disconnect,
        }

    def _post(self, kind: str, body: bytes, headers=None, path: str = "/v1/chat/completions", **kw):
        return send(self.client, kind, "POST", path, content=body, headers=headers or JSON,
                    timeout=kw.pop("timeout", self.timeout), t0=self.t0, **kw)

    def _next(self, kind: str) -> int:
        self.n[kind] += 1
        return self.n[kind] - 1

    async def malformed(self, kind):
        return await self._post(kind, MALFORMED[self._next(kind) % len(MALFORMED)], expect="error")

    async def wrong_types(self, kind):
        k = self._next(kind) % len(WRONG_TYPES)
        body = WRONG_TYPES[k]
        path = "/v1/completions" if isinstance(body, dict) and "prompt" in body else "/v1/chat/completions"
        expect = "either" if isinstance(body, dict) and body.get("routing", {}).get("budget_usd") == 1e303 else "error"
        return await self._post(kind, json.dumps(body).encode(), path=path, expect=expect)

    async def nested(self, kind):
        depth = (300, 1010)[self._next(kind) % 2]
        body = (b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "metadata": '
                + b"[" * depth + b"]" * depth + b"}")
        return await self._post(kind, body, expect="error")

    async def oversized(self, kind):
        self._next(kind)
        body = json.dumps(chat_body("auto", "x" * (self.max_body + 4096))).encode()
        return await self._post(kind, body, expect="error")

    async def content_type(self, kind):
        ctype = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x")[
            self._next(kind) % 3]
        body = json.dumps(chat_body("auto", self.rng.choice(self.prompts))).encode()
        return await self._post(kind, body, headers={"Content-Type": ctype}, expect="error")

    async def unknown(self, kind):
        k = self._next(kind) % 3
        if k == 0:
            return await self._post(kind, json.dumps(chat_body("gpt-nonexistent", "hi")).encode(), expect="error")
        if k == 1:
            return await self._post(kind, b"{}", path="/v1/nothing-here", expect="error")
        return await send(self.client, kind, "GET", "/v1/chat/completions", timeout=self.timeout, t0=self.t0,
                          expect="error")

    async def huge_prompt(self, kind):
        self._next(kind)
        words = " ".join(self.rng.choice(self.prompts).split()[:40])
        prompt = (words + " ") * (900_000 // (len(words) + 1))
        return await self._post(kind, json.dumps(chat_body("auto", prompt[:900_000])).encode())

    async def slow_body(self, kind):
        k = self._next(kind)
        body = json.dumps(chat_body("auto", self.rng.choice(self.prompts), stream=k % 2 == 1)).encode()
        half = len(body) // 2

        async def parts():
            yield body[:half]
            await asyncio.sleep(2.0)
            yield body[half:]

        headers = {**JSON, "Content-Length": str(len(body))}
        return await self._post(kind, parts(), headers=headers, stream=k % 2 == 1, expect="ok")

    async def disconnect(self, kind):
        self._next(kind)
        body = json.dumps(chat_body("auto", self.rng.choice(self.prompts), stream=True)).encode()
        return await self._post(kind, body, stream=True, disconnect=True, expect="ok")


# ---- faults -----------------------------------------------------------------------------------------

class Faults:
    """Kills, stalls and breaks instances in turn by editing the config file; restores them after a hold."""

    KINDS = ("down", "stall", "error")
    LABEL = {"down": "kill (port closed)", "stall": "stall", "error": "500s", None: "restore"}

    def __init__(self, stack: Stack, stall_ms: float, every_s: float, hold_s: float, max_faulted: int):
        self.stack, self.stall_ms, self.every_s, self.hold_s = stack, stall_ms, every_s, hold_s
        self.max_faulted = max_faulted
        self.instances = {i["name"]: i for i in stack.data["instances"]}
        by_model: dict[str, list[str]] = defaultdict(list)
        for name, inst in self.instances.items():
            by_model[inst["model"]].append(name)
        self.by_model = dict(by_model)
        # Alternate models: 72B-0, 14B-0, 7B-0, 3B-0, 72B-1, ...
        self.order = [names[k] for k in range(max(map(len, by_model.values())))
                      for names in by_model.values() if k < len(names)]
        self.active: dict[str, tuple[str, float]] = {}  # name -> (kind, restore at)
        self.events: list[tuple[float, str, str]] = []  # (t, instance, what)
        self.applied: list[float] = []  # seconds until a kill or restart was visible on the port
        self.not_applied: list[str] = []
        self.counts: Counter[str] = Counter()
        self._next_instance = self._next_kind = 0
        self._checks: set[asyncio.Task] = set()

    def killed_during(self, name: str, start_s: float, end_s: float) -> bool:
        """Was the instance killed while a request on it ran (times from the run's start)?"""
        return any(n == name and what == self.LABEL["down"] and start_s <= t <= end_s + 0.5
                   for t, n, what in self.events)

    def _healthy(self, model: str) -> int:
        return sum(1 for n in self.by_model[model] if n not in self.active)

    def _write(self) -> None:
        for name, inst in self.instances.items():
            kind = self.active.get(name, (None, 0.0))[0]
            inst["faults"] = {"error_rate": 1.0 if kind == "error" else 0.0,
                              "added_latency_ms": float(self.stall_ms) if kind == "stall" else 0.0,
                              "down": kind == "down"}
        write_atomically(self.stack.config, dump_toml(self.stack.data))

    async def _check_port(self, name: str, down: bool, since: float) -> None:
        """Time until the emulator followed the reload: the port refuses (down) or answers (up)."""
        url = self.stack.instance_urls[name] + "/health"
        async with httpx.AsyncClient(timeout=1.0, trust_env=False) as client:
            for _ in range(50):
                try:
                    up = (await client.get(url)).status_code == 200
                except httpx.HTTPError:
                    up = False
                if up != down:
                    self.applied.append(time.monotonic() - since)
                    return
                await asyncio.sleep(0.1)
        self.not_applied.append(f"{name} {'down' if down else 'up'}")

    def _check(self, name: str, down: bool) -> None:
        task = asyncio.get_running_loop().create_task(self._check_port(name, down, time.monotonic()))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    def step(self, now: float, t0: float, inject: bool, restore_all: bool = False) -> None:
        changed = False
        for name, (kind, until) in list(self.active.items()):
            if now >= until or restore_all:
                del self.active[name]
                self.events.append((now - t0, name, self.LABEL[None] + f" (after {kind})"))
                if kind == "down":
                    self._check(name, down=False)
                changed = True
        if inject and not restore_all and len(self.active) < self.max_faulted:
            for _ in range(len(self.order)):
                name = self.order[self._next_instance % len(self.order)]
                self._next_instance += 1
                if name not in self.active and self._healthy(self.instances[name]["model"]) >= 2:
                    kind = self.KINDS[self._next_kind % len(self.KINDS)]
                    self._next_kind += 1
                    self.active[name] = (kind, now + self.hold_s)
                    self.counts[kind] += 1
                    self.events.append((now - t0, name, self.LABEL[kind]))
                    if kind == "down":
                        self._check(name, down=True)
                    changed = True
                    break
        if changed:
            self._write()

    async def run(self, t0: float, start_at: float, stop_at: float) -> None:
        loop = asyncio.get_running_loop()
        next_at = start_at
        try:
            for _ in range(int((stop_at - t0) / 0.1) + 10):  # bounded: one pass per 0.1 s
                now = loop.time()
                if now >= stop_at:
                    break
                due = now >= next_at
                if due:
                    next_at += self.every_s
                if due or any(now >= until for _, until in self.active.values()):
                    self.step(now, t0, inject=due)
                await asyncio.sleep(0.1)
        finally:
            self.step(loop.time(), t0, inject=False, restore_all=True)  # restore everything, also on errors and Ctrl-C
            if self._checks:
                await asyncio.wait(self._checks, timeout=6)


# ---- the run ----------------------------------------------------------------------------------------

class Tally:
    def __init__(self):
        self.outcomes: list[Outcome] = []

    def add(self, o: Outcome) -> None:
        self.outcomes.append(o)

    def rows(self, kinds) -> list[tuple[str, int, int, int, int, int, str]]:
        rows = []
        for kind in kinds:
            mine = [o for o in self.outcomes if o.kind == kind]
            c = Counter(o.result for o in mine)
            statuses = Counter(o.status for o in mine)
            shown = " ".join(f"{s}x{n}" for s, n in sorted(statuses.items(), key=lambda x: (-x[1], x[0])))
            rows.append((kind, len(mine), c[OK], c[FAILED], c[SLOW], c[LOST], shown))
        return rows


def format_table(rows) -> str:
    head = f"{'traffic':<26} {'sent':>6} {'succeeded':>10} {'failed properly':>16} {'slow':>5} {'lost':>6}  statuses"
    lines = [head, "-" * len(head)]
    for kind, sent, ok, failed, slow, lost, statuses in rows:
        lines.append(f"{kind:<26} {sent:>6} {ok:>10} {failed:>16} {slow:>5} {lost:>6}  {statuses}")
    return "\n".join(lines)


async def spawn(tasks: set, sem: asyncio.Semaphore, kind: str, coro_fn, tally: Tally) -> None:
    """Run coro_fn() under the semaphore (acquired here, so arrivals wait when the client is saturated).
    A request still running when the run is torn down counts as lost (a hang)."""
    await sem.acquire()

    async def run():
        try:
            tally.add(await coro_fn())
        except asyncio.CancelledError:
            tally.add(Outcome(kind, LOST, "cancelled", "hang: still running when the run ended"))
            raise
        finally:
            sem.release()

    task = asyncio.get_running_loop().create_task(run())
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def chaos(args, stack: Stack, prompts: list[str]) -> tuple[Tally, Faults, dict]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    end = t0 + args.duration
    rng = random.Random(args.seed)
    tally = Tally()
    tasks: set[asyncio.Task] = set()
    models = ["auto", *dict.fromkeys(i["model"] for i in stack.data["instances"])]
    faults = Faults(stack, args.stall_ms, args.fault_every, args.fault_hold, args.max_faulted)
    health = {"max_s": 0.0}
    limits = httpx.Limits(max_connections=args.concurrency + 16, max_keepalive_connections=64)
    max_body = int(stack.data["server"].get("max_body_bytes", 1 << 20))

    async with (httpx.AsyncClient(base_url=stack.root, timeout=args.timeout, limits=limits,
                                  trust_env=False) as good_client,
                httpx.AsyncClient(base_url=stack.root, timeout=args.timeout, trust_env=False) as bad_client):
        bad = BadTraffic(bad_client, prompts, max_body, args.timeout, t0, rng)

        async def good() -> None:
            sem = asyncio.Semaphore(args.concurrency)
            next_at = t0
            for k in range(int(args.rate * args.duration * 1.5) + 50):  # bounded count
                next_at += rng.expovariate(args.rate)
                await asyncio.sleep(max(0.0, next_at - loop.time()))
                if loop.time() >= end:
                    return
                kind, model, prompt = GOOD_KINDS[k % 4], rng.choice(models), prompts[k % len(prompts)]
                await spawn(tasks, sem, kind, lambda kind=kind, model=model, prompt=prompt:  # noqa: B023
                            good_request(good_client, kind, model, prompt, args.timeout, t0, args.max_tokens,
                                         args.deadline), tally)

        async def bad_traffic() -> None:
            sem = asyncio.Semaphore(16)
            kinds = list(bad.kinds)
            for k in range(int(args.duration / args.bad_every) + 10):
                await asyncio.sleep(args.bad_every)
                if loop.time() >= end:
                    return
                kind = kinds[k % len(kinds)]
                await spawn(tasks, sem, kind, lambda kind=kind: bad.kinds[kind](kind), tally)  # noqa: B023

        async def probe() -> None:
            async with httpx.AsyncClient(base_url=stack.root, timeout=2.0, trust_env=False) as client:
                for _ in range(int(args.duration / 0.5) + 10):
                    if loop.time() >= end:
                        return
                    o = await send(client, "GET /health (2 s)", "GET", "/health", timeout=2.0, t0=t0, expect="ok")
                    if o.status == "200":
                        o.result, o.reason = OK, ""
                    elif o.result == OK:
                        o.result = LOST
                    health["max_s"] = max(health["max_s"], o.elapsed_s)
                    tally.add(o)
                    await asyncio.sleep(0.5)

        injector = loop.create_task(faults.run(t0, t0 + args.warmup, end - args.settle))
        drivers = [loop.create_task(c) for c in (good(), bad_traffic(), probe())]
        try:
            await asyncio.gather(*drivers)
            await injector
            if tasks:  # every request has its own deadline; this is a backstop
                await asyncio.wait(set(tasks), timeout=args.deadline + 10)
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.wait(set(tasks), timeout=5)
        finally:
            for task in (*drivers, injector):
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await injector  # its finally restores every instance

        # After the run: every instance restored; each model and `auto` must answer again.
        await asyncio.sleep(1.0)
        after = await asyncio.gather(*(good_request(good_client, "chat", model, prompts[k], args.timeout, t0,
                                                    args.max_tokens, args.deadline)
                                       for model in models for k in range(3)))
        for o in after:
            o.kind = "after restore"
            tally.add(o)
    return tally, faults, health


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of traffic")
    ap.add_argument("--rate", type=float, default=20.0, help="good requests per second (Poisson)")
    add_stack_arguments(ap, concurrency=256)
    ap.add_argument("--bad-every", type=float, default=0.5, help="seconds between two bad requests")
    ap.add_argument("--fault-every", type=float, default=3.0, help="seconds between two injected faults")
    ap.add_argument("--fault-hold", type=float, default=7.0, help="seconds a fault lasts before the restore")
    ap.add_argument("--max-faulted", type=int, default=3, help="instances faulty at once, at most")
    ap.add_argument("--stall-ms", type=float, default=5000.0, help="delay a stalled instance adds per request")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of traffic before the first fault")
    ap.add_argument("--settle", type=float, default=5.0, help="seconds of traffic after every instance is restored")
    ap.add_argument("--min-success", type=float, default=0.98,
                    help="exit 1 if fewer good requests succeed (those cut by a kill of their instance aside)")
    args = ap.parse_args()
    if not (5 <= args.duration <= 3600 and 0 < args.rate <= 500):
        ap.error("--duration must be in 5..3600 s and --rate in (0, 500]")

    workdir, config, data, stack = open_stack(args, "chaos")
    print(f"gateway {stack.root}, {len(data['instances'])} emulated instances, policy {args.policy}; "
          f"{args.duration:g} s at {args.rate:g} req/s good + 1 bad request per {args.bad_every:g} s; "
          f"a fault every {args.fault_every:g} s held {args.fault_hold:g} s (stall {args.stall_ms:g} ms), "
          f"at most {args.max_faulted} at once; a request is lost after {args.timeout:g} s without a byte, slow "
          f"after {args.deadline:g} s; good requests ask for at most {args.max_tokens} tokens", flush=True)
    try:
        prompts = held_out_prompts(config, 1000)
        took = stack.start(ready_timeout_s=600)
        before = proc_sample(stack.pid)
        print(f"stack ready in {took:.1f} s (pid {stack.pid}, RSS {before['rss_mb']:.0f} MB, {before['fds']} fds)",
              flush=True)
        started = time.monotonic()
        tally, faults, health = asyncio.run(
            asyncio.wait_for(chaos(args, stack, prompts), timeout=args.duration + 2 * args.deadline + 60))
        wall = time.monotonic() - started
        after = proc_sample(stack.pid)
        metrics = scrape_metrics(stack.root)
    except BaseException:
        print(f"kept {workdir} (config.toml, stack.log)", file=sys.stderr)
        raise
    finally:
        code = stack.stop()
    good_kinds = [*GOOD_KINDS]
    bad_kinds = list(BadTraffic(None, [], 0, 0, 0, random.Random()).kinds)  # type: ignore[arg-type]
    rows = tally.rows([*good_kinds, "after restore", *bad_kinds, "GET /health (2 s)"])
    print(f"\nran {wall:.0f} s; stack exit status {code}")
    print(format_table(rows))
    good = [o for o in tally.outcomes if o.kind in good_kinds]
    n_ok = sum(o.result == OK for o in good)
    n_lost = sum(o.result == LOST for o in tally.outcomes)
    rate = n_ok / len(good) if good else 0.0
    cut_all = [o for o in tally.outcomes if o.result == FAILED and faults.killed_during(
        o.instance or failed_instance(o.reason), o.at_s, o.at_s + o.elapsed_s)]
    cut = [o for o in cut_all if o.kind in good_kinds]
    slow = [o for o in tally.outcomes if o.result == SLOW]
    n_slow_good = sum(o.kind in good_kinds for o in slow)
    print(f"\ngood traffic: {len(good)} sent ({len(good) / args.duration:.1f} req/s of the {args.rate:g} asked), "
          f"{n_ok} succeeded ({rate:.2%}), "
          f"{sum(o.result == FAILED for o in good)} failed properly, {n_slow_good} slow, "
          f"{sum(o.result == LOST for o in good)} lost")
    # Slow answers are whole answers still arriving (reported below), not failures of the gateway.
    judged = len(good) - len(cut) - n_slow_good
    adjusted = n_ok / judged if judged > 0 else 0.0
    if cut:
        streams = sum(o.kind.endswith("stream") for o in cut)
        print(f"  {len(cut)} of the failed were on an instance killed while it answered them: {streams} streams "
              f"past their first byte (no failover is possible then: an error event ends them), "
              f"{len(cut) - streams} non-streamed whose last allowed attempt (upstream.retries) was on a killed "
              f"instance; without those (and the slow) {adjusted:.2%} succeeded")
    print(f"all traffic: {len(tally.outcomes)} requests, {n_lost} lost")
    print(f"faults: {faults.counts['down']} kills, {faults.counts['stall']} stalls, {faults.counts['error']} "
          f"error phases, each restored; port closed/reopened within "
          f"{max(faults.applied, default=0):.2f} s of the edit ({len(faults.applied)} checked"
          + (f", NOT applied: {', '.join(faults.not_applied)}" if faults.not_applied else "") + ")")
    print(f"/health: slowest answer {health['max_s'] * 1000:.0f} ms")
    print(f"gateway process (emulator + gateway, one process): RSS {before['rss_mb']:.0f} -> {after['rss_mb']:.0f} MB,"
          f" fds {before['fds']} -> {after['fds']}, threads {before['threads']} -> {after['threads']}")
    tracebacks = report_stack(stack, metrics)
    print("\nfault timeline:")
    for t, name, what in faults.events:
        print(f"  t={t:6.1f} s  {name:<16} {what}")
    lost = [o for o in tally.outcomes if o.result == LOST]
    unexpected = [o for o in tally.outcomes if o.result != LOST and o.expect != "either"
                  and (o.result == OK) != (o.expect == "ok") and o not in cut_all]
    print_outcomes("LOST", lost, 24)
    print_outcomes("SLOW (bytes still coming: reported, not lost)", slow, 24)
    print_outcomes("unexpected (not lost, but not what a correct gateway answers)", unexpected, 24)
    failed = bool(lost) or adjusted < args.min_success
    close_workdir(workdir, args.keep or failed or tracebacks > 0)
    verdict = "PASS" if not failed else "FAIL"
    print(f"\n{verdict}: {n_lost} lost, {len(slow)} slow; good traffic {rate:.2%} succeeded, {adjusted:.2%} without "
          f"the requests cut by a kill and the slow (min {args.min_success:.0%})"
          + (f"; {tracebacks} tracebacks in the stack log" if tracebacks else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    run_script(main)
