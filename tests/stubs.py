"""Programmable OpenAI-compatible upstreams on loopback, and a gateway in front of them.

Each stub answers as its `mode` says, so a test can make one instance fail,
stall, cut its stream, send no usage or an enormous answer, while the gateway
under test is the real one (started as `routebalance serve` starts it).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass, field
from pathlib import Path

import orjson
import uvloop
from aiohttp import web

from conftest import Stack, dump_toml, free_port
from gateway.tokens import TokenCounter

MODEL = "Qwen/Qwen2.5-7B-Instruct"
TOKEN = " w"  # one Qwen2.5 token: the stub's answers are this, repeated
COUNTER = TokenCounter()
_IDS = itertools.count(1)  # completion ids, unique as a server's are (feedback names a completion by its id)


async def serve(app: web.Application, port: int) -> web.AppRunner:
    """`app` listening on loopback `port`: its runner, for `close`."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner


async def close(runner: web.AppRunner | None) -> None:
    if runner is not None:
        await runner.cleanup()


@dataclass
class Stub:
    """One upstream instance. `mode` keys (all optional):
    status   answer every completion with this HTTP status (e.g. 500, 404)
    usage    False: send no usage, in full answers or streams (as llama.cpp streams)
    tokens   answer length in tokens when the request sets no max_tokens (default 20)
    stop     the answer ends ("stop") after this many tokens, whatever max_tokens allows
    huge     a non-streamed answer of this many bytes
    cut      a stream that closes after this many token events, with no end
    delay_s  wait this long before answering
    """

    port: int = field(default_factory=free_port)
    mode: dict = field(default_factory=dict)
    requests: list = field(default_factory=list)  # (headers, body) of each completion request
    runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application(client_max_size=1 << 26)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._chat)
        self.runner = await serve(app, self.port)

    async def stop(self) -> None:
        await close(self.runner)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        mode = self.mode
        if mode.get("delay_s"):
            await asyncio.sleep(mode["delay_s"])
        if mode.get("status"):
            return web.json_response({"error": {"message": "stub failure", "type": "stub"}}, status=mode["status"])
        if mode.get("huge"):
            return web.Response(body=b'{"pad": "' + b"x" * mode["huge"] + b'"}', content_type="application/json")
        n = body.get("n") or 1
        tokens = body.get("max_tokens") or body.get("max_completion_tokens") or mode.get("tokens", 20)
        cut_short = mode.get("stop") is not None and mode["stop"] < tokens
        tokens = min(tokens, mode["stop"]) if cut_short else tokens
        last = "stop" if cut_short else "length"
        prompt = COUNTER.count_chat(body["messages"], body.get("tools") or ()) if "messages" in body else 10
        usage = {"prompt_tokens": prompt, "completion_tokens": tokens * n, "total_tokens": prompt + tokens * n}
        send_usage = mode.get("usage", True)
        rid = f"chatcmpl-stub-{next(_IDS)}"
        if not body.get("stream"):
            choices = [{"index": i, "message": {"role": "assistant", "content": TOKEN * tokens},
                        "finish_reason": last} for i in range(n)]
            answer = {"id": rid, "object": "chat.completion", "created": 1, "model": body["model"],
                      "choices": choices, **({"usage": usage} if send_usage else {})}
            return web.json_response(answer)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": rid, "object": "chat.completion.chunk", "created": 1, "model": body["model"]}
        for k in range(tokens):
            if mode.get("cut") is not None and k == mode["cut"]:
                request.transport.close()  # the instance dies mid-answer
                return resp
            reason = last if k == tokens - 1 else None
            choices = [{"index": i, "delta": {"content": TOKEN}, "finish_reason": reason} for i in range(n)]
            await resp.write(_event({**head, "choices": choices}))
        if send_usage and (body.get("stream_options") or {}).get("include_usage"):
            await resp.write(_event({**head, "choices": [], "usage": usage}))
        await resp.write(b"data: [DONE]\n\n")
        return resp


def _event(data: dict) -> bytes:
    return b"data: " + orjson.dumps(data) + b"\n\n"


def stub_instance(stub: Stub, name: str, **overrides) -> dict:
    return {"name": name, "url": stub.url, "model": MODEL, "gpu": "A30-24GB", "price_input_per_mtok": 0.2,
            "price_output_per_mtok": 0.4, "tpot_prior_ms": 20.0, **overrides}


def stub_config(tmp: Path, stubs: list[Stub], instances: list[dict] | None = None, **sections) -> Path:
    """A config of the stubs (passthrough+round_robin: no estimators needed) with `sections` merged in."""
    data: dict = {"server": {"port": free_port(), "config_watch_interval_s": 0.2},
                  "learning": {"path": str(tmp / "labels.db")},
                  "scheduler": {"policy": "passthrough+round_robin"},
                  "telemetry": {"scrape_interval_s": 60.0, "stale_after_s": 120.0},
                  "instances": instances or [stub_instance(s, f"stub-{k}") for k, s in enumerate(stubs)]}
    for section, values in sections.items():
        data.setdefault(section, {}).update(values)
    path = tmp / "config.toml"
    path.write_text(dump_toml(data))
    return path


class StubStack(Stack):
    """The real gateway (no emulator) in front of stubs started on its loop."""

    def __init__(self, config_path: Path, stubs: list[Stub]):
        self.stubs = stubs
        self._pending = stubs
        super().__init__(config_path, emulate=False)

    async def _start(self):
        for stub in self._pending:
            await stub.start()
        return await super()._start()

    def stop(self) -> None:
        async def stop_stubs():
            for stub in self.stubs:
                await stub.stop()
        self.call(stop_stubs())
        super().stop()


class LoopThread:
    """An event loop in a background thread, for servers the test talks to from its own thread."""

    def __init__(self):
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class StubJudge:
    """An OpenAI-compatible judge on loopback: answers every chat completion with `reply` (or `status`, after
    `delay_s`), and keeps each request's headers and body."""

    def __init__(self, reply: str = "Score: 0.8", status: int = 200, delay_s: float = 0.0):
        self.reply, self.status, self.delay_s = reply, status, delay_s
        self.port = free_port()
        self.requests: list[tuple[dict, dict]] = []
        self.runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/chat/completions", self._chat)
        self.runner = await serve(app, self.port)

    async def stop(self) -> None:
        await close(self.runner)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        await asyncio.sleep(self.delay_s)
        if self.status != 200:
            return web.json_response({"error": {"message": "judge down"}}, status=self.status)
        return web.json_response({"id": "j", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "finish_reason": "stop",
                                               "message": {"role": "assistant", "content": self.reply}}]})
