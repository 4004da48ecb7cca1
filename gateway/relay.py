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
# Compressed answers would have to be inflated to be costed and re-framed: ask for none.
UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
EVENT_END = b"\n\n"
MAX_EVENT_BYTES = 1 << 20  # an SSE event larger than this is a broken upstream, not an answer


class UpstreamFailed(Exception):
    """The instance failed before any byte reached the client."""

    def __init__(self, status: int, message: str, *, retry: bool = True, unreachable: bool = False):
        super().__init__(message)
        self.status = status  # what the client gets if no retry succeeds: 502 or 504
        self.retry = retry  # worth trying another instance (false once an instance has spent time on it)
        self.unreachable = unreachable  # a transport failure: skip the instance for a while


@dataclass(slots=True)
class RelayResult:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    first_byte_s: float | None = None  # loop time when the first answer byte went out
    failed_status: int | None = None  # the stream broke after its first byte (client told by an error event)


def _count(usage: dict, key: str) -> int:
    v = usage.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def record_usage(usage: dict, instance, result: "RelayResult") -> None:
    """Cost a request from the instance's own token counts (malformed counts count as 0)."""
    result.prompt_tokens = _count(usage, "prompt_tokens")
    result.completion_tokens = _count(usage, "completion_tokens")
    result.cost_usd = usage["cost_usd"] = (result.prompt_tokens * instance.price_input_per_mtok
                                           + result.completion_tokens * instance.price_output_per_mtok) / 1e6


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
        resp = await session.post(instance.url + path, data=payload, timeout=timeout, headers=UPSTREAM_HEADERS)
    except aiohttp.ConnectionTimeoutError:
        raise UpstreamFailed(502, f"instance {instance.name} is unreachable: connect timeout", unreachable=True) from None
    except asyncio.TimeoutError:  # it accepted the request and then took too long: do not pile it on another
        raise UpstreamFailed(504, f"instance {instance.name} did not answer in time", retry=False) from None
    except aiohttp.ClientConnectionError as e:  # refused, reset, disconnected: the transport failed
        raise UpstreamFailed(502, f"instance {instance.name} is unreachable: {e.__class__.__name__}",
                             unreachable=True) from None
    except aiohttp.ClientError as e:
        raise UpstreamFailed(502, f"instance {instance.name} failed: {e.__class__.__name__}") from None
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
        raise UpstreamFailed(504, f"instance {instance.name} stalled", retry=False) from None
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
        record_usage(usage, instance, result)
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
                record_usage(usage, instance, result)
                if not data.get("choices") and not include_usage:
                    continue  # the usage-only chunk the client never asked for
                if not include_usage:
                    data["usage"] = None
                event = b"data: " + orjson.dumps(data)
        out.append(event)
    return EVENT_END.join(out) + EVENT_END if out else b""


class _EventReader:
    """Complete SSE events from an upstream body, whatever its chunking and line endings."""

    def __init__(self, upstream: aiohttp.ClientResponse):
        self.chunks = upstream.content.iter_any().__aiter__()
        self.pending = b""
        self.eof = False

    async def next_block(self) -> bytes:
        """All complete events available after the next chunk; b"" at the end (with any unframed tail)."""
        while not self.eof:
            try:
                chunk = await self.chunks.__anext__()
            except StopAsyncIteration:
                self.eof = True
                break
            self.pending += chunk
            if b"\r" in chunk:  # CRLF framing (valid SSE): normalise so events end in a blank line
                self.pending = self.pending.replace(b"\r\n", b"\n")
            cut = self.pending.rfind(EVENT_END)
            if cut >= 0:
                block, self.pending = self.pending[:cut + 2], self.pending[cut + 2:]
                return block
            if len(self.pending) > MAX_EVENT_BYTES:
                raise aiohttp.ClientPayloadError("upstream SSE event too large")
        tail, self.pending = self.pending.strip(), b""
        return tail + EVENT_END if tail else b""


async def relay_stream(request: web.Request, upstream: aiohttp.ClientResponse, instance,
                       include_usage: bool, result: RelayResult) -> web.StreamResponse:
    """Pass SSE events through. Nothing is sent to the client until the first event
    has arrived, so an instance that fails before it can still be retried elsewhere.
    A client that goes away closes the upstream connection, which makes vLLM abort."""
    loop = asyncio.get_running_loop()
    events = _EventReader(upstream)

    def framed(block: bytes) -> bytes:
        return _rewrite_usage_events(block, instance, include_usage, result) if b'"usage"' in block else block

    try:
        try:
            first = await events.next_block()
        except asyncio.TimeoutError:
            raise UpstreamFailed(504, f"instance {instance.name} sent no event in time", retry=False) from None
        except aiohttp.ClientError as e:
            raise UpstreamFailed(502, f"instance {instance.name} broke off: {e.__class__.__name__}") from None
        if not first:
            raise UpstreamFailed(502, f"instance {instance.name} closed the stream without an event")
        resp = web.StreamResponse(headers={**SSE_HEADERS, **route_headers(instance)})
        await resp.prepare(request)
        result.first_byte_s = loop.time()
        block = first
        try:
            while block:
                out = framed(block)
                if out:
                    await resp.write(out)
                block = await events.next_block()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            # After the first byte there is no retry: end the stream with an error event.
            failure = ApiError(504 if isinstance(e, asyncio.TimeoutError) else 502,
                               f"instance {instance.name} broke off the stream: {e.__class__.__name__}")
            await resp.write(b"data: " + orjson.dumps(failure.body()) + EVENT_END)
            result.failed_status = failure.status
        await resp.write_eof()
        return resp
    finally:
        upstream.close()
