"""An OpenAI-compatible backend that answers at once: what the router comparison (peers.py) measures
routers against, so that the routers' own cost is what shows.

    python loadtest/instant_backend.py --port 8500
    python loadtest/instant_backend.py --ports 8501,8502,8503   # one process answering on each port

POST /v1/chat/completions and /v1/completions answer `--tokens` tokens ("ok "), streamed (one chunk a
token, the usage chunk when asked, [DONE]) or not, with usage; GET /health, /v1/models and a minimal
vLLM /metrics page (every router under test probes one or the other). POST /v1/traces takes OTLP/HTTP
exports and answers success (a collector that costs the gateway nothing, for routed_efficiency.py --tracing).
Loopback only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import time

import orjson
import uvloop
from aiohttp import web

MODEL = "instant"


def build(tokens: int) -> web.Application:
    usage = {"prompt_tokens": 10, "completion_tokens": tokens, "total_tokens": 10 + tokens}
    head = {"id": "instant", "created": int(time.time()), "model": MODEL}
    full_chat = orjson.dumps({**head, "object": "chat.completion", "usage": usage, "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "ok " * tokens}, "finish_reason": "stop"}]})
    full_text = orjson.dumps({**head, "object": "text_completion", "usage": usage, "choices": [
        {"index": 0, "text": "ok " * tokens, "finish_reason": "stop"}]})

    def events(chat: bool, include_usage: bool) -> bytes:
        obj = "chat.completion.chunk" if chat else "text_completion"
        out = []
        for k in range(tokens):
            last = "stop" if k == tokens - 1 else None
            choice = ({"index": 0, "delta": {"content": "ok "}, "finish_reason": last} if chat
                      else {"index": 0, "text": "ok ", "finish_reason": last})
            out.append(b"data: " + orjson.dumps({**head, "object": obj, "choices": [choice]}) + b"\n\n")
        if include_usage:
            out.append(b"data: " + orjson.dumps({**head, "object": obj, "choices": [], "usage": usage}) + b"\n\n")
        return b"".join(out) + b"data: [DONE]\n\n"

    streams = {(chat, asked): events(chat, asked) for chat in (True, False) for asked in (True, False)}

    async def complete(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        chat = request.path.endswith("/chat/completions")
        if not body.get("stream"):
            return web.Response(body=full_chat if chat else full_text, content_type="application/json")
        include = bool((body.get("stream_options") or {}).get("include_usage"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        await resp.write(streams[(chat, include)])
        await resp.write_eof()
        return resp

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "peers"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        page = (f'vllm:num_requests_running{{model_name="{MODEL}"}} 0\n'
                f'vllm:num_requests_waiting{{model_name="{MODEL}"}} 0\n')
        return web.Response(text=page, content_type="text/plain")

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(body=b"", content_type="application/x-protobuf")  # an empty export response: success

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_post("/v1/completions", complete)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=8500)
    parser.add_argument("--ports", help="comma-separated ports to answer on instead of --port (a pool's instances)")
    parser.add_argument("--tokens", type=int, default=8, help="answer length in tokens (stream chunks)")
    args = parser.parse_args()
    ports = [int(p) for p in args.ports.split(",")] if args.ports else [args.port]
    uvloop.run(serve(build(args.tokens), ports))


async def serve(app: web.Application, ports: list[int]) -> None:
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    for port in ports:
        await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()


if __name__ == "__main__":
    main()
