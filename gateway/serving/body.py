"""Reading a request's body within its bounds: the completions' and the feedback's."""

from __future__ import annotations

import asyncio

from aiohttp import web

from gateway.api.errors import ApiError


async def read_body(request: web.Request, limit: int, timeout_s: float) -> bytes:
    """The request body, refused with 413 past `limit` and 408 when it takes longer than
    `timeout_s` to arrive (read per request, so a reload applies)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body too large (limit {limit} bytes)")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            while chunk := await request.content.read(65536):
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body too large (limit {limit} bytes)")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout_s:g} s") from None
    return b"".join(chunks)
