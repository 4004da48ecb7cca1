"""The Responses API (`POST /v1/responses`) through the real gateway, with the official openai SDK: in front of
the emulated pool (answers, streams, follow-ups by previous_response_id on the instance that stored them,
an instance gone, bad input, feedback), and in front of a stub that ignores its token limit (the budget's
stop of a stream, and its spend booked once)."""

from __future__ import annotations

import asyncio
import time
from typing import get_args

import httpx
import openai
import orjson
import pytest
from aiohttp import web
from openai.types.responses import Response, ResponseStreamEvent
from stubs import MODEL, TOKEN, Stub, StubStack, stub_config

from conftest import Stack, pool_config, spent, wait_for
from gateway.api.responses import parse_responses
from gateway.api.sse import named_event
from gateway.core.budget import per_token, predicted_cost
from gateway.lab.emulator.responses import ResponseStore
from gateway.serving.stored_responses import client_id, instance_tag, split_id
from gateway.tenancy.keys import hash_key

QUESTION = "Explain how a river delta forms."
# The SDK's type of each stream event, by its `type`.
EVENTS = {get_args(t.model_fields["type"].annotation)[0]: t for t in get_args(get_args(ResponseStreamEvent)[0])}


def check_shape(model, data: dict) -> None:
    """`data` has every field the SDK's `model` requires, of its type (the SDK itself parses leniently); but
    usage.input_tokens_details.cache_write_tokens, newer than vLLM's answers."""
    response = data.get("response", data)
    if isinstance(response.get("usage"), dict):
        response["usage"]["input_tokens_details"].setdefault("cache_write_tokens", 0)
    model.model_validate(data)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    s = Stack(pool_config(tmp_path_factory.mktemp("responses")))
    s.wait_routable()
    yield s
    s.stop()


def client(stack, key: str = "x") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=30)


def instance_of(stack, name: str):
    return next(i for i in stack.store.current.instances if i.name == name)


def test_an_answer_has_the_openai_shape_the_route_headers_and_its_cost(pool):
    raw = client(pool).responses.with_raw_response.create(model="auto", input=QUESTION,
                                                          instructions="Answer in one paragraph.")
    answer = raw.parse()
    check_shape(Response, raw.http_response.json())
    inst = instance_of(pool, raw.headers["X-Route-Instance"])
    assert raw.headers["X-Route-Model"] == inst.model == answer.model
    assert answer.object == "response" and answer.status in ("completed", "incomplete") and answer.output_text
    assert split_id(answer.id)[0] == instance_tag(inst)  # the id names the instance that stored it
    usage = answer.usage
    assert usage.input_tokens > 10 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    cost = predicted_cost(usage.input_tokens, usage.output_tokens, per_token(inst.price_input_per_mtok),
                          per_token(inst.price_output_per_mtok))
    assert usage.model_extra["cost_usd"] == pytest.approx(cost)
    assert float(raw.headers["X-Route-Cost-USD"]) == pytest.approx(cost)


def test_a_stream_sends_every_event_in_order_and_its_costed_usage(pool):
    with client(pool).responses.with_streaming_response.create(model="auto", input=QUESTION, stream=True,
                                                               max_output_tokens=60,
                                                               extra_body={"routing": {"slo_s": 60}}) as raw:
        events = list(raw.parse())
        inst = instance_of(pool, raw.headers["X-Route-Instance"])
    for event in events:
        check_shape(EVENTS[event.type], event.model_dump(mode="json", exclude_unset=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert deltas and kinds[4:-4] == ["response.output_text.delta"] * len(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert final.output_text == "".join(deltas) == events[-4].text
    assert events[0].response.id == final.id and split_id(final.id)[0] == instance_tag(inst)
    assert 0 < final.usage.output_tokens <= 60 and final.usage.model_extra["slo_met"] is True
    assert final.usage.model_extra["cost_usd"] == pytest.approx(predicted_cost(
        final.usage.input_tokens, final.usage.output_tokens, per_token(inst.price_input_per_mtok),
        per_token(inst.price_output_per_mtok)))


def test_a_budget_clamps_max_output_tokens_and_the_slo_is_judged(pool):
    model = "Qwen/Qwen2.5-3B-Instruct"
    inst = next(i for i in pool.store.current.instances if i.model == model)
    prompt = pool.gateway.token_counter.count_chat([{"role": "user", "content": QUESTION}])
    budget = predicted_cost(prompt, 12, per_token(inst.price_input_per_mtok), per_token(inst.price_output_per_mtok))
    raw = client(pool).responses.with_raw_response.create(
        model=model, input=QUESTION, extra_body={"routing": {"budget_usd": budget, "slo_s": 60}})
    answer = raw.parse()
    assert raw.headers["X-Route-Max-Tokens"] == "12" and raw.headers["X-Route-SLO-Met"] == "true"
    assert answer.status == "incomplete" and answer.incomplete_details.reason == "max_output_tokens"
    assert answer.usage.output_tokens == 12 and answer.usage.model_extra["cost_usd"] <= budget * (1 + 1e-9)
    assert answer.usage.model_extra["slo_met"] is True


def test_a_follow_up_goes_to_the_instance_that_stored_the_response(pool):
    c = client(pool)
    first = c.responses.with_raw_response.create(model="auto", input=QUESTION, max_output_tokens=30)
    answer, where = first.parse(), first.headers["X-Route-Instance"]
    for streamed in (False, True):
        kwargs = {"model": "auto", "input": "Now say it in one sentence.", "previous_response_id": answer.id,
                  "max_output_tokens": 30}
        if streamed:
            with c.responses.with_streaming_response.create(stream=True, **kwargs) as raw:
                assert raw.headers["X-Route-Instance"] == where
                follow = list(raw.parse())[-1].response
        else:
            raw = c.responses.with_raw_response.create(**kwargs)
            assert raw.headers["X-Route-Instance"] == where
            follow = raw.parse()
        assert follow.previous_response_id == answer.id
        # The instance built the prompt from the stored conversation: the first question and answer are in it.
        assert follow.usage.input_tokens > answer.usage.input_tokens + answer.usage.output_tokens
        answer = follow  # and a streamed response is stored too: the next turn continues it


def test_a_response_its_instance_does_not_hold_is_a_404_and_the_instance_stays_well(pool):
    inst = pool.store.current.instances[0]
    with pytest.raises(openai.NotFoundError) as e:  # as if the instance had restarted since
        client(pool).responses.create(model="auto", input="Go on.",
                                      previous_response_id=client_id(inst, "resp_forgotten"))
    assert "resp_forgotten" in e.value.message
    ready = httpx.get(pool.root + "/health/ready", timeout=5).json()
    assert inst.name not in ready["cooling_down"]
    with pytest.raises(openai.NotFoundError) as e:
        client(pool).responses.create(model="auto", input="Go on.", previous_response_id="resp_made_up")
    assert e.value.code == "previous_response_not_found"


def test_a_follow_up_whose_instance_left_the_pool_is_told_so(pool):
    raw = client(pool).responses.with_raw_response.create(model="auto", input=QUESTION, max_output_tokens=30)
    gone = raw.headers["X-Route-Instance"]
    text = pool.config_path.read_text()
    kept = [i for i in pool.store.current.instances if i.name != gone]
    try:
        pool.config_path.write_text(_without_instance(text, gone))
        assert pool.run(pool.gateway.reload, "test")[0]
        assert len(pool.store.current.instances) == len(kept)
        with pytest.raises(openai.NotFoundError) as e:
            client(pool).responses.create(model="auto", input="Go on.", previous_response_id=raw.parse().id)
        assert e.value.code == "previous_response_gone" and "no longer in the pool" in e.value.message
    finally:
        pool.config_path.write_text(text)
        assert pool.run(pool.gateway.reload, "test")[0]


def test_a_follow_up_whose_instance_is_down_is_told_so_and_after_its_restart_the_response_is_gone(pool):
    c = client(pool)
    raw = c.responses.with_raw_response.create(model="auto", input=QUESTION, max_output_tokens=20)
    name, first = raw.headers["X-Route-Instance"], raw.parse()
    pool.call(pool.pool.set_faults(name, down=True))
    try:
        with pytest.raises(openai.APIStatusError) as e:  # the gateway learns it is down: it is refused, naming it
            c.responses.create(model="auto", input="Go on.", previous_response_id=first.id)
        # 502 when the follow-up's own attempt found it down; 503 when a scrape of its metrics found it first
        assert e.value.status_code == 502 or e.value.code == "previous_response_unavailable"
        assert name in e.value.message
        with pytest.raises(openai.APIStatusError) as e:  # then it is cooling down: said at once
            c.responses.create(model="auto", input="Go on.", previous_response_id=first.id)
        assert e.value.status_code == 503 and e.value.code == "previous_response_unavailable"
    finally:
        pool.call(pool.pool.set_faults(name, down=False))
    pool.wait_routable()
    with pytest.raises(openai.NotFoundError) as e:  # a restarted server has lost what it stored, as vLLM does
        c.responses.create(model="auto", input="Go on.", previous_response_id=first.id)
    assert "not found" in e.value.message


def test_an_instance_keeps_a_bounded_number_of_responses_the_least_recently_used_forgotten_first():
    store = ResponseStore(bound=2)
    store.put("a", [{"role": "user", "content": "1"}])
    store.put("b", [])
    assert store.get("a") is not None  # now b is the least recently used
    store.put("c", [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None


def _without_instance(toml: str, name: str) -> str:
    """The config text without the [[instances]] table of `name`."""
    blocks = toml.split("[[instances]]")
    return "[[instances]]".join(b for b in blocks if f'name = "{name}"' not in b)


def test_a_follow_up_naming_another_model_is_refused(pool):
    raw = client(pool).responses.with_raw_response.create(model="auto", input=QUESTION, max_output_tokens=30)
    other = next(m for m in pool.store.current.models() if m != raw.headers["X-Route-Model"])
    with pytest.raises(openai.BadRequestError) as e:
        client(pool).responses.create(model=other, input="Go on.", previous_response_id=raw.parse().id)
    assert e.value.code == "previous_response_model"


@pytest.mark.parametrize("body, param", [
    ({"model": "auto"}, "input"),
    ({"model": "auto", "input": 5}, "input"),
    ({"model": "auto", "input": []}, "input"),
    ({"model": "auto", "input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"model": "auto", "input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"model": "auto", "input": "hi", "instructions": 3}, "instructions"),
    ({"model": "auto", "input": "hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"model": "auto", "input": "hi", "stream": "yes"}, "stream"),
    ({"model": "auto", "input": "hi", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "hi"}, "model"),
])
def test_bad_input_is_a_400_in_the_openai_shape(pool, body, param):
    r = httpx.post(pool.base_url + "/responses", json=body, timeout=10)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param


def test_feedback_takes_a_response_id(pool):
    answer = client(pool).responses.create(model="auto", input=QUESTION, max_output_tokens=30)
    r = httpx.post(pool.base_url + "/feedback", json={"id": answer.id, "score": 0.9}, timeout=10)
    assert r.status_code == 200 and r.json()["accepted"] is True
    assert httpx.post(pool.base_url + "/feedback", json={"id": answer.id + "x", "score": 0.9},
                      timeout=10).status_code == 404


# ---- the budget's stop, in front of an instance that ignores its token limit ----------------------------------

KEY = "rb-responses-key"
STUB_DELTAS = 300  # one token each, 5 ms apart, whatever max_output_tokens says


class ResponsesStub(Stub):
    """An instance whose /v1/responses streams `mode["deltas"]` tokens (STUB_DELTAS), ignoring
    max_output_tokens; with `mode["complete"]`, then a response.completed without usage."""

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/responses", self._responses)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", self.port).start()

    async def _responses(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = {"id": "resp_stub", "object": "response", "created_at": 1, "model": body["model"], "output": [],
                "parallel_tool_calls": True, "tool_choice": "auto", "tools": [], "status": "in_progress", "usage": None}
        where = {"item_id": "msg_stub", "output_index": 0, "content_index": 0}
        events = [{"type": "response.created", "response": head},
                  {"type": "response.output_item.added", "output_index": 0,
                   "item": {"id": "msg_stub", "type": "message", "role": "assistant", "status": "in_progress",
                            "content": []}},
                  {"type": "response.content_part.added", **where,
                   "part": {"type": "output_text", "text": "", "annotations": []}}]
        written = 0
        try:
            for number, event in enumerate(events):
                await resp.write(named_event({**event, "sequence_number": number}))
            deltas = self.mode.get("deltas", STUB_DELTAS)
            for k in range(deltas):
                await resp.write(named_event({"type": "response.output_text.delta", **where, "delta": TOKEN,
                                              "logprobs": [], "sequence_number": len(events) + k}))
                written = k + 1
                await asyncio.sleep(0.005)
            if self.mode.get("complete"):
                await resp.write(named_event({"type": "response.completed", "sequence_number": len(events) + deltas,
                                              "response": {**head, "status": "completed"}}))
            self.mode["closed_after"] = None  # ran to its end: the stop never came
        except ConnectionResetError:
            self.mode["closed_after"] = written
        return resp


def test_a_budget_that_runs_out_ends_the_stream_cleanly_and_is_paid_once(tmp_path):
    stub = ResponsesStub()
    keys = [{"name": "a", "sha256": hash_key(KEY)}]
    stack = StubStack(stub_config(tmp_path, [stub], auth={"keys": keys}, state={"path": str(tmp_path / "s.db")}),
                      [stub])
    try:
        prompt_tokens = stack.gateway.token_counter.count_chat([{"role": "user", "content": QUESTION}])
        price_in, price_out = per_token(0.2), per_token(0.4)  # the stub instance's
        budget = predicted_cost(prompt_tokens, 40, price_in, price_out)
        events = list(client(stack, KEY).responses.create(model=MODEL, input=QUESTION, stream=True,
                                                          extra_body={"routing": {"budget_usd": budget}}))
        assert stub.requests[-1][1]["max_output_tokens"] == 40  # the clamp went upstream; the stub ignored it
        wait_for(lambda: "closed_after" in stub.mode, 5, "the stub to notice the close")
        assert stub.mode["closed_after"] is not None and stub.mode["closed_after"] < STUB_DELTAS
        kinds = [e.type for e in events]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done",
                              "response.output_item.done", "response.incomplete"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        for event in events[-4:]:  # the gateway's own, closing the stream
            check_shape(EVENTS[event.type], event.model_dump(mode="json", exclude_unset=True))
        final = events[-1]
        delivered = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert final.response.status == "incomplete" and final.response.incomplete_details.reason == "max_output_tokens"
        assert final.response.output_text == delivered == events[-4].text and delivered == TOKEN * 40
        assert final.model_extra["routebalance"]["budget_exhausted"] is True
        usage = final.response.usage
        assert usage.output_tokens == 40 and usage.model_extra["cost_usd"] <= budget * (1 + 1e-9)

        paid = usage.model_extra["cost_usd"]
        wait_for(lambda: spent(tmp_path / "s.db", "a") == pytest.approx(paid), 5, "the stream's booking")
        time.sleep(0.3)  # nothing books it a second time
        assert spent(tmp_path / "s.db", "a") == pytest.approx(paid)
    finally:
        stack.stop()


def test_a_stream_without_usage_is_costed_by_counting_what_was_delivered(tmp_path):
    stub = ResponsesStub(mode={"deltas": 10, "complete": True})
    stack = StubStack(stub_config(tmp_path, [stub]), [stub])
    try:
        events = list(client(stack).responses.create(model=MODEL, input=QUESTION, stream=True))
        assert [e.sequence_number for e in events] == list(range(len(events)))
        final = events[-1]
        assert final.type == "response.completed" and final.response.output_text == ""  # the stub's own
        usage = final.response.usage
        assert usage.output_tokens == 10 and usage.model_extra["cost_source"] == "counted"
        assert usage.input_tokens == stack.gateway.token_counter.count_chat([{"role": "user", "content": QUESTION}])
        assert usage.model_extra["cost_usd"] == pytest.approx(predicted_cost(
            usage.input_tokens, 10, per_token(0.2), per_token(0.4)))
    finally:
        stack.stop()


@pytest.mark.parametrize("extra, shaped", [
    ({}, False),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}]}, True),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": "none"}, False),
    ({"text": {"format": {"type": "json_object"}}}, True),
    ({"text": {"format": {"type": "text"}}}, False),
])
def test_answers_shaped_by_tools_or_a_json_format_are_marked_for_learning_to_leave_out(extra, shaped):
    body = orjson.dumps({"model": "auto", "input": "Weather in Lisbon?", **extra})
    req = parse_responses(body, {}, presets={}, policies=("routebalance",), max_slo_s=86400.0)
    assert req.shaped is shaped
