"""What every endpoint of an emulated vLLM instance does alike: its error objects, and the start of a request
(the instance's injected faults, then a body that must be a JSON object; the embedding server has no faults)."""

from __future__ import annotations

import asyncio

import orjson
from aiohttp import web


def error(status: int, message: str, err_type: str = "BadRequestError", param: str | None = None) -> web.Response:
    """An error as vLLM's OpenAI server answers it."""
    body = {"error": {"message": message, "type": err_type, "param": param, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def faulted_or_body(request: web.Request, inst) -> dict | web.Response:
    """The request's JSON object, after the instance's injected latency; or the answer that ends it here: an
    injected fault (500) or a body that is not a JSON object (400)."""
    if inst.faults.added_latency_ms:
        await asyncio.sleep(inst.faults.added_latency_ms / 1000)
    if inst.should_fail():
        return error(500, "injected fault", "InternalServerError")
    return await json_object(request)


async def json_object(request: web.Request) -> dict | web.Response:
    """The request's body as a JSON object, or the 400 that answers a body which is not one."""
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        return error(400, "body is not valid JSON")
    if not isinstance(body, dict):
        return error(400, "body must be a JSON object")
    return body
