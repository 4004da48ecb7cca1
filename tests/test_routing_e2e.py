"""Routing through the whole stack with the openai SDK: decisions, presets, budgets, baselines, faults."""

from __future__ import annotations

import asyncio
import concurrent.futures
import tomllib

import httpx
import openai
import orjson
import pytest
from aiohttp import web

from conftest import Stack, dump_toml, free_port, pool_config, wait_for
from gateway.config.store import default_config_path
from gateway.policies import registry
from gateway.tokens import TokenCounter

MODEL_3B, MODEL_72B = "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-72B-Instruct"
PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=60, max_retries=0)
    yield c
    c.close()


def test_answers_carry_the_decision(client, stack):
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=PROMPT, max_tokens=8)
    assert raw.parse().choices[0].message.content
    quality = float(raw.headers["X-Route-Predicted-Quality"])
    assert 0.0 <= quality <= 1.0
    assert float(raw.headers["X-Route-Predicted-Cost-USD"]) > 0
    metrics = httpx.get(stack.root + "/metrics").text
    assert 'routebalance_routed_total{model="' in metrics and "routebalance_batch_size_count" in metrics
    assert "routebalance_estimate_seconds_count" in metrics


def _embed_cache(stack) -> dict[str, float]:
    out = {}
    for line in httpx.get(stack.root + "/metrics").text.splitlines():
        if line.startswith("routebalance_embed_cache_total{"):
            out[line.split('"')[1]] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_prompt_seen_again_takes_its_embedding_from_the_cache(client, stack):
    def cache() -> dict[str, float]:
        return _embed_cache(stack)

    prompt = [{"role": "user", "content": "Name three rivers of Portugal and where each meets the sea."}]
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=prompt, max_tokens=4)
    before = cache()
    assert before["miss"] >= 1
    again = client.chat.completions.with_raw_response.create(model="auto", messages=prompt, max_tokens=4)
    after = cache()
    assert after == {"hit": before["hit"] + 1, "miss": before["miss"]}
    if again.headers["X-Route-Model"] == raw.headers["X-Route-Model"]:  # the same estimate: the same prediction
        assert again.headers["X-Route-Predicted-Quality"] == raw.headers["X-Route-Predicted-Quality"]


def test_a_request_that_names_one_model_is_not_embedded(client, stack):
    """Among one model's instances the prompt cannot change the choice much: its model's priors stand in, and the
    prompt costs no embedding (the time to its first token). A request that may go to several models is embedded."""
    client.chat.completions.create(model="auto", messages=PROMPT, max_tokens=2)  # the metric's labels exist
    prompt = [{"role": "user", "content": "List the planets in order from the sun, with one fact about each."}]
    before = _embed_cache(stack)
    raw = client.chat.completions.with_raw_response.create(model=MODEL_3B, messages=prompt, max_tokens=4)
    assert raw.headers["X-Route-Model"] == MODEL_3B and float(raw.headers["X-Route-Predicted-Cost-USD"]) > 0
    assert _embed_cache(stack) == before
    client.chat.completions.create(model="auto", messages=prompt, max_tokens=4)
    assert _embed_cache(stack)["miss"] == before["miss"] + 1


def test_presets_move_requests_between_tiers(client):
    prompts = [f"Write a detailed proof that there are infinitely many primes, variant {n}." for n in range(6)]
    prompts += [f"Say hello to user {n}." for n in range(6)]

    def served(preset: str) -> list[str]:
        out = []
        for p in prompts:
            raw = client.chat.completions.with_raw_response.create(
                model="auto", messages=[{"role": "user", "content": p}], max_tokens=2,
                extra_body={"routing": {"preset": preset}})
            out.append(raw.headers["X-Route-Model"])
        return out

    quality, cost = served("quality"), served("cost")
    assert quality.count(MODEL_3B) < cost.count(MODEL_3B)
    assert cost.count(MODEL_3B) >= len(prompts) // 2


def test_a_budget_that_cannot_pay_for_the_input_is_refused(client):
    with pytest.raises(openai.APIStatusError) as err:
        client.chat.completions.create(model="auto", messages=PROMPT, extra_body={"routing": {"budget_usd": 1e-9}})
    assert err.value.status_code == 402
    assert "budget" in err.value.message


def test_a_budget_below_the_predicted_answer_is_refused_and_the_clamp_cuts_what_is_served(client, stack):
    # The prompt costs n x 0.06e-6 USD on 3B and n x 0.07e-6 on 7B; the budget leaves 3B
    # ten answer tokens and 7B not even one.
    messages = [{"role": "user", "content": "Summarise the history of the printing press in Europe. " * 6}]
    n = TokenCounter().count_chat(messages)
    budget = (n + 10.5) * 0.06e-6
    assert budget < (n + 1) * 0.07e-6
    # RouteBalance's filter (Eq. 2): no candidate's predicted answer fits, so it is refused, not rerouted.
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(model="auto", messages=messages, max_tokens=500,
                                       extra_body={"routing": {"budget_usd": budget}})
    assert refused.value.status_code == 402 and "predicted cost" in refused.value.message
    # A pipeline baseline has no filter: the dispatch clamp cuts the 3B's answer to what the budget buys.
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL_3B, messages=messages, max_tokens=500,
        extra_body={"routing": {"budget_usd": budget, "policy": "passthrough+round_robin"}})
    resp = raw.parse()
    assert raw.headers["X-Route-Model"] == MODEL_3B
    assert int(raw.headers["X-Route-Max-Tokens"]) == 10
    assert resp.usage.prompt_tokens == n and resp.usage.completion_tokens <= 10
    assert resp.usage.model_extra["cost_usd"] <= budget


def test_every_pipeline_baseline_routes(stack):
    with httpx.Client(timeout=60) as http:
        for policy in registry.names():
            r = http.post(stack.base_url + "/chat/completions", headers={"X-Route-Policy": policy},
                          json={"model": "auto", "messages": PROMPT, "max_tokens": 2})
            assert r.status_code == 200, (policy, r.text)
            assert r.headers["X-Route-Model"] in stack.store.current.models()
            # A pool model name keeps every policy inside that model's instances.
            r = http.post(stack.base_url + "/chat/completions", headers={"X-Route-Policy": policy},
                          json={"model": MODEL_3B, "messages": PROMPT, "max_tokens": 2})
            assert r.status_code == 200 and r.headers["X-Route-Model"] == MODEL_3B
        r = http.post(stack.base_url + "/chat/completions", headers={"X-Route-Policy": "nope+random"},
                      json={"model": "auto", "messages": PROMPT})
        assert r.status_code == 400 and r.json()["error"]["param"] == "routing.policy"


def test_losing_the_72b_tier_serves_everything_from_the_rest(tmp_path, built):
    """Both 72B instances go down mid-run; every request still succeeds, on the other tiers."""
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    stack = Stack(path)
    try:
        data = tomllib.loads(path.read_text())
        for inst in data["instances"]:
            if inst["model"] == MODEL_72B:
                inst["faults"] = {"down": True}
        path.write_text(dump_toml(data))
        assert stack.gateway.reload("test")[0]
        stack.call(asyncio.sleep(0.3))  # let the emulator close the two ports

        def one(n: int) -> httpx.Response:
            return httpx.post(stack.base_url + "/chat/completions", timeout=60,
                              headers={"X-Route-Preset": "quality"},
                              json={"model": "auto", "max_tokens": 4,
                                    "messages": [{"role": "user", "content": f"Prove theorem {n} carefully."}]})

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            answers = list(pool.map(one, range(40)))
        assert [r.status_code for r in answers] == [200] * 40
        assert all(r.headers["X-Route-Model"] != MODEL_72B for r in answers)
    finally:
        stack.stop()


def test_a_full_queue_answers_429(tmp_path):
    # A long window holds the first request in the queue; the second finds it full.
    path = pool_config(tmp_path, batching={"mode": "window", "max_queue": 1,
                                           "rules": [{"below": 1.01, "size": 32, "window_ms": 1500.0}]})
    stack = Stack(path)
    try:
        body = {"model": "auto", "messages": PROMPT, "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, stack.base_url + "/chat/completions", json=body, timeout=30)
            wait_for(lambda: len(stack.gateway.scheduler.scheduling_loop.queue) == 1, what="the first request to queue")
            second = httpx.post(stack.base_url + "/chat/completions", json=body, timeout=30)
            assert second.status_code == 429 and second.headers["Retry-After"]
            assert second.json()["error"]["type"] == "rate_limit_error"
            assert first.result().status_code == 200
    finally:
        stack.stop()


# ---- streaming early stop, against an upstream that does not honour max_tokens ----------

SEEN_MAX_TOKENS, FINISHED, ABORTED = web.AppKey("seen", list), web.AppKey("finished", list), web.AppKey("aborted", list)


async def endless_stream(request: web.Request) -> web.StreamResponse:
    """Streams one token per event with running usage, ignoring max_tokens, until the client goes."""
    body = await request.json()
    request.app[SEEN_MAX_TOKENS].append(body.get("max_tokens"))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    try:
        for n in range(1, 2001):
            event = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": MODEL_3B,
                     "choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}],
                     "usage": {"prompt_tokens": 20, "completion_tokens": n, "total_tokens": 20 + n}}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
            await asyncio.sleep(0.001)
        request.app[FINISHED].append(True)
    except (ConnectionResetError, asyncio.CancelledError):
        request.app[ABORTED].append(True)
        raise
    return resp


def test_a_stream_is_stopped_when_its_budget_runs_out(tmp_path):
    data = tomllib.loads(default_config_path().read_text())
    template = next(i for i in data["instances"] if i["model"] == MODEL_3B)
    port = free_port()
    data["instances"] = [{**template, "name": "endless", "url": f"http://127.0.0.1:{port}"}]
    data["server"]["port"] = free_port()
    data["scheduler"]["policy"] = "passthrough+round_robin"
    path = tmp_path / "config.toml"
    path.write_text(dump_toml(data))
    stack = Stack(path, emulate=False)
    app = web.Application()
    app[SEEN_MAX_TOKENS], app[FINISHED], app[ABORTED] = [], [], []
    app.router.add_post("/v1/chat/completions", endless_stream)
    runner = web.AppRunner(app)

    async def start():
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port).start()

    stack.call(start())
    stack.wait_routable()
    try:
        # 20 prompt tokens at 0.06 USD/M = 1.2e-6; 3.0e-6 leaves 1.8e-6, 30 answer tokens.
        budget = 3.0e-6
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0)
        chunks = list(client.chat.completions.create(
            model="auto", messages=[{"role": "user", "content": "go"}], stream=True,
            stream_options={"include_usage": True}, extra_body={"routing": {"budget_usd": budget}}))
        client.close()
        reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        assert reasons == ["length"]
        marked = [c for c in chunks if (c.model_extra or {}).get("routebalance")]
        assert marked and marked[0].model_extra["routebalance"]["budget_exhausted"] is True
        usage = chunks[-1].usage
        assert usage.completion_tokens <= 30 and usage.model_extra["cost_usd"] <= budget
        # The clamp was sent (from the gateway's own count of the prompt); this upstream ignores it.
        n = TokenCounter().count_chat([{"role": "user", "content": "go"}])
        assert app[SEEN_MAX_TOKENS] == [int((budget - n * 0.06e-6) / 0.06e-6 + 1e-6)]
        wait_for(lambda: app[ABORTED], timeout=5, what="the upstream to see its connection closed")
        assert not app[FINISHED]
    finally:
        stack.call(runner.cleanup())
        stack.stop()


def test_a_reload_while_a_request_waits_keeps_it_on_its_model(tmp_path):
    """The pool is reordered while a request waits for its batch: it is still served by the
    model it asked for, and no instance is left counting it afterwards."""
    path = pool_config(tmp_path, batching={"mode": "window", "rules": [{"below": 1.01, "size": 32,
                                                                         "window_ms": 1000.0}]})
    stack = Stack(path)
    try:
        body = {"model": MODEL_3B, "messages": PROMPT, "max_tokens": 2}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            waiting = pool.submit(httpx.post, stack.base_url + "/chat/completions", json=body, timeout=30)
            wait_for(lambda: len(stack.gateway.scheduler.scheduling_loop.queue) == 1, what="the request to queue")
            data = tomllib.loads(path.read_text())
            data["instances"].reverse()  # every instance index now means another instance
            path.write_text(dump_toml(data))
            assert stack.gateway.reload("test")[0]
            answer = waiting.result()
        assert answer.status_code == 200, answer.text
        served = stack.store.current.instance(answer.headers["X-Route-Instance"])
        assert served.model == MODEL_3B and answer.json()["model"] == MODEL_3B
        counted = stack.run(lambda: {n: len(s.in_flight) for n, s in stack.gateway.pool_state.by_name.items()})
        assert sum(counted.values()) == 0, counted
    finally:
        stack.stop()


def test_a_request_not_decided_in_time_is_shed_with_503(tmp_path):
    # A window longer than max_wait_s: the request is still waiting for its batch when its time is up.
    path = pool_config(tmp_path, batching={"mode": "window", "max_wait_s": 0.3,
                                           "rules": [{"below": 1.01, "size": 32, "window_ms": 5000.0}]})
    stack = Stack(path)
    try:
        r = httpx.post(stack.base_url + "/chat/completions", timeout=30,
                       json={"model": "auto", "messages": PROMPT, "max_tokens": 2})
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        assert r.json()["error"]["code"] == "overloaded"
        assert len(stack.gateway.scheduler.scheduling_loop.queue) == 0  # withdrawn, not left to fire later
        assert 'routebalance_rejected_total{reason="overloaded"} 1.0' in httpx.get(stack.root + "/metrics").text
    finally:
        stack.stop()
