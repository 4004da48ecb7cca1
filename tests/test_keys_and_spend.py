"""Keys, spend and budgets at the edge, through the real gateway in front of stub instances
(issue findings 1-3): who may spend, and that no request spends more than it may."""

from __future__ import annotations

import asyncio
import concurrent.futures

import httpx
import openai
import orjson
import pytest
from stubs import MODEL, Stub, StubStack, stub_config, stub_instance

from conftest import free_port, spent, wait_for
from gateway.core.budget import clamp_max_tokens, per_token, predicted_cost
from gateway.tenancy.keys import hash_key

KEY, OTHER = "rb-test-key-a", "rb-test-key-b"
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]
PRICE_IN, PRICE_OUT = per_token(0.2), per_token(0.4)  # stub_instance's prices


def keyed(tmp_path, stubs, limit=None, **key_fields):
    keys = [{"name": "a", "sha256": hash_key(KEY), **({"spend_limit_usd": limit} if limit is not None else {}),
             **key_fields},
            {"name": "b", "sha256": hash_key(OTHER), "models": ["auto"], "requests_per_minute": 2}]
    return stub_config(tmp_path, stubs, auth={"keys": keys}, state={"path": str(tmp_path / "state.db")})


def client(stack, key=KEY, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=20, **kwargs)


@pytest.fixture
def stubs():
    return [Stub(), Stub()]


# ---- keys -----------------------------------------------------------------------

def test_keys_are_required_and_limit_models_and_rate(tmp_path, stubs):
    stack = StubStack(keyed(tmp_path, stubs), stubs)
    try:
        with pytest.raises(openai.AuthenticationError) as e:
            client(stack, key="rb-wrong").chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):  # the pool's model names are not public either
            client(stack, key="rb-wrong").models.list()
        assert MODEL in {m.id for m in client(stack).models.list()}
        r = httpx.post(stack.base_url + "/chat/completions", json={"model": MODEL, "messages": MESSAGES}, timeout=10)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        assert client(stack).chat.completions.create(model=MODEL, messages=MESSAGES).choices

        b = client(stack, key=OTHER)
        assert [m.id for m in b.models.list()] == ["auto"]  # it sees only what it may name
        with pytest.raises(openai.PermissionDeniedError) as e:  # key b may name only "auto"
            b.chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.body["type"] == "permission_error" and e.value.code == "model_not_allowed"
        b.chat.completions.create(model="auto", messages=MESSAGES)  # its first request of the minute...
        with pytest.raises(openai.RateLimitError) as e:  # ...the 403 above counted too: 2 a minute
            b.chat.completions.create(model="auto", messages=MESSAGES)
        assert int(e.value.response.headers["Retry-After"]) >= 1
    finally:
        stack.stop()


def test_anonymous_requests_without_keys_on_loopback_only(tmp_path, stubs):
    stack = StubStack(stub_config(tmp_path, stubs), stubs)
    try:  # no keys, loopback: whatever key the SDK sends is ignored
        assert client(stack, key="anything").chat.completions.create(model=MODEL, messages=MESSAGES).choices
        stack.gateway.host = "0.0.0.0"  # as if it listened beyond loopback after a reload removed the keys
        with pytest.raises(openai.AuthenticationError):
            client(stack).chat.completions.create(model=MODEL, messages=MESSAGES)
    finally:
        stack.stop()


# ---- the surface ------------------------------------------------------------------

def test_admin_is_off_without_a_token_and_posts_must_be_json(tmp_path, stubs):
    stack = StubStack(stub_config(tmp_path, stubs), stubs)
    try:
        assert httpx.post(stack.root + "/admin/reload", timeout=5).status_code == 404
        # A browser page can post text/plain cross-site without a preflight: refused.
        r = httpx.post(stack.base_url + "/chat/completions", timeout=5, headers={"Content-Type": "text/plain"},
                       content=b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}]}')
        assert r.status_code == 415 and r.json()["error"]["message"].startswith("Content-Type must be")
        assert r.json()["error"]["type"] == "invalid_request_error"
        assert stubs[0].requests == [] and stubs[1].requests == []
    finally:
        stack.stop()


def test_admin_token_metrics_port_and_upstream_keys(tmp_path, stubs):
    metrics_port = free_port()
    instances = [stub_instance(stubs[0], "stub-0", api_key="upstream-secret"), stub_instance(stubs[1], "stub-1")]
    path = stub_config(tmp_path, stubs, instances, server={"admin_token": "s3cret", "metrics_port": metrics_port})
    stack = StubStack(path, stubs)
    try:
        assert httpx.post(stack.root + "/admin/reload", timeout=5).status_code == 401
        wrong = {"Authorization": "Bearer s3cre"}
        assert httpx.post(stack.root + "/admin/reload", headers=wrong, timeout=5).status_code == 401
        ok = httpx.post(stack.root + "/admin/reload", headers={"Authorization": "Bearer s3cret"}, timeout=5)
        assert ok.status_code == 200

        for _ in range(2):  # round robin: one request to each stub
            client(stack).chat.completions.create(model=MODEL, messages=MESSAGES)
        sent = {s.url: s.requests[-1][0].get("Authorization") for s in stubs}
        assert sent == {stubs[0].url: "Bearer upstream-secret", stubs[1].url: None}

        assert httpx.get(stack.root + "/metrics", timeout=5).status_code == 404
        page = httpx.get(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5)
        assert page.status_code == 200 and "routebalance_requests_total" in page.text
    finally:
        stack.stop()


# ---- spend ---------------------------------------------------------------------------

def test_keys_whose_ledger_cannot_open_are_refused_not_served_free(tmp_path, stubs):
    path = stub_config(tmp_path, stubs)
    stack = StubStack(path, stubs)
    try:  # a reload adds a limited key, but the state file cannot be made (its directory is a file)
        (tmp_path / "blocker").write_text("")
        text = path.read_text() + (f'\n[state]\npath = "{tmp_path}/blocker/state.db"\n'
                                   f'[[auth.keys]]\nname = "a"\nsha256 = "{hash_key(KEY)}"\nspend_limit_usd = 1e-6\n')
        path.write_text(text)
        assert stack.run(lambda: stack.gateway.reload("test"))[0]
        with pytest.raises(openai.APIStatusError) as e:
            client(stack).chat.completions.create(model=MODEL, messages=MESSAGES)
        assert e.value.status_code == 503 and e.value.code == "ledger_unavailable"
        assert all(not s.requests for s in stubs)
    finally:
        stack.stop()


def test_a_limited_key_never_overspends_under_concurrency_and_keeps_its_spend_across_restarts(tmp_path, stubs):
    # Each answer is 20 tokens (~1.6e-5 USD with its prompt); the key may spend ten of them.
    one = predicted_cost(30, 20, PRICE_IN, PRICE_OUT)
    limit = 10 * one
    path = keyed(tmp_path, stubs, limit=limit)
    stack = StubStack(path, stubs)
    try:
        c = client(stack)

        def ask(_):
            try:
                r = c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
                return r.usage.model_extra["cost_usd"]
            except openai.APIStatusError as e:
                return e.status_code, e.code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(ask, range(40)))
        costs = [o for o in outcomes if isinstance(o, float)]
        refused = [o for o in outcomes if not isinstance(o, float)]
        assert set(refused) == {(402, "spend_limit_exceeded")}
        assert costs and sum(costs) <= limit * (1 + 1e-9)
        assert spent(tmp_path / "state.db", "a") == pytest.approx(sum(costs))
    finally:
        stack.stop()
    again = StubStack(path, stubs)  # a restart: the spend is in the ledger, not in memory
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client(again).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
        assert e.value.status_code == 402 and e.value.code == "spend_limit_exceeded"
    finally:
        again.stop()


def test_a_402_from_the_reservation_says_so_and_how_much_it_reserved(tmp_path, stubs):
    # The key has room for a short answer, but not for the worst case of a prompt with an image: the gateway
    # cannot count an image's tokens, so it reserves the instance's whole context.
    limit = 3 * predicted_cost(30, 20, PRICE_IN, PRICE_OUT)
    stack = StubStack(keyed(tmp_path, stubs, limit=limit), stubs)
    image = [{"role": "user", "content": [{"type": "text", "text": "What is in this picture?"},
                                          {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]
    try:
        c = client(stack)
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=image, max_tokens=20)
        message = e.value.body["message"]
        assert e.value.status_code == 402 and e.value.code == "spend_limit_exceeded"
        assert "worst case" in message and "max_tokens" in message and e.value.body["param"] == "max_tokens"
        reserved = float(message.split("worst case of ")[1].split(" USD")[0])
        assert reserved > limit  # the amount it names is the one that did not fit
        assert c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20).choices  # money was left
    finally:
        stack.stop()


def test_a_stream_whose_client_leaves_on_done_pays_its_real_cost_not_the_worst_case(tmp_path, stubs, monkeypatch):
    """An SDK hangs up as soon as it has [DONE]; aiohttp then cancels the gateway's handler, which may still
    be closing the stream. The answer was complete and costed: the key pays that, not its worst case.
    The hang-up is made certain by cancelling the gateway's own close of the stream."""
    from aiohttp import web

    close = web.StreamResponse.write_eof

    async def client_gone(self, data=b""):
        if "X-Route-Instance" in self.headers:  # the gateway's relay; the stubs close theirs as usual
            raise asyncio.CancelledError
        return await close(self, data)

    monkeypatch.setattr(web.StreamResponse, "write_eof", client_gone)
    for stub in stubs:
        stub.mode["stop"] = 20  # the model ends its answer long before max_tokens
    stack = StubStack(keyed(tmp_path, stubs, limit=1.0), stubs)
    try:
        body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 500, "stream": True,
                "stream_options": {"include_usage": True}}
        lines = []
        with httpx.stream("POST", stack.base_url + "/chat/completions", json=body, timeout=10,
                          headers={"Authorization": f"Bearer {KEY}"}) as r:
            try:
                lines += r.iter_lines()
            except httpx.HTTPError:
                pass  # the connection ends without its last chunk, as the client meant to leave anyway
        assert "data: [DONE]" in lines
        usage = next(orjson.loads(line[6:])["usage"] for line in lines
                     if line.startswith("data: {") and orjson.loads(line[6:]).get("usage"))
        assert usage["completion_tokens"] == 20  # the stub's answer
        wait_for(lambda: spent(tmp_path / "state.db", "a") > 0, what="the attempt's payment")
        # the worst case reserved 500 answer tokens; what is paid is what was served
        assert spent(tmp_path / "state.db", "a") == pytest.approx(usage["cost_usd"])
        page = httpx.get(stack.root + "/metrics", timeout=5).text  # and it counts as served, not as a hang-up
        statuses = {line.split('status="')[1].split('"')[0] for line in page.splitlines()
                    if line.startswith("routebalance_requests_total{")}
        assert statuses == {"200"}
    finally:
        stack.stop()


# ---- budgets that hold (finding 3) -----------------------------------------------------

@pytest.fixture
def budget_stack(tmp_path, stubs):
    stack = StubStack(keyed(tmp_path, stubs), stubs)
    yield stack
    stack.stop()


def routed(stack, budget, **kwargs):
    kwargs.setdefault("extra_body", {"routing": {"budget_usd": budget}})
    return client(stack).chat.completions.with_raw_response.create(model=MODEL, **kwargs)


def test_a_budget_without_max_tokens_is_clamped_to_the_context(budget_stack):
    raw = routed(budget_stack, 1.0, messages=MESSAGES)  # buys millions of tokens: the context bounds it
    sent = max(s.requests[-1][1]["max_tokens"] for s in budget_stack.stubs if s.requests)
    assert sent <= 8192 - 20 and int(raw.headers["X-Route-Max-Tokens"]) == sent


def test_n_answers_are_all_inside_the_budget(budget_stack):
    budget = predicted_cost(30, 100, PRICE_IN, PRICE_OUT)
    answer = routed(budget_stack, budget, messages=MESSAGES, n=8).parse()
    assert len(answer.choices) == 8
    assert answer.usage.completion_tokens > 0 and answer.usage.model_extra["cost_usd"] <= budget * (1 + 1e-9)


def test_function_definitions_are_paid_for_inside_the_budget(budget_stack):
    tools = [{"type": "function", "function": {"name": f"tool_{k}", "description": "looks things up " * 40,
                                                "parameters": {"type": "object", "properties": {}}}}
             for k in range(8)]
    budget = predicted_cost(3000, 100, PRICE_IN, PRICE_OUT)
    answer = routed(budget_stack, budget, messages=MESSAGES, tools=tools).parse()
    assert answer.usage.prompt_tokens > 1000  # the stub counts the signatures, as vLLM does
    assert answer.usage.model_extra["cost_usd"] <= budget * (1 + 1e-9)


def test_an_instance_without_usage_is_costed_by_counting(budget_stack, tmp_path):
    for stub in budget_stack.stubs:
        stub.mode["usage"] = False
    answer = client(budget_stack).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)
    usage = answer.usage.model_extra
    assert usage["cost_source"] == "counted" and answer.usage.completion_tokens == 12 and usage["cost_usd"] > 0

    chunks = list(client(budget_stack).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=9, stream=True, stream_options={"include_usage": True}))
    final = chunks[-1].usage
    assert final.completion_tokens == 9 and final.model_extra["cost_source"] == "counted"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " w" * 9
    expected = usage["cost_usd"] + final.model_extra["cost_usd"]
    # Both booked against the key; a stream is booked once it has ended, which its client may see first.
    wait_for(lambda: spent(tmp_path / "state.db", "a") == pytest.approx(expected), timeout=5,
             what="the stream's booking")

    def counted() -> float:
        page = httpx.get(budget_stack.root + "/metrics", timeout=5).text
        line = next(x for x in page.splitlines() if x.startswith('routebalance_key_spend_usd_total{key="a"}'))
        return float(line.split()[-1])
    wait_for(lambda: counted() == pytest.approx(expected), timeout=5, what="the stream's spend in /metrics")


def test_a_retried_request_pays_for_both_attempts_within_its_budget(budget_stack, tmp_path):
    # Round robin takes the instances in a seeded order: a first request shows which one comes next.
    warm = client(budget_stack).chat.completions.create(model=MODEL, messages=MESSAGES)
    good, bad = sorted(budget_stack.stubs, key=lambda s: -len(s.requests))  # the next turn is the other's
    bad.mode["status"] = 500
    budget = predicted_cost(30, 50, PRICE_IN, PRICE_OUT)
    answer = routed(budget_stack, budget, messages=MESSAGES).parse()
    assert (len(bad.requests), len(good.requests)) == (1, 2)
    prompt = answer.usage.prompt_tokens
    first_attempt = predicted_cost(prompt, 0, PRICE_IN, PRICE_OUT)  # it read the prompt, then failed
    # The retry was clamped to what the first attempt left of the budget...
    left = budget - first_attempt
    assert good.requests[-1][1]["max_tokens"] == clamp_max_tokens(left, prompt, PRICE_IN, PRICE_OUT)
    assert clamp_max_tokens(left, prompt, PRICE_IN, PRICE_OUT) < clamp_max_tokens(budget, prompt, PRICE_IN, PRICE_OUT)
    # ...and the key pays for both, no more than the budget in all.
    total = spent(tmp_path / "state.db", "a") - warm.usage.model_extra["cost_usd"]
    assert total == pytest.approx(first_attempt + answer.usage.model_extra["cost_usd"])
    assert total <= budget * (1 + 1e-9)


def test_free_output_is_not_refused(tmp_path, stubs):
    instances = [stub_instance(s, f"free-{k}", price_output_per_mtok=0.0) for k, s in enumerate(stubs)]
    stack = StubStack(stub_config(tmp_path, stubs, instances), stubs)
    try:
        answer = routed(stack, 1e-4, messages=MESSAGES).parse()
        assert answer.choices and answer.usage.model_extra["cost_usd"] <= 1e-4
    finally:
        stack.stop()
