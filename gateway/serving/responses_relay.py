"""The Responses API's answers through the relay: ids that name the instance, usage costed, streams metered.

A whole answer: its id (and the `previous_response_id` it continues) rewritten to the client's form
(serving/stored_responses.py), its usage (`input_tokens`, `output_tokens`) costed into `usage.cost_usd`
as a chat answer's is.

A stream is named SSE events (`event: <type>`, then `data: <json>`). The events that carry the response
object (response.created, .in_progress, .completed, .incomplete, .failed) get the client's ids and, at
the end, the costed usage. Every response.output_text.delta is counted by the tokenizer, since vLLM
reports no running usage on this API; a budget therefore stops the stream before the delta that would
overspend, and ends it cleanly: the text part and message it cut are closed ("incomplete"), then
response.incomplete with `incomplete_details.reason = "max_output_tokens"`, the usage of what was
delivered, and the budget marker chat streams carry (`routebalance`).

`result.answer_text` stays None: a shadow answer (serving/shadow.py) is asked on chat, and a follow-up's
history lives only on its instance, so Responses answers are not judged against other tiers.
"""

from __future__ import annotations

import aiohttp
import orjson
from aiohttp import web

from gateway.api.responses import ResponsesRequest
from gateway.api.sse import EVENT_END, named_event
from gateway.core.budget import within_budget
from gateway.serving.relay import (
    COUNTED,
    AnswerTooLarge,
    Costing,
    RelayResult,
    _event_json,
    _Framer,
    read_answer,
    route_headers,
    usage_count,
)
from gateway.serving.stored_responses import client_id, split_id

ROUTE = "/v1/responses"
TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})
BUDGET_STOP = {"reason": "max_output_tokens"}  # what OpenAI says of an answer cut at its token limit


def responses_payload(req: ResponsesRequest, instance, max_tokens: int | None, cache_salt: str | None) -> bytes:
    """The body for the instance: its model, the budget's clamp as `max_output_tokens`, vLLM's `cache_salt`,
    and the instance's own id of the response it continues."""
    body = dict(req.body)
    body["model"] = instance.model
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    if max_tokens is not None:
        body["max_output_tokens"] = max_tokens
    if req.previous_response_id is not None:
        parts = split_id(req.previous_response_id)
        assert parts is not None  # checked before it was routed (stored_responses.stored_at)
        body["previous_response_id"] = parts[1]
    return orjson.dumps(body)


def to_client(response: dict, instance) -> None:
    """The response object's ids as the client knows them: naming the instance that holds them."""
    for name in ("id", "previous_response_id"):
        if isinstance(response.get(name), str):
            response[name] = client_id(instance, response[name])


def record_responses_usage(usage: dict, costing: Costing, result: RelayResult) -> None:
    """Cost the answer from the instance's own counts, into `usage.cost_usd` (and the SLO verdicts)."""
    result.prompt_tokens = usage_count(usage, "input_tokens")
    result.completion_tokens = usage_count(usage, "output_tokens")
    details = usage.get("input_tokens_details")
    result.cached_tokens = usage_count(details, "cached_tokens") if isinstance(details, dict) \
        and "cached_tokens" in details else None
    result.cost_usd = usage["cost_usd"] = costing.cost(result.prompt_tokens, result.completion_tokens)
    result.cost_source, result.final, result.usage = "upstream", True, usage
    if costing.annotate is not None:
        costing.annotate(usage, result.completion_tokens)


async def counted_usage(texts: list[str], costing: Costing, result: RelayResult) -> dict:
    """The usage of an answer the instance did not report (or that the budget cut): the gateway's prompt
    count and the delivered text counted by the tokenizer."""
    result.prompt_tokens = costing.prompt_tokens
    result.completion_tokens = await costing.count_text("".join(texts))
    result.cost_usd = costing.cost(result.prompt_tokens, result.completion_tokens)
    result.cost_source, result.final = COUNTED, True
    usage = {"input_tokens": result.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
             "output_tokens": result.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
             "total_tokens": result.prompt_tokens + result.completion_tokens, "cost_usd": result.cost_usd,
             "cost_source": COUNTED}
    if costing.annotate is not None:
        costing.annotate(usage, result.completion_tokens)
    result.usage = usage
    return usage


def note_response(response: dict, result: RelayResult) -> None:
    """For learning: the id the client was given (a feedback names it), and whether the answer was cut."""
    if isinstance(response.get("id"), str):
        result.completion_id = response["id"]
    details = response.get("incomplete_details")
    result.cut_by_length = response.get("status") == "incomplete" and isinstance(details, dict) \
        and details.get("reason") == "max_output_tokens"


def output_texts(response: dict) -> list[str]:
    """The text of the answer's messages."""
    texts = []
    for item in response.get("output") or ():
        for part in (item.get("content") or ()) if isinstance(item, dict) else ():
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                texts.append(part["text"])
    return texts


async def relay_response_full(upstream: aiohttp.ClientResponse, instance, result: RelayResult,
                              costing: Costing) -> web.Response:
    data = await read_answer(upstream, instance, costing)
    to_client(data, instance)
    note_response(data, result)
    usage = data.get("usage")
    if isinstance(usage, dict):
        record_responses_usage(usage, costing, result)
    else:
        data["usage"] = await counted_usage(output_texts(data), costing, result)
    headers = {**route_headers(instance), "X-Route-Cost-USD": f"{result.cost_usd:.10f}"}
    return web.Response(body=orjson.dumps(data), content_type="application/json", headers=headers)


class ResponsesFramer(_Framer):
    """Relays a Responses stream event by event (see the module docstring); with `budget_usd`, stops it
    before the delta that would overspend. The counts it holds are those delivered to the client."""

    def __init__(self, costing: Costing, result: RelayResult, instance, budget_usd: float | None = None):
        super().__init__(costing, False, result)
        self.instance = instance
        self.budget_usd = budget_usd
        self.texts: list[str] = []  # the text delivered: the usage is counted from it if none is reported
        self.text_bytes = 0  # of the text and the items kept, bounded by the answer's size cap
        self.completion = 0  # the tokens delivered, counted delta by delta
        self.sequence = -1  # the last event's sequence_number: events the gateway adds follow it
        self.response: dict = {}  # the response object the client saw last
        self.items: list[dict] = []  # output items done
        self.item: dict | None = None  # the message being streamed: its id and output_index
        self.part: dict | None = None  # its text part being streamed: where it is, and its text so far
        self.held: dict | None = None  # a final event without usage, until the counted usage goes in it

    def pass_block(self, block: bytes) -> tuple[bytes, bool]:
        out = []
        for event in block.split(EVENT_END):
            if not event:
                continue
            data = _event_json(event)
            kind = data.get("type") if data is not None else None
            if data is None or not isinstance(kind, str):
                out.append(event + EVENT_END)  # comments, error objects: as they came
                continue
            if kind == "response.output_text.delta":
                given = data.get("delta")
                delta = given if isinstance(given, str) else ""
                tokens = max(1, self.costing.count(delta)) if delta else 0  # a delta's few tokens: inline
                if self.budget_usd is not None and not within_budget(
                        self.costing.cost(self.costing.prompt_tokens, self.completion + tokens), self.budget_usd):
                    self._settle()
                    return b"".join(out), True
                self.completion += tokens
                self._deliver(delta)
            else:
                self._track(kind, data, len(event))
            if isinstance(data.get("sequence_number"), int):  # of the events the client gets
                self.sequence = data["sequence_number"]
            response = data.get("response")
            if not isinstance(response, dict):
                out.append(event + EVENT_END)
                continue
            self._respond(kind, response)
            if kind in TERMINAL and not self.usage_seen:
                self.held = data
                continue
            out.append(named_event(data))
        self._settle()
        return b"".join(out), False

    def _deliver(self, delta: str) -> None:
        self.texts.append(delta)
        self.text_bytes += len(delta)
        if self.text_bytes > self.costing.max_answer_bytes:
            raise AnswerTooLarge(f"more than {self.costing.max_answer_bytes} bytes")
        if self.part is not None:
            self.part["texts"].append(delta)

    def _track(self, kind: str, data: dict, size: int) -> None:
        """Which message and text part are open, so a budget stop can close them (`size`: the event's bytes,
        which count against the answer's size cap when its item is kept)."""
        if kind == "response.output_item.added" and isinstance(data.get("item"), dict) \
                and data["item"].get("type") == "message":
            self.item = {"id": data["item"].get("id"), "output_index": data.get("output_index")}
        elif kind == "response.content_part.added" and isinstance(data.get("part"), dict) \
                and data["part"].get("type") == "output_text":
            self.part = {"item_id": data.get("item_id"), "output_index": data.get("output_index"),
                         "content_index": data.get("content_index"), "texts": []}
        elif kind == "response.content_part.done":
            self.part = None
        elif kind == "response.output_item.done":
            self.item = None
            if isinstance(data.get("item"), dict):
                self.items.append(data["item"])
                self.text_bytes += size
                if self.text_bytes > self.costing.max_answer_bytes:
                    raise AnswerTooLarge(f"more than {self.costing.max_answer_bytes} bytes")

    def _respond(self, kind: str, response: dict) -> None:
        to_client(response, self.instance)
        self.response = response
        usage = response.get("usage")
        if isinstance(usage, dict):
            record_responses_usage(usage, self.costing, self.result)
            self.usage_seen = True
        if kind in TERMINAL:
            self.ended = True
            note_response(response, self.result)

    def _settle(self) -> None:
        if not self.usage_seen:  # the instance's own count, once it came, is the truth
            self.result.prompt_tokens, self.result.completion_tokens = self.costing.prompt_tokens, self.completion
            self.result.cost_usd = self.costing.cost(self.costing.prompt_tokens, self.completion)

    async def finish(self) -> bytes:
        """The final event held for want of usage, with the delivered answer's counted usage in it."""
        if self.held is None:
            return b""
        self.held["response"]["usage"] = await counted_usage(self.texts, self.costing, self.result)
        return named_event(self.held)

    async def count_delivered(self) -> None:
        if not self.usage_seen:
            await counted_usage(self.texts, self.costing, self.result)

    async def closing(self) -> bytes:
        """Instead of the delta that would overspend: what was open, closed as incomplete, then
        response.incomplete with the usage of what was delivered."""
        self.result.budget_exhausted = True
        usage = await counted_usage(self.texts, self.costing, self.result)
        events: list[dict] = []
        content = []
        if self.part is not None:
            p = self.part
            text = "".join(p["texts"])
            where = {"item_id": p["item_id"], "output_index": p["output_index"], "content_index": p["content_index"]}
            part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
            events += [{"type": "response.output_text.done", **where, "text": text, "logprobs": []},
                       {"type": "response.content_part.done", **where, "part": part}]
            content.append(part)
        output = list(self.items)
        if self.item is not None:
            item = {"id": self.item["id"], "type": "message", "role": "assistant", "status": "incomplete",
                    "content": content}
            events.append({"type": "response.output_item.done", "output_index": self.item["output_index"],
                           "item": item})
            output.append(item)
        response = {**self.response, "status": "incomplete", "incomplete_details": BUDGET_STOP, "output": output,
                    "usage": usage}
        note_response(response, self.result)
        marker = {"budget_exhausted": True, "budget_usd": self.budget_usd, "cost_usd": self.result.cost_usd}
        events.append({"type": "response.incomplete", "response": response, "routebalance": marker})
        for event in events:
            self.sequence += 1
            event["sequence_number"] = self.sequence
        return b"".join(map(named_event, events))
