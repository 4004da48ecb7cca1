"""What `up` answers while it builds the estimators (minutes on a first start): the port listens at once.

/health is 200 with the build's progress (liveness: the process is working), /health/ready is 503
(nothing can be routed yet), and every other request gets an OpenAI-shaped 503 that says so, with
Retry-After. The real gateway takes over the same listening socket as soon as it is ready to serve, so
a client that found the port open never finds it closed (gateway/serving/app.py, CappedListener.hand_over).
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.serving.app import CappedListener

RETRY_AFTER_S = 10


def building_app(progress: Callable[[], dict]) -> web.Application:
    """The placeholder's app; `progress()` says where the build is (phase, counts, times)."""

    def status() -> dict:
        return {"status": "building", **progress()}

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=orjson.dumps(status()), content_type="application/json")

    async def ready(request: web.Request) -> web.Response:
        return web.Response(status=503, body=orjson.dumps(status()), content_type="application/json",
                            headers={"Retry-After": str(RETRY_AFTER_S)})

    async def anything(request: web.Request) -> web.Response:
        p = progress()
        where = p["phase"] + (f" ({p['done']}/{p['total']})" if p.get("total") else "")
        return ApiError(503, f"the gateway is building its estimators ({where}, {p['elapsed_s']:.0f} s so far; a "
                             "first build takes minutes); it serves as soon as they are built", None, "building",
                        headers={"Retry-After": str(RETRY_AFTER_S)}).response()

    @web.middleware
    async def one_answer_per_connection(request: web.Request, handler) -> web.StreamResponse:
        # Connection: close on every answer, so no client keeps a connection to the placeholder that the
        # hand-over to the gateway would close under it; its next request opens one the gateway answers.
        response = await handler(request)
        response.force_close()
        return response

    app = web.Application(middlewares=[one_answer_per_connection])
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", ready)
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def listen_while_building(host: str, port: int, progress: Callable[[], dict],
                                max_connections: int) -> CappedListener:
    """Listen on host:port with the placeholder; the caller hands the listener over to the gateway
    (gateway.serving.app.listen) or cleans it up."""
    runner = web.AppRunner(building_app(progress), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    listener = CappedListener(runner, max_connections)
    try:
        await listener.start(host, port)
    except BaseException:
        await listener.cleanup()
        raise
    return listener
