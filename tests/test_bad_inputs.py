"""Bad requests get the right status and an OpenAI error body; the server keeps serving."""

from __future__ import annotations

import httpx
import pytest

CHAT = "/chat/completions"
GOOD = {"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}

CASES = [
    # (name, path, raw body or json, extra headers, status, param)
    ("malformed json", CHAT, b'{"model": "auto",', {}, 400, None),
    ("empty body", CHAT, b"", {}, 400, None),
    ("body is an array", CHAT, b"[1, 2]", {}, 400, None),
    ("missing model", CHAT, {"messages": [{"role": "user", "content": "x"}]}, {}, 400, "model"),
    ("model not a string", CHAT, {**GOOD, "model": 7}, {}, 400, "model"),
    ("unknown model", CHAT, {**GOOD, "model": "gpt-9"}, {}, 404, "model"),
    ("missing messages", CHAT, {"model": "auto"}, {}, 400, "messages"),
    ("empty messages", CHAT, {**GOOD, "messages": []}, {}, 400, "messages"),
    ("bad role", CHAT, {**GOOD, "messages": [{"role": "wizard", "content": "x"}]}, {}, 400, "messages[0].role"),
    ("content wrong type", CHAT, {**GOOD, "messages": [{"role": "user", "content": 5}]}, {}, 400,
     "messages[0].content"),
    ("negative max_tokens", CHAT, {**GOOD, "max_tokens": -3}, {}, 400, "max_tokens"),
    ("max_tokens a string", CHAT, {**GOOD, "max_tokens": "ten"}, {}, 400, "max_tokens"),
    ("stream not a bool", CHAT, {**GOOD, "stream": "yes"}, {}, 400, "stream"),
    ("temperature out of range", CHAT, {**GOOD, "temperature": 9}, {}, 400, "temperature"),
    ("unknown preset", CHAT, {**GOOD, "routing": {"preset": "fastest"}}, {}, 400, "routing.preset"),
    ("bad weights header", CHAT, GOOD, {"X-Route-Weights": "quality=lots"}, 400, "X-Route-Weights"),
    ("negative budget", CHAT, {**GOOD, "routing": {"budget_usd": -1}}, {}, 400, "routing.budget_usd"),
    ("negative slo", CHAT, {**GOOD, "routing": {"slo_s": -5}}, {}, 400, "routing.slo_s"),
    ("slo not a number", CHAT, {**GOOD, "routing": {"slo_s": "soon"}}, {}, 400, "routing.slo_s"),
    ("absurd slo", CHAT, {**GOOD, "routing": {"slo_s": 1e9}}, {}, 400, "routing.slo_s"),
    ("zero slo header", CHAT, GOOD, {"X-Route-SLO-S": "0"}, 400, "X-Route-SLO-S"),
    ("nan tpot slo header", CHAT, GOOD, {"X-Route-TPOT-SLO-MS": "nan"}, 400, "X-Route-TPOT-SLO-MS"),
    ("bool tpot slo", CHAT, {**GOOD, "routing": {"tpot_slo_ms": True}}, {}, 400, "routing.tpot_slo_ms"),
    ("prompt missing", "/completions", {"model": "auto"}, {}, 400, "prompt"),
    ("context too long for the instance", CHAT, {**GOOD, "max_tokens": 9000}, {}, 400, "max_tokens"),
    ("oversize body", CHAT, {**GOOD, "messages": [{"role": "user", "content": "x" * 1_100_000}]}, {}, 413, None),
    ("unknown path", "/embeddings-nope", GOOD, {}, 404, None),
    # what getting-started lists as not served
    ("token ids as the prompt", "/completions", {"model": "auto", "prompt": [1, 2, 3]}, {}, 400, "prompt"),
    ("a list of prompts", "/completions", {"model": "auto", "prompt": ["a", "b"]}, {}, 400, "prompt"),
    ("a background response", "/responses", {"model": "auto", "input": "hi", "background": True}, {}, 400,
     "background"),
    ("images", "/images/generations", {"model": "auto", "prompt": "a cat"}, {}, 404, None),
]


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.base_url, timeout=30) as c:
        yield c


@pytest.mark.parametrize("name,path,body,headers,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_input_gets_an_openai_error(http, name, path, body, headers, status, param):
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"Content-Type": "application/json", **headers})
    else:
        r = http.post(path, json=body, headers=headers)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param
    # ...and the server still serves a good request afterwards.
    ok = http.post(CHAT, json=GOOD)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"]


def test_wrong_method_is_an_openai_error(http):
    r = http.get(CHAT)
    assert r.status_code == 405 and "error" in r.json()


@pytest.mark.parametrize("body,headers,param", [
    ({**GOOD, "messages": [{"role": ["user"], "content": "x"}]}, {}, "messages[0].role"),
    (GOOD, {"X-Route-Weights": "quality=nan"}, "X-Route-Weights"),
    (GOOD, {"X-Route-Weights": "quality=1e308,cost=1e308"}, "X-Route-Weights"),
    (GOOD, {"X-Route-Budget-USD": "inf"}, "X-Route-Budget-USD"),
])
def test_unhashable_and_non_finite_values_are_400s(http, body, headers, param):
    r = http.post(CHAT, json=body, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_null_optional_fields_are_treated_as_unset(http):
    r = http.post(CHAT, json={**GOOD, "max_completion_tokens": None, "n": None, "stream": None})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == GOOD["max_tokens"]


def test_body_limit_applies_to_chunked_uploads(http):
    def chunks():
        yield b'{"model": "auto", "messages": [{"role": "user", "content": "'
        for _ in range(40):
            yield b"x" * 32768
        yield b'"}]}'
    r = http.post(CHAT, content=chunks(), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
