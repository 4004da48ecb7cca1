"""The official openai SDK, pointed at the gateway in front of the emulated pool."""

from __future__ import annotations

import httpx
import openai
import pytest

MODELS_3B = "Qwen/Qwen2.5-3B-Instruct"


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0)
    yield c
    c.close()


@pytest.mark.parametrize("model", ["auto", MODELS_3B])
def test_chat_non_streaming(client, stack, model):
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": "Name three prime numbers."}], max_tokens=12)
    resp = raw.parse()
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content
    assert resp.usage.completion_tokens <= 12 and resp.usage.prompt_tokens > 0
    served = raw.headers["X-Route-Model"]
    assert resp.model == served  # the answer names the pool model that served it
    if model != "auto":
        assert served == model
    inst = stack.store.current.instance(raw.headers["X-Route-Instance"])
    expected = (resp.usage.prompt_tokens * inst.price_input_per_mtok
                + resp.usage.completion_tokens * inst.price_output_per_mtok) / 1e6
    assert resp.usage.model_extra["cost_usd"] == pytest.approx(expected)
    assert float(raw.headers["X-Route-Cost-USD"]) == pytest.approx(expected, abs=1e-10)


@pytest.mark.parametrize("model", ["auto", MODELS_3B])
def test_chat_streaming_with_usage(client, model):
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=8,
        stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    assert text.strip()
    assert reasons == ["length"] or reasons == ["stop"]
    assert usage is not None and usage.completion_tokens == len(text.split())
    assert usage.model_extra["cost_usd"] > 0
    if model != "auto":
        assert all(c.model == model for c in chunks)


def test_streaming_without_usage_hides_the_usage_chunk(client):
    stream = client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "Say hi."}], max_tokens=5, stream=True)
    chunks = list(stream)
    assert chunks and all(c.usage is None for c in chunks)
    assert all(c.choices for c in chunks)  # no usage-only chunk slipped through


@pytest.mark.parametrize("model", ["auto", MODELS_3B])
def test_completions_streaming_and_not(client, model):
    full = client.completions.create(model=model, prompt="The capital of France is", max_tokens=6)
    assert full.choices[0].text and full.usage.completion_tokens <= 6
    parts = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=6, stream=True,
                                           stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in parts if p.choices).strip()
    assert parts[-1].usage.completion_tokens <= 6


def test_models_lists_the_alias_and_every_pool_model(client, stack):
    ids = {m.id for m in client.models.list()}
    assert ids == {"auto", *stack.store.current.models()}


def test_round_robin_spreads_auto_over_the_pool(stack):
    pool = stack.gateway.pool_state
    stack.run(lambda: [pool.of(i.name).health.succeeded(None) for i in stack.store.current.instances])
    seen = set()
    with httpx.Client(timeout=30) as http:
        for _ in range(13):
            r = http.post(stack.base_url + "/chat/completions", headers={"X-Route-Policy": "passthrough+round_robin"},
                          json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
            assert r.status_code == 200
            seen.add(r.headers["X-Route-Instance"])
    assert len(seen) == 13
