"""Progressive mode through the real gateway on the emulated pool, with the official openai SDK: a large
model sketches, small ones expand each point, the gateway answers once (streamed in point order), pays
for every call against the key and the budget, and falls back to normal routing when the rule says so."""

from __future__ import annotations

import re
import time

import httpx
import openai
import pytest

from conftest import Stack, pool_config
from gateway.core.progressive import ProgressiveLimits
from gateway.tenancy.keys import hash_key

M72 = "Qwen/Qwen2.5-72B-Instruct"
BIG, TINY = "rb-prog-big", "rb-prog-tiny"
BIG_LIMIT = 100.0
QUESTION = "Explain the main causes and the long-term consequences of the French Revolution for Europe."
PROGRESSIVE = {"routing": {"mode": "progressive"}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory, built):
    tmp = tmp_path_factory.mktemp("progressive-mode")
    keys = [{"name": "big", "sha256": hash_key(BIG), "spend_limit_usd": BIG_LIMIT},
            {"name": "tiny", "sha256": hash_key(TINY), "spend_limit_usd": 2e-6}]
    # The length rule off: these tests' question must be sketched whatever the small build predicts for it
    # (test_short_answer_rule_reads_the_predicted_length turns it on).
    s = Stack(pool_config(tmp, built[0].estimators.models_dir, auth={"keys": keys},
                          state={"path": str(tmp / "state.db")}, progressive={"min_answer_tokens": 0}))
    s.wait_routable()
    yield s
    s.stop()


def client(stack, key=BIG) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, timeout=30, max_retries=0)


def ask(c, prompt=QUESTION, **kw):
    return c.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": prompt}], **kw)


def counter(stack, name: str, **labels) -> float:
    text = httpx.get(stack.root + "/metrics", timeout=5).text
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(name + "{" + want + "}") or (not labels and line.startswith(name + " ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def served(stack) -> dict[str, float]:
    """What the emulated instances served, summed over the pool (their vLLM counters)."""
    totals = {"prompt": 0.0, "generation": 0.0, "requests": 0.0}
    names = {"vllm:prompt_tokens_total": "prompt", "vllm:generation_tokens_total": "generation",
             "vllm:request_success_total": "requests"}
    for inst in stack.store.current.instances:
        for line in httpx.get(inst.url + "/metrics", timeout=5).text.splitlines():
            m = re.match(r"([\w:]+)(\{[^}]*\})? ([0-9.e+-]+)$", line)
            if m and m.group(1) in names:
                totals[names[m.group(1)]] += float(m.group(3))
    return totals


def booked(stack, name: str) -> float:
    key = next(k for k in stack.store.current.auth.keys if k.name == name)
    remaining = stack.gateway.spend.remaining(key, time.time())
    return key.spend_limit_usd - remaining


def check_parts(parts: list[str], k: int) -> None:
    """The answer's pieces are the points 1..k, in order, each once."""
    assert len(parts) == k
    for i, part in enumerate(parts):
        prefix = f"{i + 1}. " if i == 0 else f"\n\n{i + 1}. "
        assert part.startswith(prefix), (i, part)
        assert len(part.strip()) > len(prefix.strip())


def split_points(content: str) -> list[str]:
    pieces = content.split("\n\n")
    return [p if i == 0 else "\n\n" + p for i, p in enumerate(pieces)]


def test_non_streamed_progressive_answer_sums_every_call(stack):
    c = client(stack)
    before, spent_before = served(stack), booked(stack, "big")
    count_before = counter(stack, "routebalance_progressive_requests_total", result="progressive")
    raw = ask(c, extra_body=PROGRESSIVE)
    r = raw.parse()
    after = served(stack)
    assert raw.headers["X-Route-Mode"] == "progressive"
    k, cands = int(raw.headers["X-Route-Points"]), int(raw.headers["X-Route-Candidates"])
    assert 2 <= k <= ProgressiveLimits().max_points and 1 <= cands <= ProgressiveLimits().candidates
    assert r.model == M72 and r.object == "chat.completion"
    assert r.choices[0].finish_reason == "stop" and r.choices[0].message.role == "assistant"
    check_parts(split_points(r.choices[0].message.content), k)
    # one sketch and k x candidates expansions, and usage is their sum (the emulated pool's own counts)
    assert after["requests"] - before["requests"] == 1 + k * cands
    assert r.usage.completion_tokens == after["generation"] - before["generation"]
    assert r.usage.prompt_tokens == after["prompt"] - before["prompt"]
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    normal = ask(c).parse()  # a single call of the same question reads one prompt
    assert r.usage.prompt_tokens > normal.usage.prompt_tokens
    cost = r.usage.model_extra["cost_usd"]
    assert cost > 0 and float(raw.headers["X-Route-Cost-USD"]) == pytest.approx(cost, abs=1e-10)
    # the key is booked exactly what the answer says it cost (plus the normal request's own cost)
    assert booked(stack, "big") - spent_before == pytest.approx(cost + normal.usage.model_extra["cost_usd"],
                                                                rel=1e-6, abs=1e-12)
    assert counter(stack, "routebalance_progressive_requests_total", result="progressive") == count_before + 1


def test_streamed_progressive_answer_arrives_in_point_order(stack):
    c = client(stack)
    before, spent_before = served(stack), booked(stack, "big")
    raw = ask(c, stream=True, stream_options={"include_usage": True},
              extra_headers={"X-Route-Mode": "progressive"})
    assert raw.headers["X-Route-Mode"] == "progressive"
    k, cands = int(raw.headers["X-Route-Points"]), int(raw.headers["X-Route-Candidates"])
    parts, usage, finish = [], None, None
    for chunk in raw.parse():
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            finish = ch.finish_reason or finish
    after = served(stack)
    assert finish == "stop" and usage is not None
    check_parts(parts, k)  # one chunk per point, point 1 first, in order
    assert after["requests"] - before["requests"] == 1 + k * cands
    assert usage.completion_tokens == after["generation"] - before["generation"]
    assert usage.prompt_tokens == after["prompt"] - before["prompt"]
    assert booked(stack, "big") - spent_before == pytest.approx(usage.model_extra["cost_usd"], rel=1e-6, abs=1e-12)
    # the same answer, not streamed, has the same shape
    assert counter(stack, "routebalance_progressive_points_total", result="expanded") >= k


def test_streamed_without_usage_has_no_usage_chunk(stack):
    chunks = list(client(stack).chat.completions.create(
        model="auto", messages=[{"role": "user", "content": QUESTION}], stream=True, extra_body=PROGRESSIVE))
    assert all(ch.usage is None for ch in chunks)
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices).startswith("1. ")


def test_code_prompt_falls_back_to_normal_routing(stack):
    before = counter(stack, "routebalance_progressive_requests_total", result="code")
    raw = ask(client(stack), "Write a Python function that reverses a linked list in place.", extra_body=PROGRESSIVE,
              max_tokens=30)
    r = raw.parse()
    assert raw.headers["X-Route-Mode"] == "normal" and raw.headers["X-Route-Fallback"] == "code"
    assert "X-Route-Points" not in raw.headers and "X-Route-Fallback-Cost-USD" not in raw.headers
    assert r.choices[0].message.content and r.model == raw.headers["X-Route-Model"]
    assert counter(stack, "routebalance_progressive_requests_total", result="code") == before + 1


@pytest.mark.parametrize(("where", "param"), [("body", "routing.mode"), ("header", "X-Route-Mode")])
def test_unknown_mode_is_a_400_naming_its_param(stack, where, param):
    kw = ({"extra_body": {"routing": {"mode": "turbo"}}} if where == "body"
          else {"extra_headers": {"X-Route-Mode": "turbo"}})
    with pytest.raises(openai.BadRequestError) as e:
        ask(client(stack), **kw)
    assert e.value.status_code == 400 and e.value.param == param
    assert "turbo" in e.value.message


def test_progressive_is_for_one_chat_answer(stack):
    c = client(stack)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="auto", prompt=QUESTION, extra_body=PROGRESSIVE)
    assert e.value.param == "routing.mode" and "chat" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        ask(c, n=2, extra_body=PROGRESSIVE)
    assert e.value.param == "n"


def test_tiny_budget_falls_back_or_refuses_and_books_what_it_says(stack):
    c = client(stack)
    before = counter(stack, "routebalance_progressive_requests_total", result="budget")
    spent_before = booked(stack, "big")
    try:
        r = ask(c, extra_body={"routing": {"mode": "progressive", "budget_usd": 2e-6}}).parse()
    except openai.APIStatusError as e:
        assert e.status_code == 402
        assert booked(stack, "big") == pytest.approx(spent_before, abs=1e-12)
    else:
        cost = r.usage.model_extra["cost_usd"]
        assert cost <= 2e-6 * (1 + 1e-6)
        assert booked(stack, "big") - spent_before == pytest.approx(cost, rel=1e-6, abs=1e-12)
    assert counter(stack, "routebalance_progressive_requests_total", result="budget") == before + 1


def test_tiny_key_limit_falls_back_or_refuses_and_never_overspends(stack):
    c = client(stack, TINY)
    before = counter(stack, "routebalance_progressive_requests_total", result="budget")
    for _ in range(3):
        try:
            raw = ask(c, extra_body=PROGRESSIVE, max_tokens=20)
        except openai.APIStatusError as e:
            assert e.status_code == 402
        else:  # served normally, within what the key had left
            assert "X-Route-Points" not in raw.headers and raw.parse().choices[0].message.content
    assert counter(stack, "routebalance_progressive_requests_total", result="budget") >= before + 1
    key = next(k for k in stack.store.current.auth.keys if k.name == "tiny")
    assert booked(stack, "tiny") <= key.spend_limit_usd * (1 + 1e-6)


class Patch:
    """`patch(hook)` wraps the gateway's progressive upstream calls with `hook(messages, logprobs, call)`;
    `sketched_on` lists the instances the sketch calls went to, in order."""

    def __init__(self):
        self.hooks, self.sketched_on = [], []

    def __call__(self, hook) -> None:
        self.hooks.append(hook)


@pytest.fixture
def patched_calls(stack):
    """Each decided progressive call goes through the installed hook: hook(messages, logprobs, call), where
    `await call()` dispatches it (its answer's JSON, or None if it failed) and a hook may return None instead
    (as a failed call)."""
    from gateway.core.request import Completion

    prog = stack.gateway.progressive
    original = prog._run
    patch = Patch()

    async def wrapped(ticket, request, spend, calls):
        ran: dict = {}

        async def call():
            ran["data"], ran["done"] = await original(ticket, request, spend, calls)
            return ran["data"]

        messages, logprobs = request.body["messages"], bool(request.body.get("logprobs"))
        data = await patch.hooks[0](messages, logprobs, call) if patch.hooks else await call()
        if "done" not in ran:  # failed by the hook before it went: the loop still hears the call end
            stack.gateway.scheduler.complete(ticket, Completion(False, None))
            return None, None
        if not logprobs and ran["done"] is not None:
            patch.sketched_on.append(ran["done"].attempt.instance)
        return data, ran["done"]

    prog._run = wrapped
    yield patch
    del prog._run


def test_later_points_that_finish_first_are_held_back(stack, patched_calls):
    import asyncio

    async def slow_first_point(messages, logprobs, call):
        if logprobs and "Expand point 1 " in messages[-1]["content"]:
            await asyncio.sleep(0.6)
        return await call()

    patched_calls(slow_first_point)
    raw = ask(client(stack), stream=True, extra_body=PROGRESSIVE)
    k = int(raw.headers["X-Route-Points"])
    parts = [ch.choices[0].delta.content for ch in raw.parse() if ch.choices and ch.choices[0].delta.content]
    check_parts(parts, k)


def test_failed_expansions_keep_the_sketch_point_never_a_500(stack, patched_calls):
    async def second_point_fails(messages, logprobs, call):
        if logprobs and "Expand point 2 " in messages[-1]["content"]:
            return None  # as a failed upstream call
        return await call()

    patched_calls(second_point_fails)
    before = counter(stack, "routebalance_progressive_points_total", result="sketch_text")
    raw = ask(client(stack), extra_body=PROGRESSIVE)
    r = raw.parse()
    parts = split_points(r.choices[0].message.content)
    check_parts(parts, int(raw.headers["X-Route-Points"]))
    assert len(parts[1].split()) <= 9  # "2." and the sketch's few words (3 to 8), not an expansion
    assert counter(stack, "routebalance_progressive_points_total", result="sketch_text") == before + 1


def test_failed_sketch_falls_back_and_says_what_it_cost(stack, patched_calls):
    async def sketch_lost(messages, logprobs, call):
        data = await call()  # the sketch is written, and paid for
        return None if not logprobs else data  # then lost, as a failed call

    patched_calls(sketch_lost)
    spent_before = booked(stack, "big")
    raw = ask(client(stack), extra_body=PROGRESSIVE, max_tokens=20)
    r = raw.parse()
    assert raw.headers["X-Route-Mode"] == "normal" and raw.headers["X-Route-Fallback"] == "sketch_failed"
    assert len(patched_calls.sketched_on) == 1  # written once (a lost answer is not an instance failing)
    sketch_cost = float(raw.headers["X-Route-Fallback-Cost-USD"])
    assert sketch_cost > 0
    # the key pays the sketch and the normal answer, each once
    assert booked(stack, "big") - spent_before == pytest.approx(sketch_cost + r.usage.model_extra["cost_usd"],
                                                                rel=1e-6, abs=1e-12)


def test_earlier_turns_go_with_every_call(stack):
    """The system prompt and earlier turns are part of the sketch's and every expansion's prompt."""
    from gateway.tokens import TokenCounter

    history = [{"role": "system", "content": "You answer for a history teacher's class of fifteen-year-olds."},
               {"role": "user", "content": "We are studying Europe between 1789 and 1815."},
               {"role": "assistant", "content": "Understood: the revolutionary and Napoleonic years."}]
    c = client(stack)
    plain = ask(c, extra_body=PROGRESSIVE)
    with_history = c.chat.completions.with_raw_response.create(
        model="auto", messages=[*history, {"role": "user", "content": QUESTION}], extra_body=PROGRESSIVE)
    assert with_history.headers["X-Route-Mode"] == "progressive"
    calls = 1 + int(with_history.headers["X-Route-Points"]) * int(with_history.headers["X-Route-Candidates"])
    assert calls == 1 + int(plain.headers["X-Route-Points"]) * int(plain.headers["X-Route-Candidates"])
    count = TokenCounter().count_chat
    turn = [{"role": "user", "content": "any question"}]
    per_call = count([*history, *turn]) - count(turn)
    assert per_call > 20
    extra = with_history.parse().usage.prompt_tokens - plain.parse().usage.prompt_tokens
    assert extra == calls * per_call


def test_tools_or_a_last_turn_not_the_users_fall_back(stack):
    c = client(stack)
    tools = [{"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}]
    raw = ask(c, extra_body=PROGRESSIVE, tools=tools, max_tokens=10)
    assert raw.headers["X-Route-Fallback"] == "unsupported"
    raw = c.chat.completions.with_raw_response.create(
        model="auto", max_tokens=10, extra_body=PROGRESSIVE,
        messages=[{"role": "user", "content": QUESTION}, {"role": "assistant", "content": "The causes were"}])
    assert raw.headers["X-Route-Fallback"] == "unsupported" and raw.parse().choices[0].message.content


def test_short_answer_rule_reads_the_predicted_length(stack):
    """With the length rule on, a question whose predicted 72B answer is shorter than min_answer_tokens is
    answered whole (the threshold here is past any answer, so every prompt's prediction is below it)."""
    import tomllib

    from conftest import dump_toml

    path = stack.config_path
    original = path.read_text()
    data = tomllib.loads(original)
    data["progressive"]["min_answer_tokens"] = 100_000
    before = counter(stack, "routebalance_progressive_requests_total", result="short_answer")
    try:
        path.write_text(dump_toml(data))
        assert stack.store.reload()[0]
        raw = ask(client(stack), extra_body=PROGRESSIVE, max_tokens=10)
        assert raw.headers["X-Route-Mode"] == "normal" and raw.headers["X-Route-Fallback"] == "short_answer"
        assert counter(stack, "routebalance_progressive_requests_total", result="short_answer") == before + 1
    finally:
        path.write_text(original)
        assert stack.store.reload()[0]
    assert ask(client(stack), extra_body=PROGRESSIVE).headers["X-Route-Mode"] == "progressive"


def test_a_failing_instance_under_progressive_mode_is_retried_around_and_cooled_down(stack, monkeypatch):
    """Progressive calls go through the one dispatch path: a 72B instance that fails every attempt has the
    sketch retried on the other 72B, and its failures cool it down as under normal routing."""
    import gateway.serving.dispatch as dispatch
    from gateway.serving.relay import UpstreamFailed

    cfg = stack.store.current
    bigs = [i.name for i in cfg.instances if i.model == M72]
    original = dispatch.open_upstream
    tried: list[str] = []
    bad = None  # the 72B that holds the sketch prompt's prefix: the cache term ranks it first from then on

    async def failing(session, inst, path, payload, timeout, stream, **options):
        tried.append(inst.name)
        if inst.name == bad:
            raise UpstreamFailed(502, f"{bad}: connection reset (the test's)")
        return await original(session, inst, path, payload, timeout, stream, **options)

    monkeypatch.setattr(dispatch, "open_upstream", failing)
    ask(client(stack), extra_body=PROGRESSIVE)
    bad = next(name for name in tried if name in bigs)
    good = next(name for name in bigs if name != bad)
    tried.clear()

    answers = []
    for _ in range(8):  # the policy ranks the two 72Bs per sketch: until the bad one has failed twice
        raw = ask(client(stack), extra_body=PROGRESSIVE)
        answers.append((raw.headers["X-Route-Mode"], raw.headers["X-Route-Instance"]))
        if tried.count(bad) >= cfg.health.failure_threshold:
            break
    assert tried.count(bad) >= cfg.health.failure_threshold, tried
    assert all(a == ("progressive", good) for a in answers)  # every sketch came from the good one
    states = {inst.name: state for inst, state in stack.run(stack.gateway.scheduler.instance_states, cfg)}
    assert states[bad].health.cooldowns >= 1 and states[good].health.cooldowns == 0  # its breaker opened
    monkeypatch.setattr(dispatch, "open_upstream", original)
    stack.wait_routable()  # its cooldown passes and a probe brings it back for the other tests


def test_every_call_carries_the_request_sampling_and_each_candidate_its_own_seed(stack, monkeypatch):
    """On the wire: what the gateway sends each instance."""
    import orjson

    import gateway.serving.dispatch as mode

    sent: list[dict] = []
    original = mode.open_upstream

    async def recording(session, inst, path, payload, timeout, stream, **options):
        sent.append(orjson.loads(payload))
        return await original(session, inst, path, payload, timeout, stream, **options)

    monkeypatch.setattr(mode, "open_upstream", recording)
    raw = ask(client(stack), temperature=0.3, top_p=0.9, seed=7, extra_body=PROGRESSIVE)
    points, n_cand = int(raw.headers["X-Route-Points"]), int(raw.headers["X-Route-Candidates"])
    sketch, expansions = sent[0], sent[1:]
    assert "logprobs" not in sketch and all(e["logprobs"] for e in expansions)
    assert len(expansions) == points * n_cand and n_cand >= 2
    assert all(b["temperature"] == 0.3 and b["top_p"] == 0.9 for b in sent)
    assert sketch["seed"] == 7 and sorted({e["seed"] for e in expansions}) == list(range(7, 7 + n_cand))
    sent.clear()
    ask(client(stack), extra_body=PROGRESSIVE)  # none asked for: none sent, the instances' defaults apply
    assert sent and not any({"temperature", "top_p", "seed"} & b.keys() for b in sent)
