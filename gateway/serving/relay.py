"""Forward one request to its instance and relay the answer to the client.

Streams pass through as bytes: only the events that carry `usage` are parsed,
to cost the request and to drop the usage chunk again when the client did not
ask for it (the gateway always asks upstream, so every request is costed).
An instance that sends no usage (llama.cpp's server, older vLLM) is costed by
counting: the gateway's own prompt count and the answer's text through the
tokenizer, marked `usage.cost_source = "counted"`. Until a stream's usage
arrives its bytes are kept (bounded by the answer size cap) for that count,
and its [DONE] is held back so the counted usage can go before it.

A stream with a cost budget is the exception: upstream is asked for running
usage in every chunk (vLLM's continuous_usage_stats), every event is parsed,
and the stream is stopped before the chunk that would overspend. The max_tokens
clamp at dispatch already bounds the answer; this holds the budget against an
instance that does not honour it and against an undercounted prompt.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

import aiohttp
import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.api.sse import DONE, EVENT_END, SSE_HEADERS, json_event
from gateway.core.budget import predicted_cost, token_prices, within_budget
from gateway.tokens import estimate_tokens

STREAM_HEADERS = {**SSE_HEADERS, "X-Accel-Buffering": "no"}  # and no buffering in a proxy in front
# Compressed answers would have to be inflated to be costed and re-framed: ask for none.
UPSTREAM_HEADERS = {"Content-Type": "application/json", "Accept-Encoding": "identity"}
MAX_EVENT_BYTES = 1 << 20  # an SSE event larger than this is a broken upstream, not an answer
LIMIT_KEYS = ("max_tokens", "max_completion_tokens")
CLIENT_CLOSED = 499  # status recorded for a stream whose client left before the end (nginx's convention)
COUNTED = "counted"  # usage.cost_source of an answer the gateway costed by counting tokens itself


Spent = Literal["nothing", "prompt", "all"]


class UpstreamFailed(Exception):
    """The instance failed before any byte reached the client.

    `retry`: worth trying another instance (not for an answer that would take as long
    or be as large anywhere). `blame`: the instance's health hears of it (not when it
    was only busy, or the request asked for too much). `unreachable`: the connection
    was refused, so it cools down at once. `spent`: what the attempt may have cost:
    nothing (it never arrived), its prompt (it was read, then the instance failed), or
    all it was allowed (it ran long or generated an answer that was lost)."""

    def __init__(self, status: int, message: str, *, retry: bool = True, blame: bool = True,
                 unreachable: bool = False, spent: Spent = "prompt", no_connection: bool = False):
        super().__init__(message)
        self.status = status  # what the client gets if no retry succeeds: 502 or 504
        self.retry, self.blame, self.unreachable, self.spent = retry, blame, unreachable, spent
        self.no_connection = no_connection  # no connection in time: its pool was full (busy), or it is unreachable

    def cost(self, costing: Costing, prompt_tokens: int, worst_usd: float) -> float:
        """What the failed attempt is paid: by what it may have spent."""
        return {"nothing": 0.0, "prompt": costing.cost(prompt_tokens, 0), "all": worst_usd}[self.spent]


class AnswerTooLarge(Exception):
    """The instance's answer passed the configured size cap."""


@dataclass(frozen=True, slots=True)
class Costing:
    """How an answer on one instance is costed (prices in USD per token)."""

    price_in: float
    price_out: float
    prompt_tokens: int = 0  # the gateway's own count: costed until the instance reports its count, or if it never does
    count: Callable[[str], int] = estimate_tokens  # answer text -> tokens, for an instance that reports no usage
    max_answer_bytes: int = 16 << 20
    inline_chars: int = 16384  # longer text is counted in a worker thread, off the event loop
    # Adds the gateway's own fields (whether the SLO was met) to each usage object the client gets:
    # (usage, completion tokens so far) -> None.
    annotate: Callable[[dict, int], None] | None = None

    @classmethod
    def for_instance(cls, instance, prompt_tokens: int = 0, count: Callable[[str], int] = estimate_tokens,
                     max_answer_bytes: int = 16 << 20, inline_chars: int = 16384,
                     annotate: Callable[[dict, int], None] | None = None) -> Costing:
        return cls(*token_prices(instance), prompt_tokens, count, max_answer_bytes, inline_chars, annotate)

    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        return predicted_cost(prompt_tokens, completion_tokens, self.price_in, self.price_out)

    async def count_text(self, text: str) -> int:
        if len(text) <= self.inline_chars:
            return self.count(text)
        return await asyncio.get_running_loop().run_in_executor(None, self.count, text)


@dataclass(slots=True)
class RelayResult:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float | None = None
    cost_source: str = "upstream"  # or COUNTED: the instance reported no usage
    first_byte_s: float | None = None  # loop time when the first answer byte went out
    failed_status: int | None = None  # the stream broke after its first byte (client told by an error event)
    instance_failed: bool = False  # ...and the instance was to blame (not the client leaving, not the size cap)
    budget_exhausted: bool = False  # the stream was stopped because its next chunk would overspend
    usage: dict = field(default_factory=dict)  # what the client was told (or would have been)
    final: bool = False  # cost_usd is the whole attempt's: its final usage was read, or its answer counted
    # For learning (gateway/serving/learner.py), read where the answer is parsed anyway: the id the client
    # saw, and whether an answer was cut at its max_tokens (its length is then only a lower bound).
    completion_id: str | None = None
    cut_by_length: bool = False
    answer_text: str | None = None  # a whole, single answer's text (judged shadow answers: serving/shadow.py)
    cached_tokens: int | None = None  # prompt tokens the instance reports it had cached (None: it did not say)

    def cost_when_left(self, worst_usd: float) -> float:
        """What an attempt whose handler ended without a verdict (its client left) is paid: the answer's own
        cost once it was costed (an SDK hangs up on [DONE]), else all the attempt was allowed."""
        return self.cost_usd if self.final and self.cost_usd is not None else worst_usd


def upstream_timeout(up, stream: bool) -> aiohttp.ClientTimeout:
    """The bounds of one upstream call (`up`: the config's [upstream]). A non-streamed answer sends nothing
    until it is complete: its read timeout is the answer's whole time; a stream must keep bytes coming.
    Waiting for a pooled connection counts against `connect`."""
    return aiohttp.ClientTimeout(total=up.total_timeout_s, connect=up.acquire_timeout_s + up.connect_timeout_s,
                                 sock_connect=up.connect_timeout_s,
                                 sock_read=up.read_timeout_s if stream else up.response_timeout_s)


def usage_count(usage: dict, key: str) -> int:
    """A token count of an instance's usage object, or 0 where it is missing or not a count."""
    v = usage.get(key)
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else 0


def cached_count(usage: dict) -> int | None:
    """`usage.prompt_tokens_details.cached_tokens` (vLLM with --enable-prompt-tokens-details, OpenAI), or None."""
    details = usage.get("prompt_tokens_details")
    if not isinstance(details, dict) or "cached_tokens" not in details:
        return None
    return usage_count(details, "cached_tokens")


def record_usage(usage: dict, costing: Costing, result: RelayResult, final: bool = True) -> None:
    """Cost a request from the instance's own token counts (malformed counts count as 0). The SLO
    verdicts go only on the final usage: a running one (continuous usage) is judged on a partial answer."""
    result.prompt_tokens = usage_count(usage, "prompt_tokens")
    result.completion_tokens = usage_count(usage, "completion_tokens")
    result.cached_tokens = cached_count(usage)
    result.cost_usd = usage["cost_usd"] = costing.cost(result.prompt_tokens, result.completion_tokens)
    result.cost_source = "upstream"
    result.final = result.final or final
    if final and costing.annotate is not None:
        costing.annotate(usage, result.completion_tokens)


async def count_usage(texts: list[str], costing: Costing, result: RelayResult) -> dict:
    """Cost an answer whose instance reported no usage: the gateway's prompt count and the
    answer text counted by the tokenizer. Returns the usage object for the client."""
    result.prompt_tokens = costing.prompt_tokens
    result.completion_tokens = await costing.count_text("".join(texts))
    result.cost_usd = costing.cost(result.prompt_tokens, result.completion_tokens)
    result.cost_source = COUNTED
    result.final = True
    usage = {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
             "total_tokens": result.prompt_tokens + result.completion_tokens, "cost_usd": result.cost_usd,
             "cost_source": COUNTED}
    if costing.annotate is not None:
        costing.annotate(usage, result.completion_tokens)
    return usage


def _answer_texts(data: dict) -> list[str]:
    """The generated text of an answer or a stream chunk: content, reasoning and tool calls of each choice."""
    out = []
    choices = data.get("choices")
    for choice in choices if isinstance(choices, list) else ():
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            out.append(choice["text"])
        part = choice.get("message") or choice.get("delta")
        if not isinstance(part, dict):
            continue
        out += [part[k] for k in ("content", "reasoning_content") if isinstance(part.get(k), str)]
        calls = part.get("tool_calls")
        for call in calls if isinstance(calls, list) else ():
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict):
                out += [fn[k] for k in ("name", "arguments") if isinstance(fn.get(k), str)]
    return out


def upstream_payload(req: CompletionRequest, instance, max_tokens: int | None = None,
                     continuous_usage: bool = False, cache_salt: str | None = None) -> bytes:
    """The body for the instance. `max_tokens` (the budget clamp) replaces the client's
    limit in the field the client used; `continuous_usage` asks for running usage
    in every streamed chunk, which a budgeted stream is metered by; `cache_salt`
    (vLLM's) keeps the prompt's cached blocks apart (serving/prefixes.py)."""
    body = dict(req.body)
    body["model"] = instance.model
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
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


TRACE_CONTEXT = ("traceparent", "tracestate")  # the W3C trace context headers


def client_trace(headers) -> dict[str, str] | None:
    """The client's W3C trace context, passed on untouched when the gateway does not trace, so the instance's
    spans still join the client's trace (None: the client sent none)."""
    found = {name: headers[name] for name in TRACE_CONTEXT if name in headers}
    return found or None


async def open_upstream(session: aiohttp.ClientSession, instance, path: str, payload: bytes,
                        timeout: aiohttp.ClientTimeout, stream: bool = False,
                        names_stored: bool = False, trace_headers: dict[str, str] | None = None
                        ) -> aiohttp.ClientResponse:
    """POST to the instance. Raises UpstreamFailed on connect errors, timeouts, 5xx answers and a
    404 (the instance does not serve the model it is configured with, or is not an OpenAI server),
    unless the request `names_stored` a response (previous_response_id): its 404 is the client's.
    A non-streamed answer sends its head only when it is complete, so its timeout may be a long
    answer rather than a sick instance: that is not retried and not held against the instance.
    `trace_headers`: a traced attempt's `traceparent` (gateway/serving/tracing.py), or the client's own."""
    headers = UPSTREAM_HEADERS
    if instance.api_key:
        headers = {**UPSTREAM_HEADERS, "Authorization": f"Bearer {instance.api_key}"}
    if trace_headers:
        headers = {**headers, **trace_headers}
    try:
        resp = await session.post(instance.url + path, data=payload, timeout=timeout, headers=headers)
    except aiohttp.ConnectionTimeoutError:  # no connection in time: none free in its pool (busy), or none made
        raise UpstreamFailed(502, f"instance {instance.name} gave no connection in time", blame=False,
                             spent="nothing", no_connection=True) from None
    except TimeoutError:
        if stream:  # not even its first event: it stalls
            raise UpstreamFailed(504, f"instance {instance.name} did not answer in time") from None
        raise UpstreamFailed(504, f"instance {instance.name} did not finish the answer in time", retry=False,
                             blame=False, spent="all") from None
    except aiohttp.ClientConnectorError as e:  # refused: it is down
        raise UpstreamFailed(502, f"instance {instance.name} is unreachable: {e.__class__.__name__}",
                             unreachable=True, spent="nothing") from None
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        # The connection died under the request (a kept-alive one to a server that went away):
        # down as if refused, but it may have read the prompt.
        raise UpstreamFailed(502, f"instance {instance.name} dropped the connection: {e.__class__.__name__}",
                             unreachable=True) from None
    except aiohttp.ClientError as e:  # reset, disconnected: it failed with the request
        raise UpstreamFailed(502, f"instance {instance.name} failed: {e.__class__.__name__}") from None
    if resp.status >= 500 or (resp.status == 404 and not names_stored):
        resp.close()
        what = "does not serve its model (404)" if resp.status == 404 else f"failed with status {resp.status}"
        raise UpstreamFailed(502, f"instance {instance.name} {what}")
    return resp


async def client_error(resp: aiohttp.ClientResponse) -> ApiError:
    """A 4xx from the instance, passed on in OpenAI's shape."""
    try:
        data = orjson.loads(await _read_capped(resp, 1 << 16))
        err = data.get("error", data) if isinstance(data, dict) else {}
        message = err.get("message") if isinstance(err, dict) else None
        param = err.get("param") if isinstance(err, dict) else None
    except (TimeoutError, orjson.JSONDecodeError, aiohttp.ClientError, AnswerTooLarge):
        message, param = None, None
    finally:
        resp.close()
    status = resp.status if resp.status in (400, 404, 413, 422, 429) else 400
    message = message if isinstance(message, str) else None
    param = param if isinstance(param, str) else None
    return ApiError(status, message or f"instance rejected the request (status {resp.status})", param)


def route_headers(instance) -> dict[str, str]:
    return {"X-Route-Instance": instance.name, "X-Route-Model": instance.model}


async def _read_capped(upstream: aiohttp.ClientResponse, limit: int) -> bytes:
    """The whole body, or AnswerTooLarge as soon as it passes `limit` bytes (never buffered past it)."""
    if upstream.content_length is not None and upstream.content_length > limit:
        raise AnswerTooLarge(f"{upstream.content_length} bytes")
    chunks, size = [], 0
    async for chunk in upstream.content.iter_chunked(1 << 16):
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"more than {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def relay_full(upstream: aiohttp.ClientResponse, instance, result: RelayResult, costing: Costing) -> web.Response:
    data = await read_answer(upstream, instance, costing)
    headers = route_headers(instance)
    note_answer(data, result)
    usage = data.get("usage")
    if isinstance(usage, dict):
        record_usage(usage, costing, result)
    else:
        data["usage"] = await count_usage(_answer_texts(data), costing, result)
    result.usage = data["usage"]
    headers["X-Route-Cost-USD"] = f"{result.cost_usd:.10f}"
    return web.Response(body=orjson.dumps(data), content_type="application/json", headers=headers)


async def read_answer(upstream: aiohttp.ClientResponse, instance, costing: Costing) -> dict:
    """A whole (non-streamed) answer's JSON object, read within the size cap; UpstreamFailed otherwise."""
    try:
        raw = await _read_capped(upstream, costing.max_answer_bytes)  # a complete read frees the connection
    except TimeoutError:
        raise UpstreamFailed(504, f"instance {instance.name} stalled", spent="all") from None
    except aiohttp.ClientError as e:
        raise UpstreamFailed(502, f"instance {instance.name} broke off: {e.__class__.__name__}", spent="all") from None
    except AnswerTooLarge as e:  # it would be as large anywhere else
        raise UpstreamFailed(502, f"instance {instance.name} sent an answer past the size cap ({e})",
                             retry=False, blame=False, spent="all") from None
    finally:
        if not upstream.content.is_eof():
            upstream.close()  # cancelled or failed mid-body: drop the connection so the instance aborts
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise UpstreamFailed(502, f"instance {instance.name} sent invalid JSON", spent="all") from None
    if not isinstance(data, dict):
        raise UpstreamFailed(502, f"instance {instance.name} sent a JSON {type(data).__name__}, not an object",
                             spent="all")
    return data


def note_answer(data: dict, result: RelayResult) -> None:
    """Keep a whole answer's id, whether one of its choices stopped at max_tokens, and a single answer's text."""
    if isinstance(data.get("id"), str):
        result.completion_id = data["id"]
    choices = data.get("choices")
    result.cut_by_length = isinstance(choices, list) and any(
        isinstance(c, dict) and c.get("finish_reason") == "length" for c in choices)
    texts = _answer_texts(data) if isinstance(choices, list) and len(choices) == 1 else []
    result.answer_text = texts[0] if len(texts) == 1 else None


# A stream's finish_reason "length", found without parsing the events that carry none of it.
_CUT_BY_LENGTH = (b'"finish_reason":"length"', b'"finish_reason": "length"')


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


def _ends_answer(block: bytes, n: int) -> bool:
    """The block ends the answer: [DONE], or (for one answer) its finish_reason (a server may send no
    [DONE]); with several answers only [DONE] says that all of them ended."""
    if b"[DONE]" in block:
        return True
    return n == 1 and (b'"finish_reason":"' in block or b'"finish_reason": "' in block)


class _Framer:
    """What the framers share: costing by counting while the instance has sent no usage,
    holding [DONE] back until then, and knowing whether the answer reached its end."""

    def __init__(self, costing: Costing, include_usage: bool, result: RelayResult, n: int = 1):
        self.costing, self.include_usage, self.result, self.n = costing, include_usage, result, n
        self.usage_seen = False  # the instance reported usage: it is the truth
        self.held_done = False  # [DONE] withheld until the counted usage has gone out
        self.ended = False
        self.head: dict = {}  # id, object, created, model of the stream's chunks

    def _hold_done(self, block: bytes) -> bytes:
        if self.usage_seen or b"[DONE]" not in block:
            return block
        self.held_done = True
        return b"".join(e + EVENT_END for e in block.split(EVENT_END) if e and b"[DONE]" not in e)

    def _usage_chunk(self, usage: dict) -> bytes:
        return json_event({**self.head, "choices": [], "usage": usage}) if self.include_usage else b""

    def _texts(self) -> list[str]:
        raise NotImplementedError

    def pass_block(self, block: bytes) -> tuple[bytes, bool]:
        """The events to send, and whether the budget stops the stream after them."""
        raise NotImplementedError

    async def closing(self) -> bytes:
        """What a metering framer sends instead of the event that would overspend, to end the stream."""
        raise NotImplementedError

    async def count_delivered(self) -> None:
        """The stream ended early (cut, failed, the client left): without usage from the instance,
        cost what was delivered by counting it."""
        if not self.usage_seen:
            self.result.usage = await count_usage(self._texts(), self.costing, self.result)
            self._note_id(self.head)

    def _note_id(self, data: dict) -> None:
        if self.result.completion_id is None and isinstance(data.get("id"), str):
            self.result.completion_id = data["id"]

    async def finish(self) -> bytes:
        """After the last block: cost by counting if the instance sent no usage; the usage chunk if asked, and
        the held [DONE]."""
        if self.usage_seen:
            return b""
        await self.count_delivered()
        return self._usage_chunk(self.result.usage) + (DONE if self.held_done else b"")


class _PassThrough(_Framer):
    """Bytes through untouched; the events that carry usage are costed (and dropped if not asked for)."""

    def __init__(self, costing: Costing, include_usage: bool, result: RelayResult, n: int = 1):
        super().__init__(costing, include_usage, result, n)
        # The stream so far, while no usage has come, to count at the end: its bytes (vLLM sends
        # usage last, and parsing every event would slow every stream), or past the size cap
        # its answer text alone, which is far smaller.
        self.kept: list[bytes] = []
        self.kept_bytes = 0
        self.compact: list[str] | None = None
        self.compact_chars = 0

    def pass_block(self, block: bytes) -> tuple[bytes, bool]:
        if b'"usage"' in block:
            block = self._rewrite_usage_events(block)
        if not self.usage_seen:
            self._keep(block)
        if b'"length"' in block and any(cut in block for cut in _CUT_BY_LENGTH):
            self.result.cut_by_length = True
        self.ended = self.ended or _ends_answer(block, self.n)
        return self._hold_done(block), False

    def _keep(self, block: bytes) -> None:
        cap = self.costing.max_answer_bytes
        if self.compact is None:
            self.kept.append(block)
            self.kept_bytes += len(block)
            if self.kept_bytes > cap:
                self.compact, self.kept = self._texts(), []
                self.compact_chars = sum(map(len, self.compact))
            return
        texts = _block_texts(block, self.head)
        self.compact += texts
        self.compact_chars += sum(map(len, texts))
        if self.compact_chars > cap:
            raise AnswerTooLarge(f"more than {cap} characters of answer without usage")

    def _rewrite_usage_events(self, block: bytes) -> bytes:
        """Cost the events that carry usage; keep them (with cost_usd) only if the client asked."""
        out = []
        for event in block.split(EVENT_END):
            if not event:
                continue
            if b'"usage":{' in event or b'"usage": {' in event:
                data = _event_json(event)
                usage = data.get("usage") if data is not None else None
                if isinstance(usage, dict):
                    record_usage(usage, self.costing, self.result, final=not data.get("choices"))
                    self._note_id(data)
                    self.result.usage = usage
                    self.usage_seen, self.kept = True, []
                    if not data.get("choices") and not self.include_usage:
                        continue  # the usage-only chunk the client never asked for
                    if not self.include_usage:
                        data["usage"] = None
                    out.append(json_event(data))
                    continue
            out.append(event + EVENT_END)
        return b"".join(out)

    def _texts(self) -> list[str]:
        texts = list(self.compact or ())
        for block in self.kept:
            texts += _block_texts(block, self.head)
        return texts


def _block_texts(block: bytes, head: dict) -> list[str]:
    """The answer text of a block's events; fills `head` (id, object, created, model) from the first."""
    texts = []
    for event in block.split(EVENT_END):
        data = _event_json(event)
        if data is not None:
            if not head:
                head.update({k: data[k] for k in ("id", "object", "created", "model") if k in data})
            texts += _answer_texts(data)
    return texts


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


class _BudgetMeter(_Framer):
    """Meters a budgeted stream event by event, from the running usage each chunk
    carries; a chunk without usage is counted by the tokenizer (at least one token
    per choice that has output). The counts it holds are those delivered to the client.
    With several answers (n > 1) a chunk's running usage is its own choice's (as vLLM
    reports it), not the request's: those are counted, too."""

    def __init__(self, budget_usd: float, costing: Costing, include_usage: bool, continuous_usage: bool,
                 result: RelayResult, n: int = 1):
        super().__init__(costing, include_usage, result, n)
        self.budget_usd = budget_usd
        self.continuous_usage = continuous_usage  # the client asked for running usage itself
        self.prompt, self.completion = costing.prompt_tokens, 0
        self.open: set[int] = set()  # choices begun and not yet finished
        self.texts: list[str] = []  # the text delivered, for a count if the instance never reports usage
        self.text_bytes = 0

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
                    record_usage(usage, self.costing, self.result)
                    self.result.usage, self.usage_seen = usage, True
                    if self.include_usage:
                        out.append(json_event(data))
                    continue
                self.ended = self.ended or b"[DONE]" in event
                out.append(event + EVENT_END)  # [DONE], error objects, comments: as they came
                continue
            self.head = {k: data[k] for k in ("id", "object", "created", "model") if k in data}
            self._note_id(data)
            running = usage if self.n == 1 else None  # with several answers, usage is the chunk's choice's own
            if running is not None:
                self.usage_seen = True
                self.result.cached_tokens = cached_count(running)
                prompt = usage_count(running, "prompt_tokens") or self.prompt
                completion = usage_count(running, "completion_tokens")
            else:
                texts = _answer_texts(data)
                counted = self.costing.count("".join(texts)) if texts else 0  # a chunk's few tokens: inline
                prompt, completion = self.prompt, self.completion + max(counted, sum(map(_has_output, choices)))
            self.prompt = prompt  # the input is spent whether or not this chunk goes out
            if not within_budget(self.costing.cost(prompt, completion), self.budget_usd):
                self.open.update(_index(c) for c in choices)  # withheld, so still open for the client
                self._settle()
                return b"".join(out), True
            self.completion = completion
            delivered = _answer_texts(data)
            self.texts += delivered
            self.text_bytes += sum(map(len, delivered))
            if self.text_bytes > self.costing.max_answer_bytes:
                raise AnswerTooLarge(f"more than {self.costing.max_answer_bytes} bytes")
            finished_one = False
            for c in choices:
                finished = isinstance(c, dict) and c.get("finish_reason")
                finished_one = finished_one or bool(finished)
                self.result.cut_by_length = self.result.cut_by_length or finished == "length"
                (self.open.discard if finished else self.open.add)(_index(c))
            self.ended = self.ended or (finished_one and not self.open)
            self._settle()
            if usage is not None and not self.continuous_usage:
                data["usage"] = None  # running usage the client never asked for (whatever n)
                out.append(json_event(data))
            elif running is not None:
                running["cost_usd"] = self.result.cost_usd
                out.append(json_event(data))
            else:
                out.append(event + EVENT_END)
        return self._hold_done(b"".join(out)), False

    def _settle(self) -> None:
        self.result.prompt_tokens, self.result.completion_tokens = self.prompt, self.completion
        self.result.cost_usd = self.costing.cost(self.prompt, self.completion)

    def _texts(self) -> list[str]:
        return self.texts

    async def closing(self) -> bytes:
        """What the client gets instead of the chunk that would overspend: every open
        choice ends with "length", a budget marker, the usage if asked, then [DONE]."""
        self.result.budget_exhausted = True
        usage = {"prompt_tokens": self.prompt, "completion_tokens": self.completion,
                 "total_tokens": self.prompt + self.completion, "cost_usd": self.result.cost_usd}
        if not self.usage_seen:  # what was delivered, counted (the chunks only approximated it)
            usage = await count_usage(self.texts, self.costing, self.result)
        self.result.usage = usage
        chat = self.head.get("object") != "text_completion"
        ends = [{"index": i, **({"delta": {}} if chat else {"text": ""}), "logprobs": None, "finish_reason": "length"}
                for i in sorted(self.open or {0})]
        marker = {"budget_exhausted": True, "budget_usd": self.budget_usd, "cost_usd": self.result.cost_usd}
        return json_event({**self.head, "choices": ends, "routebalance": marker}) + self._usage_chunk(usage) + DONE


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
                       include_usage: bool, result: RelayResult, costing: Costing, budget_usd: float | None = None,
                       continuous_usage: bool = False, headers: Mapping[str, str] | None = None,
                       on_progress: Callable[[int], None] | None = None, n: int = 1,
                       write_timeout_s: float | None = None, framer: _Framer | None = None) -> web.StreamResponse:
    """Pass SSE events through. Nothing is sent to the client until the first event
    has arrived, so an instance that fails before it can still be retried elsewhere.
    A client that goes away, or does not take a write within `write_timeout_s`,
    closes the upstream connection, which makes vLLM abort; so does a budget that
    the next chunk would exceed (upstream_payload must have asked for continuous
    usage). An upstream that breaks off, or ends before its answer did, ends the
    client's stream with an error event, never a clean end; what was delivered is
    paid for. `continuous_usage`: the client asked for running usage itself, so a
    budgeted stream keeps it in the chunks. `headers` go on the response with the
    route headers (they must be known before the first byte). `n`: the answers the
    request generates. `on_progress(tokens)` hears the answer tokens streamed so far
    after each write: exact for a budgeted stream, else counted as one per event (an
    instance may pack several tokens into one, and role, usage and [DONE] events
    count too). `framer`: the framer of another API's events (the Responses API's,
    serving/responses_relay.py), metering for `budget_usd` itself, instead of chat's."""
    loop = asyncio.get_running_loop()
    events = _EventReader(upstream)
    meter: _Framer | None = None
    if framer is not None:
        meter = framer if budget_usd is not None else None
    elif budget_usd is None:
        framer = _PassThrough(costing, include_usage, result, n)
    else:
        framer = meter = _BudgetMeter(budget_usd, costing, include_usage, continuous_usage, result, n)

    async def write(data: bytes) -> None:
        try:
            async with asyncio.timeout(write_timeout_s):
                await resp.write(data)
        except TimeoutError:
            raise ConnectionResetError("the client took no data in time") from None

    try:
        try:
            first = await events.next_block()
        except TimeoutError:
            raise UpstreamFailed(504, f"instance {instance.name} sent no event in time") from None
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
                try:
                    out, stop = framer.pass_block(block)
                except AnswerTooLarge as e:
                    await _fail(write, result, 502, f"instance {instance.name} sent an answer past the size cap ({e})",
                                instance_failed=False)
                    break
                if out:
                    await write(out)
                if on_progress is not None:
                    streamed = result.completion_tokens if meter else streamed + block.count(b"data:")
                    on_progress(streamed)
                if stop and meter is not None:
                    upstream.close()  # before telling the client: the instance stops generating now
                    await write(await meter.closing())
                    break
                try:
                    block = await events.next_block()
                except (TimeoutError, aiohttp.ClientError) as e:
                    # After the first byte there is no retry: end the stream with an error event.
                    await _fail(write, result, 504 if isinstance(e, TimeoutError) else 502,
                                f"instance {instance.name} broke off the stream: {e.__class__.__name__}")
                    break
            else:
                if framer.ended:
                    await write(await framer.finish())
                else:
                    await _fail(write, result, 502, f"instance {instance.name} ended the stream before its answer did")
            await resp.write_eof()
        except ConnectionResetError:
            # The client left. After the answer's end that is normal (SDKs hang up at once
            # after [DONE]); before it, closing upstream (below) makes vLLM abort.
            if not result.failed_status and not framer.ended:
                result.failed_status = CLIENT_CLOSED
        if result.failed_status and not result.budget_exhausted:
            await framer.count_delivered()
        return resp
    finally:
        upstream.close()


async def _fail(write: Callable[[bytes], Awaitable[None]], result: RelayResult, status: int, message: str,
                instance_failed: bool = True) -> None:
    failure = ApiError(status, message)
    result.failed_status, result.instance_failed = failure.status, instance_failed
    await write(json_event(failure.body()))
