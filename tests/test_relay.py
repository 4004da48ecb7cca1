"""The relay against hand-written upstreams: framing, usage, retries before the first byte."""

from __future__ import annotations

import asyncio
import tomllib

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from conftest import Stack, dump_toml, free_port, wait_for
from gateway.config.store import default_config_path

MODEL = "Qwen/Qwen2.5-3B-Instruct"


def chunk(text: str | None = None, usage: dict | None = None, reason: str | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "delta": {"content": text}, "finish_reason": reason}]
    return {"id": "c1", "object": "chat.completion.chunk", "created": 1, "model": MODEL, "choices": choices,
            **({"usage": usage} if usage else {})}


async def crlf_stream(request: web.Request) -> web.StreamResponse:
    """A valid SSE upstream that frames events with CRLF and splits them across writes."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    events = [chunk("Hello"), chunk(" world", reason="stop"),
              chunk(usage={"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12})]
    wire = b"".join(b"data: " + orjson.dumps(e) + b"\r\n\r\n" for e in events) + b"data: [DONE]\r\n\r\n"
    for i in range(0, len(wire), 7):  # 7-byte pieces: no event arrives whole
        await resp.write(wire[i:i + 7])
        await asyncio.sleep(0)
    await resp.write_eof()
    return resp


async def headers_then_close(request: web.Request) -> web.StreamResponse:
    """Sends 200 and headers, then dies before the first event (a crash during prefill)."""
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    request.transport.close()
    return resp


def fake_upstream(handler, port: int) -> web.AppRunner:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    return web.AppRunner(app)


@pytest.fixture(scope="module")
def gateway_over_fakes(tmp_path_factory):
    data = tomllib.loads(default_config_path().read_text())
    template = next(i for i in data["instances"] if i["model"] == MODEL)
    ports = [free_port(), free_port()]
    data["instances"] = [{**template, "name": f"fake-{n}", "url": f"http://127.0.0.1:{p}"}
                         for n, p in zip(("broken", "crlf"), ports, strict=True)]
    data["server"]["port"] = free_port()
    data["scheduler"]["policy"] = "passthrough+round_robin"  # these tests are about the relay, not routing
    path = tmp_path_factory.mktemp("fakes") / "config.toml"
    path.write_text(dump_toml(data))
    stack = Stack(path, emulate=False)
    runners = [fake_upstream(headers_then_close, ports[0]), fake_upstream(crlf_stream, ports[1])]

    async def start():
        for runner, port in zip(runners, ports, strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()

    stack.call(start())
    stack.wait_routable()
    yield stack
    async def stop():
        for runner in runners:
            await runner.cleanup()

    stack.call(stop())
    stack.stop()


def test_crlf_framed_stream_is_relayed_and_costed_and_usage_hidden(gateway_over_fakes):
    client = openai.OpenAI(base_url=gateway_over_fakes.base_url, api_key="x", max_retries=0, timeout=10)
    # Round robin puts request 1 on the broken instance first: it fails (its first request
    # after the start-up scrape found it refusing, so one failure cools it down again) and
    # is retried on crlf; requests 2 and 3 go to crlf while broken cools down.
    for _ in range(3):
        chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                     stream=True))
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello world"
        assert all(c.choices for c in chunks)  # the usage-only chunk was not asked for
    # The client has [DONE] a moment before the handler books the last answer's tokens: wait for it.
    tokens = 'routebalance_tokens_total{kind="completion",model="Qwen/Qwen2.5-3B-Instruct"} 6.0'
    wait_for(lambda: tokens in httpx.get(gateway_over_fakes.root + "/metrics").text, timeout=5,
             what="the third answer's tokens in /metrics")
    metrics = httpx.get(gateway_over_fakes.root + "/metrics").text
    assert 'routebalance_upstream_retries_total{instance="fake-crlf"} 1.0' in metrics


def test_usage_is_passed_with_cost_when_asked(gateway_over_fakes):
    client = openai.OpenAI(base_url=gateway_over_fakes.base_url, api_key="x", max_retries=0, timeout=10)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                 stream=True, stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 2
    assert usage.model_extra["cost_usd"] == pytest.approx((10 * 0.06 + 2 * 0.06) / 1e6)
