"""Forward one request to its instance and relay the answer to the client.

Streams pass through as bytes: only the events that carry `usage` are parsed,
to cost the request and to drop the usage chunk again when the client did not
ask for it (the gateway always asks upstream, so every request is costed).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest

SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
EVENT_END = b"\n\n"


class UpstreamFailed(Exception):
    """The instance failed before any byte reached the client: another instance may be tried."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status  # what the client gets if no retry succeeds: 502, 503 or 504


@dataclass(slots=True)
class RelayResult:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    first_byte_s: float | None = None  # loop time when the first answer byte went out
    failed_status: int | None = None  # the stream broke after its first byte (client told by an error event)


def cost_of(usage: dict, instance) -> float:
    return (usage.get("prompt_tokens", 0) * instance.price_input_per_mtok
            + usage.get("completion_tokens", 0) * instance.price_output_per_mtok) / 1e6


def upstream_payload(req: CompletionRequest, instance) -> bytes:
    body = dict(req.body)
    body["model"] = instance.model
    if req.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        body["stream_options"] = options
    return orjson.dumps(body)


async def open_upstream(session: aiohttp.ClientSession, instance, path: str, payload: bytes,
                        timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
    """POST to the instance. Raises UpstreamFailed on connect errors, timeouts and 5xx answers."""
    try:
        resp = await session.post(instance.url + path, data=payload, timeout=timeout,
                                  headers={"Content-Type": "application/json"})
    except asyncio.TimeoutError:
        raise UpstreamFailed(504, f"instance {instance.name} did not answer in time") from None
    except aiohttp.ClientError as e:
        raise UpstreamFailed(502, f"instance {instance.name} is unreachable: {e.__class__.__name__}") from None
    if resp.status >= 500:
        resp.close()
        raise UpstreamFailed(502, f"instance {instance.name} failed with status {resp.status}")
    return resp


async def client_error(resp: aiohttp.ClientResponse) -> ApiError:
    """A 4xx from the instance, passed on in OpenAI's shape."""
    try:
        data = orjson.loads(await resp.read())
        err = data.get("error", data) if isinstance(data, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
    except (orjson.JSONDecodeError, aiohttp.ClientError, asyncio.TimeoutError):
        message, param = None, None
    finally:
        resp.close()
    status = resp.status if resp.status in (400, 404, 413, 422, 429) else 400
    return ApiError(status, message or f"instance rejected the request (status {resp.status})", param)


def route_headers(instance) -> dict[str, str]:
    return {"X-Route-Instance": instance.name, "X-Route-Model": instance.model}


async def relay_full(upstream: aiohttp.ClientResponse, instance, result: RelayResult) -> web.Response:
    try:
        raw = await upstream.read()  # a complete read hands the connection back to the pool
    except asyncio.TimeoutError:
        raise UpstreamFailed(504, f"instance {instance.name} stalled") from None
    except aiohttp.ClientError as e:
        raise UpstreamFailed(502, f"instance {instance.name} broke off: {e.__class__.__name__}") from None
    finally:
        if not upstream.content.is_eof():
            upstream.close()  # cancelled or failed mid-body: drop the connection so the instance aborts
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamFailed(502, f"instance {instance.name} sent invalid JSON") from None
    headers = route_headers(instance)
    usage = data.get("usage") if isinstance(data, dict) else None
    if isinstance(usage, dict):
        result.prompt_tokens = usage.get("prompt_tokens", 0)
        result.completion_tokens = usage.get("completion_tokens", 0)
        result.cost_usd = usage["cost_usd"] = cost_of(usage, instance)
        headers["X-Route-Cost-USD"] = f"{result.cost_usd:.10f}"
    return web.Response(body=orjson.dumps(data), content_type="application/json", headers=headers)


def _rewrite_usage_events(block: bytes, instance, include_usage: bool, result: RelayResult) -> bytes:
    """Cost the events that carry usage; keep them (with cost_usd) only if the client asked."""
    out = []
    for event in block.split(EVENT_END):
        if not event:
            continue
        if b'"usage":{' in event or b'"usage": {' in event:
            try:
                data = orjson.loads(event[event.index(b"data:") + 5:])
            except (ValueError, orjson.JSONDecodeError):
                out.append(event)
                continue
            usage = data.get("usage")
            if isinstance(usage, dict):
                result.prompt_tokens = usage.get("prompt_tokens", 0)
                result.completion_tokens = usage.get("completion_tokens", 0)
                result.cost_usd = usage["cost_usd"] = cost_of(usage, instance)
                if not data.get("choices") and not include_usage:
                    continue  # the usage-only chunk the client never asked for
                if not include_usage:
                    data["usage"] = None
                event = b"data: " + orjson.dumps(data)
        out.append(event)
    return EVENT_END.join(out) + EVENT_END if out else b""


async def relay_stream(request: web.Request, upstream: aiohttp.ClientResponse, instance,
                       include_usage: bool, result: RelayResult) -> web.StreamResponse:
    """Pass SSE events through. A client that goes away closes the upstream connection,
    which makes vLLM abort the request."""
    loop = asyncio.get_running_loop()
    resp = web.StreamResponse(headers={**SSE_HEADERS, **route_headers(instance)})
    pending = b""
    try:
        await resp.prepare(request)
        try:
            async for chunk in upstream.content.iter_any():
                pending += chunk
                cut = pending.rfind(EVENT_END)
                if cut < 0:
                    continue
                ready, pending = pending[:cut + 2], pending[cut + 2:]
                if b'"usage"' in ready:
                    ready = _rewrite_usage_events(ready, instance, include_usage, result)
                    if not ready:
                        continue
                if result.first_byte_s is None:
                    result.first_byte_s = loop.time()
                await resp.write(ready)
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # After the first byte there is no retry: end the stream with an error event.
            failure = ApiError(504 if isinstance(e, asyncio.TimeoutError) else 502,
                               f"instance {instance.name} broke off the stream: {e.__class__.__name__}")
            await resp.write(b"data: " + orjson.dumps(failure.body()) + EVENT_END)
            result.failed_status = failure.status
        else:
            if pending.strip():
                await resp.write(pending)
        await resp.write_eof()
        return resp
    finally:
        upstream.close()

