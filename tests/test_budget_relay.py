"""Budgets: the max_tokens clamp, and the relay stopping a stream before it overspends."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from types import SimpleNamespace

import aiohttp
import httpx
import openai
import orjson
import pytest
from aiohttp import web
from stubs import LoopThread

from conftest import free_port
from gateway.api.parse import CompletionRequest, RoutingOptions
from gateway.config.store import default_config_path, load_config
from gateway.core.budget import clamp_max_tokens, per_token, predicted_cost
from gateway.lab.emulator.server import EmulatedPool
from gateway.serving.relay import (
    AnswerTooLarge,
    Costing,
    RelayResult,
    _PassThrough,
    asks_continuous_usage,
    open_upstream,
    relay_stream,
    upstream_payload,
)
from gateway.tokens import TokenCounter

MODEL = "Qwen/Qwen2.5-72B-Instruct"
PRICE_IN, PRICE_OUT = 0.38, 0.40  # USD per 1M tokens, the 72B tier's
STUB_PROMPT_TOKENS = 50  # what the stub reports for any prompt: the instance's count is the truth
STUB_CHUNKS = 200  # one token each, 5 ms apart: a second if nobody stops it
AFFORDABLE = 20  # completion tokens BUDGET pays for after the stub's prompt
BUDGET = predicted_cost(STUB_PROMPT_TOKENS, AFFORDABLE, per_token(PRICE_IN), per_token(PRICE_OUT))
MESSAGES = [{"role": "user", "content": "Write a long essay about rivers."}]


# ---- the clamp ---------------------------------------------------------------

def test_clamp_is_what_the_budget_buys_after_the_input():
    p3 = per_token(0.06)  # the 3B tier, in and out
    # 0.0002 - 100 * 6e-8 = 1.94e-4 left; / 6e-8 = 3233.3 tokens
    assert clamp_max_tokens(0.0002, 100, p3, p3) == 3233
    assert clamp_max_tokens(0.0002, 100, p3, p3, requested=500) == 500
    assert clamp_max_tokens(0.0002, 100, p3, p3, requested=5000) == 3233
    # 72B: 200 * 0.38e-6 = 7.6e-5 spent of 1e-4; 2.4e-5 / 0.4e-6 = 60 exactly (float rounding must not cost one)
    assert clamp_max_tokens(1e-4, 200, per_token(0.38), per_token(0.40)) == 60


def test_clamp_refuses_a_budget_that_cannot_pay_the_input_and_one_token():
    pin, pout = per_token(0.38), per_token(0.40)
    assert clamp_max_tokens(1e-5, 100, pin, pout) is None  # the input alone costs 3.8e-5
    assert clamp_max_tokens(100 * pin + 0.5 * pout, 100, pin, pout, requested=10) is None  # half a token left
    assert clamp_max_tokens(100 * pin + pout, 100, pin, pout, requested=10) == 1


def test_clamp_with_free_output_bounds_only_the_input():
    pin = per_token(0.38)
    assert clamp_max_tokens(1e-4, 100, pin, 0.0, requested=700) == 700
    assert clamp_max_tokens(1e-6, 100, pin, 0.0, requested=700) is None
    assert predicted_cost(100, 50, 1e-7, 2e-7) == pytest.approx(2e-5)


def make_request(body: dict, budget_usd: float | None = None) -> CompletionRequest:
    options = body.get("stream_options") or {}
    return CompletionRequest(chat=True, body=body, model=body["model"], stream=bool(body.get("stream")),
                             include_usage=bool(body.get("stream") and options.get("include_usage")),
                             prompt_text="", max_tokens=body.get("max_completion_tokens", body.get("max_tokens")),
                             routing=RoutingOptions(budget_usd=budget_usd))


def test_upstream_payload_sets_the_clamp_in_the_field_the_client_used():
    inst = SimpleNamespace(model=MODEL)
    base = {"model": "auto", "messages": MESSAGES, "stream": True}
    for given, field in (({}, "max_tokens"), ({"max_tokens": 900}, "max_tokens"),
                         ({"max_completion_tokens": 900}, "max_completion_tokens")):
        sent = orjson.loads(upstream_payload(make_request({**base, **given}), inst, max_tokens=37,
                                             continuous_usage=True))
        other = "max_completion_tokens" if field == "max_tokens" else "max_tokens"
        assert sent[field] == 37 and other not in sent and sent["model"] == MODEL
        assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    plain = orjson.loads(upstream_payload(make_request({**base, "max_tokens": 900}), inst))
    assert plain["max_tokens"] == 900 and plain["stream_options"] == {"include_usage": True}


# ---- the early stop, end to end ------------------------------------------------

def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


def chunk(choices: list, usage: dict | None = None) -> dict:
    return {"id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 1, "model": MODEL,
            "choices": choices, **({"usage": usage} if usage else {})}


def usage_of(completion: int) -> dict:
    return {"prompt_tokens": STUB_PROMPT_TOKENS, "completion_tokens": completion,
            "total_tokens": STUB_PROMPT_TOKENS + completion}


STUB = web.AppKey("stub", dict)


async def ignoring_stub(request: web.Request) -> web.StreamResponse:
    """An upstream that streams STUB_CHUNKS tokens whatever max_tokens says,
    with running usage when asked for it (as vLLM's continuous_usage_stats)."""
    state = request.app[STUB]
    body = await request.json()
    state["bodies"].append(body)
    # "stub_plain" (passed through by the gateway) plays an instance that ignores continuous_usage_stats
    running = (body.get("stream_options") or {}).get("continuous_usage_stats") and not body.get("stub_plain")
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    written = 0
    try:
        await resp.write(sse(chunk([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
                                   usage_of(0) if running else None)))
        for i in range(1, STUB_CHUNKS + 1):
            reason = "stop" if i == STUB_CHUNKS else None
            await resp.write(sse(chunk([{"index": 0, "delta": {"content": f" t{i}"}, "finish_reason": reason}],
                                       usage_of(i) if running else None)))
            written = i
            await asyncio.sleep(0.005)
        await resp.write(sse(chunk([], usage_of(STUB_CHUNKS))) + b"data: [DONE]\n\n")
    except ConnectionResetError:
        state["closed_after"] = written
    state["done"].set()
    return resp


GATEWAY = web.AppKey("gateway", dict)


async def mini_gateway(request: web.Request) -> web.StreamResponse:
    """The relay's part of a budgeted request, called as gateway/serving/app.py should call it."""
    g = request.app[GATEWAY]
    body = await request.json()
    routing = body.pop("routing", {})
    req = make_request(body, routing.get("budget_usd"))
    inst, counter = g["instance"], TokenCounter()
    limit, budget = None, req.routing.budget_usd
    input_tokens = counter.count_chat(req.body["messages"])
    if budget is not None:
        limit = clamp_max_tokens(budget, input_tokens, per_token(inst.price_input_per_mtok),
                                 per_token(inst.price_output_per_mtok), req.max_tokens)
    payload = upstream_payload(req, inst, max_tokens=limit, continuous_usage=budget is not None)
    upstream = await open_upstream(g["session"], inst, "/v1/chat/completions", payload,
                                   aiohttp.ClientTimeout(total=30))
    result = RelayResult()
    g["results"].append(result)
    progress = g["progress"] = []
    return await relay_stream(request, upstream, inst, req.include_usage, result,
                              Costing.for_instance(inst, input_tokens, counter.count), budget_usd=budget,
                              continuous_usage=asks_continuous_usage(req), headers={"X-Route-Max-Tokens": str(limit)},
                              on_progress=progress.append)


@pytest.fixture(scope="module")
def budget_stack():
    lt = LoopThread()
    stub_port, gw_port = free_port(), free_port()
    inst = SimpleNamespace(name="stub", model=MODEL, url=f"http://127.0.0.1:{stub_port}", api_key=None,
                           price_input_per_mtok=PRICE_IN, price_output_per_mtok=PRICE_OUT)
    stub_state = {"bodies": [], "done": threading.Event()}
    gw_state = {"instance": inst, "results": []}

    async def start():
        stub, gw = web.Application(), web.Application()
        stub[STUB], gw[GATEWAY] = stub_state, gw_state
        stub.router.add_post("/v1/chat/completions", ignoring_stub)
        gw.router.add_post("/v1/chat/completions", mini_gateway)
        gw_state["session"] = aiohttp.ClientSession()
        runners = [web.AppRunner(stub), web.AppRunner(gw)]
        for runner, port in zip(runners, (stub_port, gw_port), strict=True):
            await runner.setup()
            await web.TCPSite(runner, "127.0.0.1", port).start()
        return runners

    runners = lt.call(start())
    yield SimpleNamespace(base_url=f"http://127.0.0.1:{gw_port}/v1", stub=stub_state, results=gw_state["results"],
                          progress=lambda: gw_state["progress"])

    async def stop():
        await gw_state["session"].close()
        for runner in runners:
            await runner.cleanup()

    lt.call(stop())
    lt.stop()


def reset(stack) -> None:
    stack.stub["done"].clear()
    stack.stub.pop("closed_after", None)


def budgeted_stream(stack, **kwargs):
    reset(stack)
    client = openai.OpenAI(base_url=stack.base_url, api_key="x", max_retries=0, timeout=10)
    kwargs.setdefault("extra_body", {"routing": {"budget_usd": BUDGET}})
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True, **kwargs))
    assert stack.stub["done"].wait(5), "the stub never finished or noticed the close"
    return chunks


def test_stream_stops_at_the_budget_and_aborts_the_upstream(budget_stack):
    chunks = budgeted_stream(budget_stack, stream_options={"include_usage": True})
    # The dispatch asked for the clamp and for running usage; the stub ignored the clamp.
    sent = budget_stack.stub["bodies"][-1]
    input_tokens = TokenCounter().count_chat(MESSAGES)
    assert sent["max_tokens"] == clamp_max_tokens(BUDGET, input_tokens, per_token(PRICE_IN), per_token(PRICE_OUT))
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}

    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "".join(f" t{i}" for i in range(1, AFFORDABLE + 1))
    final = [c for c in chunks if c.choices][-1]
    assert final.choices[0].finish_reason == "length"
    marker = final.model_extra["routebalance"]
    assert marker["budget_exhausted"] is True and marker["budget_usd"] == BUDGET
    assert marker["cost_usd"] <= BUDGET
    assert all(c.usage is None for c in chunks[:-1])  # running usage stays between gateway and instance
    usage = chunks[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (STUB_PROMPT_TOKENS, AFFORDABLE)
    assert usage.model_extra["cost_usd"] == pytest.approx(BUDGET) and usage.model_extra["cost_usd"] <= BUDGET

    assert budget_stack.stub["closed_after"] < STUB_CHUNKS  # the stub stopped writing early
    result = budget_stack.results[-1]
    assert result.budget_exhausted and result.completion_tokens == AFFORDABLE and result.cost_usd <= BUDGET
    assert budget_stack.progress()[-1] == AFFORDABLE


def test_client_that_did_not_ask_for_usage_sees_none(budget_stack):
    reset(budget_stack)
    body = {"model": MODEL, "messages": MESSAGES, "stream": True, "routing": {"budget_usd": BUDGET}}
    r = httpx.post(budget_stack.base_url + "/chat/completions", json=body, timeout=10)
    raw = r.text
    assert budget_stack.stub["done"].wait(5)
    assert r.headers["X-Route-Max-Tokens"] == str(budget_stack.stub["bodies"][-1]["max_tokens"])
    assert '"prompt_tokens"' not in raw and '"budget_exhausted":true' in raw
    assert raw.endswith("data: [DONE]\n\n")
    chunks = budgeted_stream(budget_stack)
    assert all(c.usage is None for c in chunks) and chunks[-1].choices[0].finish_reason == "length"


def test_client_asking_for_running_usage_gets_it_costed(budget_stack):
    chunks = budgeted_stream(budget_stack, stream_options={"include_usage": True, "continuous_usage_stats": True})
    running = [c.usage for c in chunks if c.choices and c.usage is not None]
    assert [u.completion_tokens for u in running] == list(range(AFFORDABLE + 1))  # role chunk, then one a token
    assert all(u.model_extra["cost_usd"] <= BUDGET for u in running)
    assert chunks[-1].usage.completion_tokens == AFFORDABLE


def test_without_running_usage_each_chunk_is_counted_by_the_tokenizer(budget_stack):
    chunks = budgeted_stream(budget_stack, stream_options={"include_usage": True}, extra_body={
        "routing": {"budget_usd": BUDGET}, "stub_plain": True})
    # Each of the stub's chunks (" t17") is several tokens: the stop comes after fewer chunks
    # than the clamp allows tokens, and before the budget is passed.
    clamp = budget_stack.stub["bodies"][-1]["max_tokens"]
    delivered = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert 0 < len(delivered) < clamp
    # Stopped before the instance's usage came: what was delivered is costed by counting its text.
    usage = chunks[-1].usage
    assert usage.model_extra["cost_source"] == "counted"
    assert usage.completion_tokens == TokenCounter().count("".join(delivered)) <= clamp
    assert usage.model_extra["cost_usd"] <= BUDGET
    assert budget_stack.stub["closed_after"] < STUB_CHUNKS


def test_stream_without_budget_runs_to_the_end(budget_stack):
    reset(budget_stack)
    client = openai.OpenAI(base_url=budget_stack.base_url, api_key="x", max_retries=0, timeout=10)
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True))
    assert budget_stack.stub["done"].wait(5)
    assert "closed_after" not in budget_stack.stub
    assert len([c for c in chunks if c.choices]) == STUB_CHUNKS + 1 and all(c.usage is None for c in chunks)
    assert "continuous_usage_stats" not in budget_stack.stub["bodies"][-1]["stream_options"]
    result = budget_stack.results[-1]
    assert not result.budget_exhausted and result.completion_tokens == STUB_CHUNKS
    progress = budget_stack.progress()  # one per event: role chunk, tokens, usage chunk, [DONE]
    assert progress == sorted(progress) and progress[-1] == STUB_CHUNKS + 3


# ---- the emulator's running usage ---------------------------------------------

async def test_emulator_sends_running_usage_when_asked():
    cfg = load_config(default_config_path())
    inst = dataclasses.replace(cfg.instances[-1], url=f"http://127.0.0.1:{free_port()}")
    pool = EmulatedPool(dataclasses.replace(cfg, instances=(inst,)))
    await pool.start()
    try:
        async with aiohttp.ClientSession() as http:
            async def stream(options: dict) -> list[dict]:
                body = {"model": inst.model, "messages": MESSAGES, "max_tokens": 6, "ignore_eos": True,
                        "stream": True, "stream_options": options}
                async with http.post(inst.url + "/v1/chat/completions", json=body) as r:
                    text = (await r.read()).decode()
                return [orjson.loads(e[6:]) for e in text.split("\n\n") if e.startswith("data: {")]

            prompt_tokens = TokenCounter().count_chat(MESSAGES)  # the gateway's count is the emulator's
            events = await stream({"include_usage": True, "continuous_usage_stats": True})
            running = [e["usage"] for e in events if e["choices"]]
            assert all(u["prompt_tokens"] == prompt_tokens for u in running)
            completions = [u["completion_tokens"] for u in running]
            assert completions[0] == 0 and completions == sorted(completions) and completions[-1] == 6
            # The final usage is the last running one, plus what vLLM adds only at the end: the cached tokens.
            final = dict(events[-1]["usage"])
            assert events[-1]["choices"] == [] and "cached_tokens" in final.pop("prompt_tokens_details")
            assert final == running[-1]

            plain = await stream({"include_usage": True})
            assert all("usage" not in e for e in plain if e["choices"]) and plain[-1]["usage"]["completion_tokens"] == 6
    finally:
        await pool.stop()


async def test_a_long_stream_without_usage_is_kept_as_text_past_the_cap():
    """While no usage has come a stream is kept to be counted: as bytes, and past the answer
    cap as its text alone; the count at the end covers all of it."""
    costing = Costing(1e-7, 2e-7, prompt_tokens=5, count=lambda text: len(text.split()), max_answer_bytes=2000)
    result = RelayResult()
    framer = _PassThrough(costing, include_usage=True, result=result)
    word = sse(chunk([{"index": 0, "delta": {"content": " word"}, "finish_reason": None}]))
    for _ in range(100):  # ~15 kB of events, 500 characters of answer
        assert framer.pass_block(word) == (word, False)
    assert framer.compact is not None and framer.kept == []
    tail = await framer.finish()
    assert result.cost_source == "counted" and (result.prompt_tokens, result.completion_tokens) == (5, 100)
    assert b'"cost_source":"counted"' in tail
    with pytest.raises(AnswerTooLarge):  # the text itself past the cap
        for _ in range(400):
            framer.pass_block(word)
