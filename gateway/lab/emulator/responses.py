"""`POST /v1/responses` on an emulated instance, as vLLM serves it for a model without harmony
(vllm/entrypoints/openai/serving_responses.py), non-streamed and streamed.

The answer is generated as a chat completion's is (the same output lengths, engine, prefix cache and
metrics): the prompt is the chat template over `instructions`, the stored history and `input`. With
`store` (true by default, as in OpenAI and in vLLM with VLLM_ENABLE_RESPONSES_API_STORE=1) the
conversation so far (its messages and the answer) is kept in the instance's memory, which a restart
(the instance going down) loses; vLLM keeps every stored response until then, the emulator the
MAX_STORED_RESPONSES used last. A `previous_response_id` it does not hold is answered 404 in vLLM's words.

A stream is vLLM's sequence of named events: response.created, response.in_progress,
response.output_item.added, response.content_part.added, response.output_text.delta (the tokens of each
engine step), response.output_text.done, response.content_part.done, response.output_item.done, and
response.completed, which carries the whole response and its usage.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import OrderedDict

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.responses import conversation
from gateway.api.sse import SSE_HEADERS, named_event
from gateway.core.prefix import block_hashes
from gateway.lab.emulator.replies import error, faulted_or_body

MAX_STORED_RESPONSES = 256  # per instance; each is at most a context's worth of messages


class ResponseStore:
    """One instance's stored conversations, by response id, the least recently used forgotten first."""

    def __init__(self, bound: int = MAX_STORED_RESPONSES):
        self.bound = bound
        self._items: OrderedDict[str, list[dict]] = OrderedDict()

    def get(self, rid: str) -> list[dict] | None:
        messages = self._items.get(rid)
        if messages is not None:
            self._items.move_to_end(rid)
        return messages

    def put(self, rid: str, messages: list[dict]) -> None:
        self._items[rid] = messages
        self._items.move_to_end(rid)
        while len(self._items) > self.bound:
            self._items.popitem(last=False)


STORE_KEY = web.AppKey("responses", ResponseStore)


def _usage(seq) -> dict:
    return {"input_tokens": seq.prompt_tokens, "input_tokens_details": {"cached_tokens": seq.cached_tokens or 0},
            "output_tokens": seq.generated, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": seq.prompt_tokens + seq.generated}


class _Reply:
    """The response object of one request, as it stands."""

    def __init__(self, rid: str, model: str, body: dict, store: bool):
        self.rid, self.msg_id = rid, f"msg_{uuid.uuid4().hex}"
        self.head = {"id": rid, "object": "response", "created_at": int(time.time()), "model": model,
                     "instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
                     "previous_response_id": body.get("previous_response_id"), "parallel_tool_calls": True,
                     "tool_choice": "auto", "tools": [], "temperature": body.get("temperature", 1.0),
                     "top_p": body.get("top_p", 1.0), "store": store, "text": {"format": {"type": "text"}},
                     "truncation": "disabled", "metadata": body.get("metadata"), "background": False,
                     "service_tier": "auto", "user": None, "error": None}

    def part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def item(self, status: str, content: list) -> dict:
        return {"id": self.msg_id, "type": "message", "role": "assistant", "status": status, "content": content}

    def pending(self) -> dict:
        return {**self.head, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}

    def final(self, seq, text: str) -> dict:
        cut = seq.finish_reason == "length"
        return {**self.head, "status": "incomplete" if cut else "completed",
                "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
                "output": [self.item("incomplete" if cut else "completed", [self.part(text)])], "usage": _usage(seq)}


async def create_response(request: web.Request, inst, pool) -> web.StreamResponse:
    """The handler, given the instance and the pool it runs in (gateway/lab/emulator/server.py)."""
    body = await faulted_or_body(request, inst)
    if isinstance(body, web.Response):
        return body
    if body.get("model") not in (None, inst.model):
        return error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError", "model")
    try:
        given, _ = conversation(body)
    except ApiError as e:
        return error(400, e.message, param=e.param)
    salt = body.get("cache_salt")
    if salt is not None and (not isinstance(salt, str) or not salt):
        return error(400, "Parameter 'cache_salt' must be a non-empty string if provided.", param="cache_salt")
    history: list[dict] = []
    previous = body.get("previous_response_id")
    if previous is not None:
        stored = request.app[STORE_KEY].get(previous) if isinstance(previous, str) else None
        if stored is None:
            return error(404, f"Response with id '{previous}' not found.", "invalid_request_error", "response_id")
        history = stored
    # As vLLM builds it: this request's instructions, the stored conversation, then the new input.
    system = 1 if body.get("instructions") is not None else 0
    messages = given[:system] + history + given[system:]
    if not messages:  # only items it cannot read (reasoning, references): nothing to answer
        return error(400, "the input has no message to answer", param="input")
    counter = pool.token_counter
    ids = counter.chat_ids(messages)
    prompt_tokens = len(ids) if ids is not None else counter.count_chat(messages)
    limit = inst.engine.spec.max_model_len
    max_tokens = body.get("max_output_tokens")
    if max_tokens is None:
        max_tokens = limit - prompt_tokens
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        return error(400, "max_output_tokens must be a positive integer", param="max_output_tokens")
    if prompt_tokens + max_tokens > limit:
        return error(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                          f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, {max_tokens} in "
                          "the completion).", param="max_output_tokens")
    # The labels are keyed by the last user turn, as for a chat completion.
    text = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
    store = body.get("store", True) is not False
    reply = _Reply(f"resp_{uuid.uuid4().hex}", inst.model, body, store)
    answer = pool.lengths.answer(text, inst.model)
    spec = inst.engine.spec
    prefix = block_hashes(ids, spec.block_size, salt) if ids is not None and spec.prefix_caching else ()
    seq, wake = inst.submit(reply.rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens,
                            output_tokens=answer.tokens, now=asyncio.get_running_loop().time(),
                            domain=pool.lengths.domain_of(text), ids=ids, prefix=prefix)
    pool.kick()
    try:
        if body.get("stream") is True:
            resp, final = await _stream(request, seq, wake, answer, reply)
        else:
            while not seq.finished:
                await wake.wait()
                wake.clear()
            final = reply.final(seq, "".join(answer.token_strings(0, seq.generated)))
            resp = web.Response(body=orjson.dumps(final), content_type="application/json")
        if store:
            request.app[STORE_KEY].put(reply.rid, [*messages, {"role": "assistant",
                                                               "content": final["output"][0]["content"][0]["text"]}])
        return resp
    finally:
        inst.release(seq, asyncio.get_running_loop().time())
        pool.kick()


async def _stream(request: web.Request, seq, wake: asyncio.Event, answer, reply: _Reply
                  ) -> tuple[web.StreamResponse, dict]:
    resp = web.StreamResponse(headers=SSE_HEADERS)
    await resp.prepare(request)
    number = -1

    def event(kind: str, **fields) -> bytes:
        nonlocal number
        number += 1
        return named_event({"type": kind, "sequence_number": number, **fields})

    where = {"item_id": reply.msg_id, "output_index": 0, "content_index": 0}
    await resp.write(event("response.created", response=reply.pending())
                     + event("response.in_progress", response=reply.pending())
                     + event("response.output_item.added", output_index=0, item=reply.item("in_progress", []))
                     + event("response.content_part.added", **where, part=reply.part("")))
    sent = 0
    pieces: list[str] = []
    while not seq.finished:
        await wake.wait()
        wake.clear()
        if seq.generated > sent:
            piece = "".join(answer.token_strings(sent, seq.generated - sent))
            pieces.append(piece)
            sent = seq.generated
            await resp.write(event("response.output_text.delta", **where, delta=piece, logprobs=[]))
    if seq.generated > sent:
        pieces.append("".join(answer.token_strings(sent, seq.generated - sent)))
        await resp.write(event("response.output_text.delta", **where, delta=pieces[-1], logprobs=[]))
    text = "".join(pieces)
    final = reply.final(seq, text)
    await resp.write(event("response.output_text.done", **where, text=text, logprobs=[])
                     + event("response.content_part.done", **where, part=reply.part(text))
                     + event("response.output_item.done", output_index=0, item=final["output"][0])
                     + event("response.completed", response=final))
    await resp.write_eof()
    return resp, final
