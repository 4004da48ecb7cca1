"""Forward one request to its instance and relay the answer to the client.

Streams pass through as bytes: only the events that carry `usage` are parsed,
to cost the request and to drop the usage chunk again when the client did not
ask for it (the gateway always asks upstream, so every request is costed).

A stream with a cost budget is the exception: upstream is asked for running
usage in every chunk (vLLM's continuous_usage_stats), every event is parsed,
and the stream is stopped before the chunk that would overspend. The max_tokens
clamp at dispatch already bounds the answer; this holds the budget against an
instance that does not honour it and against an undercounted prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import aiohttp
import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.api.sse import DONE, EVENT_END, SSE_HEADERS, json_event
from gateway.scheduling.budget import per_token, predicted_cost, within_budget

STREAM_HEADERS = {**SSE_HEADERS, "X-Accel-Buffering": "no"}  # and no buffering in a proxy in front
# Compressed answers would have to be inflated to be costed and re-framed: ask for none.
UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
MAX_EVENT_BYTES = 1 << 20  # an SSE event larger than this is a broken upstream, not an answer
LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
CLIENT_CLOSED = 499  # status recorded for a stream whose client left before the end (nginx's convention)


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
    budget_exhausted: bool = False  # the stream was stopped because its next chunk would overspend


@dataclass(frozen=True, slots=True)
class StreamBudget:
    """What a streamed request may cost on its instance (prices in USD per token)."""

    budget_usd: float
    price_in: float
    price_out: float
    prompt_tokens: int = 0  # the gateway's own count, costed until the instance reports its count

    @classmethod
    def for_instance(cls, budget_usd: float, instance, prompt_tokens: int = 0) -> StreamBudget:
        return cls(budget_usd, per_token(instance.price_input_per_mtok), per_token(instance.price_output_per_mtok),
                   prompt_tokens)


def _count(usage: dict, key: str) -> int:
    v = usage.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def record_usage(usage: dict, instance, result: RelayResult) -> None:
    """Cost a request from the instance's own token counts (malformed counts count as 0)."""
    result.prompt_tokens = _count(usage, "prompt_tokens")
    result.completion_tokens = _count(usage, "completion_tokens")
    result.cost_usd = usage["cost_usd"] = predicted_cost(result.prompt_tokens, result.completion_tokens,
                                                         per_token(instance.price_input_per_mtok),
                                                         per_token(instance.price_output_per_mtok))


def upstream_payload(req: CompletionRequest, instance, max_tokens: int | None = None,
                     continuous_usage: bool = False) -> bytes:
    """The body for the instance. `max_tokens` (the budget clamp) replaces the client's
    limit in the field the client used; `continuous_usage` asks for running usage
    in every streamed chunk, which a budgeted stream is metered by."""
    body = dict(req.body)
    body["model"] = instance.model
    if max_tokens is not None:
        for key in [k for k in LIMIT_KEYS if k in body] or ["max_tokens"]:
            body[key] = max_tokens
    if req.stream:
        options = dict(body.get("stream_options") or {})
        options["include_usage"] = True
        if continuous_usage:
            options["continuous_usage_stats"] = True
        body["stream_options"] = options
    return orjson.dumps(body)


def asks_continuous_usage(req: CompletionRequest) -> bool:
    """The client itself wants running usage in every chunk (vLLM honours it only with include_usage)."""
    options = req.body.get("stream_options")
    return req.include_usage and isinstance(options, dict) and options.get("continuous_usage_stats") is True


async def open_upstream(session: aiohttp.ClientSession, instance, path: str, payload: bytes,
                        timeout: aiohttp.ClientTimeout) -> aiohttp.ClientResponse:
    """POST to the instance. Raises UpstreamFailed on connect errors, timeouts and 5xx answers."""
    try:
        resp = await session.post(instance.url + path, data=payload, timeout=timeout, headers=UPSTREAM_HEADERS)
    except aiohttp.ConnectionTimeoutError:
        raise UpstreamFailed(502, f"instance {instance.name} is unreachable: connect timeout",
                             unreachable=True) from None
    except TimeoutError:  # it accepted the request and then took too long: do not pile it on another
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
    except (TimeoutError, orjson.JSONDecodeError, aiohttp.ClientError):
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
    except TimeoutError:
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


def _event_json(event: bytes) -> dict | None:
    """The JSON object an SSE event carries; None for [DONE], comments and anything unparsable."""
    start = event.find(b"data:")
    if start < 0:
        return None
    try:
        data = orjson.loads(event[start + 5:])
    except orjson.JSONDecodeError:
        return None
    return data if isinstance(data, dict) else None


def _rewrite_usage_events(block: bytes, instance, include_usage: bool, result: RelayResult) -> bytes:
    """Cost the events that carry usage; keep them (with cost_usd) only if the client asked."""
    out = []
    for event in block.split(EVENT_END):
        if not event:
            continue
        if b'"usage":{' in event or b'"usage": {' in event:
            data = _event_json(event)
            if data is None:
                out.append(event + EVENT_END)
                continue
            usage = data.get("usage")
            if isinstance(usage, dict):
                record_usage(usage, instance, result)
                if not data.get("choices") and not include_usage:
                    continue  # the usage-only chunk the client never asked for
                if not include_usage:
                    data["usage"] = None
                out.append(json_event(data))
                continue
        out.append(event + EVENT_END)
    return b"".join(out)


def _has_output(choice) -> bool:
    if not isinstance(choice, dict):
        return False
    delta = choice.get("delta")
    if isinstance(delta, dict):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("tool_calls"))
    return bool(choice.get("text"))


def _index(choice) -> int:
    i = choice.get("index") if isinstance(choice, dict) else None
    return i if isinstance(i, int) else 0


class _BudgetMeter:
    """Meters a budgeted stream event by event, from the running usage each chunk
    carries; a chunk without usage counts one token per choice that has output.
    The counts it holds are those delivered to the client."""

    def __init__(self, budget: StreamBudget, instance, include_usage: bool, continuous_usage: bool,
                 result: RelayResult):
        self.budget, self.instance, self.result = budget, instance, result
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage  # the client asked for running usage itself
        self.prompt, self.completion = budget.prompt_tokens, 0
        self.open: set[int] = set()  # choices begun and not yet finished
        self.head: dict = {}  # id, object, created, model of the stream's chunks

    def _cost(self, prompt: int, completion: int) -> float:
        return predicted_cost(prompt, completion, self.budget.price_in, self.budget.price_out)

    def pass_block(self, block: bytes) -> tuple[bytes, bool]:
        """The events to send, and whether the budget stops the stream after them."""
        out = []
        for event in block.split(EVENT_END):
            if not event:
                continue
            data = _event_json(event)
            choices = data.get("choices") if data is not None else None
            usage = data.get("usage") if data is not None else None
            usage = usage if isinstance(usage, dict) else None
            if not choices or not isinstance(choices, list):
                if usage is not None:  # the final usage-only chunk: the instance's own count is the truth
                    record_usage(usage, self.instance, self.result)
                    if not self.include_usage:
                        continue
                    out.append(json_event(data))
                    continue
                out.append(event + EVENT_END)  # [DONE], error objects, comments: as they came
                continue
            self.head = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
            if usage is not None:
                prompt, completion = _count(usage, "prompt_tokens") or self.prompt, _count(usage, "completion_tokens")
            else:
                prompt, completion = self.prompt, self.completion + sum(map(_has_output, choices))
            self.prompt = prompt  # the input is spent whether or not this chunk goes out
            if not within_budget(self._cost(prompt, completion), self.budget.budget_usd):
                self.open.update(_index(c) for c in choices)  # withheld, so still open for the client
                self._settle()
                return b"".join(out), True
            self.completion = completion
            for c in choices:
                (self.open.discard if isinstance(c, dict) and c.get("finish_reason") else self.open.add)(_index(c))
            self._settle()
            if usage is not None:
                if self.continuous_usage:
                    usage["cost_usd"] = self.result.cost_usd
                else:
                    data["usage"] = None  # running usage the client never asked for
                out.append(json_event(data))
            else:
                out.append(event + EVENT_END)
        return b"".join(out), False

    def _settle(self) -> None:
        self.result.prompt_tokens, self.result.completion_tokens = self.prompt, self.completion
        self.result.cost_usd = self._cost(self.prompt, self.completion)

    def closing(self) -> bytes:
        """What the client gets instead of the chunk that would overspend: every open
        choice ends with "length", a budget marker, the usage if asked, then [DONE]."""
        self.result.budget_exhausted = True
        chat = self.head.get("object") != "text_completion"
        ends = [{"index": i, **({"delta": {}} if chat else {"text": ""}), "logprobs": None, "finish_reason": "length"}
                for i in sorted(self.open or {0})]
        marker = {"budget_exhausted": True, "budget_usd": self.budget.budget_usd, "cost_usd": self.result.cost_usd}
        out = json_event({**self.head, "choices": ends, "routebalance": marker})
        if self.include_usage:
            usage = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                     "total_tokens": self.prompt + self.completion, "cost_usd": self.result.cost_usd}
            out += json_event({**self.head, "choices": [], "usage": usage})
        return out + DONE


def _delivered(block: bytes) -> bool:
    """The last block handled ended the stream ([DONE] went out, or upstream had nothing more)."""
    return not block or b"[DONE]" in block


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
                       include_usage: bool, result: RelayResult, budget: StreamBudget | None = None,
                       continuous_usage: bool = False, headers: Mapping[str, str] | None = None,
                       on_progress: Callable[[int], None] | None = None) -> web.StreamResponse:
    """Pass SSE events through. Nothing is sent to the client until the first event
    has arrived, so an instance that fails before it can still be retried elsewhere.
    A client that goes away closes the upstream connection, which makes vLLM abort;
    so does a budget that the next chunk would exceed (upstream_payload must have
    asked for continuous usage). `continuous_usage`: the client asked for running
    usage itself, so a budgeted stream keeps it in the chunks. `headers` go on the
    response with the route headers (they must be known before the first byte).
    `on_progress(tokens)` hears the answer tokens streamed so far after each write:
    exact for a budgeted stream, else counted as one per event (an instance may
    pack several tokens into one, and role, usage and [DONE] events count too)."""
    loop = asyncio.get_running_loop()
    events = _EventReader(upstream)

    if budget is None:
        def framed(block: bytes) -> tuple[bytes, bool]:
            if b'"usage"' not in block:  # the fast path: bytes through untouched
                return block, False
            return _rewrite_usage_events(block, instance, include_usage, result), False
    else:
        meter = _BudgetMeter(budget, instance, include_usage, continuous_usage, result)
        framed = meter.pass_block

    try:
        try:
            first = await events.next_block()
        except TimeoutError:
            raise UpstreamFailed(504, f"instance {instance.name} sent no event in time", retry=False) from None
        except aiohttp.ClientError as e:
            raise UpstreamFailed(502, f"instance {instance.name} broke off: {e.__class__.__name__}") from None
        if not first:
            raise UpstreamFailed(502, f"instance {instance.name} closed the stream without an event")
        resp = web.StreamResponse(headers={**STREAM_HEADERS, **route_headers(instance), **(headers or {})})
        await resp.prepare(request)
        result.first_byte_s = loop.time()
        block = first
        streamed = 0
        try:
            while block:
                out, stop = framed(block)
                if out:
                    await resp.write(out)
                if on_progress is not None:
                    streamed = result.completion_tokens if budget else streamed + block.count(b"data:")
                    on_progress(streamed)
                if stop:
                    upstream.close()  # before telling the client: the instance stops generating now
                    await resp.write(meter.closing())
                    break
                try:
                    block = await events.next_block()
                except (TimeoutError, aiohttp.ClientError) as e:
                    # After the first byte there is no retry: end the stream with an error event.
                    failure = ApiError(504 if isinstance(e, TimeoutError) else 502,
                                       f"instance {instance.name} broke off the stream: {e.__class__.__name__}")
                    result.failed_status = failure.status
                    await resp.write(json_event(failure.body()))
                    break
            await resp.write_eof()
        except ConnectionResetError:
            # The client left. After [DONE] that is normal (SDKs hang up at once) and the
            # answer was delivered; before it, closing upstream (below) makes vLLM abort.
            if not result.failed_status and not _delivered(block):
                result.failed_status = CLIENT_CLOSED
        return resp
    finally:
        upstream.close()
