"""What `up` answers while it builds the estimators (minutes on a first start): the port listens at once.

/health is 200 with the build's progress (liveness: the process is working), /health/ready is 503
(nothing can be routed yet), and every other request gets an OpenAI-shaped 503 that says so, with
Retry-After. The real gateway takes the port as soon as the build is done.
"""

from __future__ import annotations

from collections.abc import Callable

import orjson
from aiohttp import web

from gateway.api.errors import ApiError

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

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/health/ready", ready)
    app.router.add_route("*", "/{tail:.*}", anything)
    return app


async def listen_while_building(host: str, port: int, progress: Callable[[], dict]) -> web.AppRunner:
    """Listen on host:port with the placeholder; the caller cleans the runner up before the gateway listens."""
    runner = web.AppRunner(building_app(progress), access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, reuse_address=True).start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner
