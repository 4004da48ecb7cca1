"""Progressive mode, first slice: what the emulator serves for it (logprobs in vLLM's shapes, sketch
and expansion prompts answered from the labels), over HTTP with the official openai SDK, and the pure
planning core (fallback rule, sketch parsing, choice by confidence, assembly, usage, budget)."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import re
import threading

import openai
import pytest
import uvloop

from conftest import pool_config
from gateway.config.store import load_config
from gateway.core.engine.profiles import arch_for
from gateway.core.progressive import (
    Call,
    Candidate,
    ConfidenceWeights,
    Fallback,
    FallbackRule,
    Price,
    ProgressiveLimits,
    Usage,
    answer_part,
    assemble,
    candidates_within,
    check_budget,
    choose,
    fallback_reason,
    parse_points,
    plan_calls,
    sum_usage,
)
from gateway.core.progressive_prompts import (
    expansion_prompt,
    original_question,
    parse_expansion_prompt,
    parse_sketch_prompt,
    sketch_prompt,
)
from gateway.lab.emulator.logprobs import answer_mean_logprob
from gateway.lab.emulator.outputs import OutputLengths
from gateway.lab.emulator.server import EmulatedPool
from gateway.lab.emulator.settings import emulator_of
from gateway.lab.workload.synthetic import generate

M3, M14, M72 = "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-14B-Instruct", "Qwen/Qwen2.5-72B-Instruct"


class Pool:
    """One emulated instance per model on loopback, knowing the labels of 300 synthetic prompts."""

    def __init__(self, tmp):
        cfg = load_config(pool_config(tmp))
        first = {}
        for inst in cfg.instances:
            first.setdefault(inst.model, inst)
        self.cfg = dataclasses.replace(cfg, instances=tuple(first.values()))
        self.records = generate(300, seed=11)
        means = {i.model: arch_for(i.model).mean_output_tokens for i in self.cfg.instances}
        lengths = OutputLengths.from_records(means, self.records, seed=emulator_of(self.cfg).seed)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = self.call(self._start(lengths))

    async def _start(self, lengths):
        pool = EmulatedPool(self.cfg, lengths=lengths)
        await pool.start()
        return pool

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def client(self, model: str) -> openai.OpenAI:
        url = next(i.url for i in self.cfg.instances if i.model == model)
        return openai.OpenAI(base_url=url + "/v1", api_key="unused", timeout=30, max_retries=0)

    def stop(self):
        self.call(self.pool.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("progressive"))
    yield p
    p.stop()


def chat(client, model, prompt, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}], **kw)


def mean(xs):
    return sum(xs) / len(xs)


# --- logprobs ----------------------------------------------------------------------------------------


def test_chat_logprobs_shaped_like_vllm_and_deterministic(pool):
    c = pool.client(M3)
    r = chat(c, M3, "tell me about rivers", max_tokens=12, logprobs=True, top_logprobs=3, seed=5)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 12
    assert "".join(t.token for t in content) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 3
        lps = [a.logprob for a in t.top_logprobs]
        assert lps == sorted(lps, reverse=True)
        assert sum(math.exp(v) for v in lps) <= 1 + 1e-9
        assert t.logprob in lps or t.logprob < lps[-1]
    again = chat(c, M3, "tell me about rivers", max_tokens=12, logprobs=True, top_logprobs=3, seed=5)
    assert [t.logprob for t in again.choices[0].logprobs.content] == [t.logprob for t in content]
    other = chat(c, M3, "tell me about rivers", max_tokens=12, logprobs=True, top_logprobs=3, seed=6)
    assert [t.logprob for t in other.choices[0].logprobs.content] != [t.logprob for t in content]
    # logprobs without top_logprobs: every token, empty alternatives; no logprobs: null
    bare = chat(c, M3, "tell me about rivers", max_tokens=4, logprobs=True)
    assert [t.top_logprobs for t in bare.choices[0].logprobs.content] == [[]] * 4
    assert chat(c, M3, "tell me about rivers", max_tokens=4).choices[0].logprobs is None


def test_chat_logprobs_streamed_in_each_chunk(pool):
    c = pool.client(M3)
    whole = chat(c, M3, "a streamed question", max_tokens=20, logprobs=True, top_logprobs=2)
    tokens, text = [], ""
    for chunk in chat(c, M3, "a streamed question", max_tokens=20, logprobs=True, top_logprobs=2, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None:
                tokens += choice.logprobs.content
    assert text == whole.choices[0].message.content
    assert [(t.token, t.logprob) for t in tokens] == [(t.token, t.logprob) for t in whole.choices[0].logprobs.content]
    assert all(len(t.top_logprobs) == 2 for t in tokens)


def test_completions_logprobs_streamed_and_not(pool):
    c = pool.client(M3)
    r = c.completions.create(model=M3, prompt="once upon a time", max_tokens=10, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for tok, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == v and 2 <= len(top) <= 3  # the sampled token plus the top 2
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for chunk in c.completions.create(model=M3, prompt="once upon a time", max_tokens=10, logprobs=2, stream=True):
        for choice in chunk.choices:
            if choice.logprobs is not None:
                for k in streamed:
                    streamed[k] += getattr(choice.logprobs, k)
    assert streamed == {"tokens": lp.tokens, "token_logprobs": lp.token_logprobs, "text_offset": lp.text_offset}
    zero = c.completions.create(model=M3, prompt="once upon a time", max_tokens=3, logprobs=0)
    assert all(len(top) == 1 for top in zero.choices[0].logprobs.top_logprobs)


@pytest.mark.parametrize("kw,param", [
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 3}, "top_logprobs"),  # top_logprobs without logprobs
    ({"logprobs": True, "top_logprobs": "5"}, "top_logprobs"),
])
def test_bad_chat_logprobs_get_400(pool, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        chat(pool.client(M3), M3, "hi", max_tokens=2, **kw)
    assert e.value.status_code == 400
    assert e.value.body["param"] == param and e.value.body["type"] == "BadRequestError"


def test_bad_completion_logprobs_get_400(pool):
    c = pool.client(M3)
    for bad in (21, -2):
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=M3, prompt="hi", max_tokens=2, logprobs=bad)
        assert e.value.body["param"] == "logprobs"


def test_confidence_is_the_documented_noisy_signal_not_the_label(pool):
    """A known prompt's mean token logprob is emulator/logprobs.py's signal (per-model bias, noise, part
    label), so it is not a function of the label: on the prompt the 72B answers best against the 3B, each
    model's mean is its own draw, and two models with one label would still differ by their biases."""
    rec = max(pool.records, key=lambda r: r.models[M72].score - r.models[M3].score)
    seed = pool.pool.lengths.seed
    for model in (M3, M72):
        r = chat(pool.client(model), model, rec.prompt, max_tokens=30, logprobs=True)
        got = mean([t.logprob for t in r.choices[0].logprobs.content])
        want = answer_mean_logprob(model=model, quality=rec.models[model].score, prompt=rec.prompt,
                                   emulator_seed=seed, request_seed=None)
        assert got == pytest.approx(want, abs=1e-9)
    same_label = [answer_mean_logprob(model=m, quality=0.5, prompt=rec.prompt, emulator_seed=seed, request_seed=None)
                  for m in (M3, M72)]
    assert same_label[0] != same_label[1]


# --- sketch and expansion prompts ---------------------------------------------------------------------


def expected_points(labelled: int, max_points: int = 8) -> int:
    return min(max_points, max(3, min(8, round(labelled / 70))))


def test_sketch_prompt_answered_with_points_from_the_labels(pool):
    """Two known questions with different labelled lengths on the 14B: their sketches differ in count as
    the labels say (one point per ~70 tokens, 3..8); on the 72B too."""
    by_len = sorted(pool.records, key=lambda r: r.models[M14].output_length)
    short, long = by_len[len(by_len) // 10], by_len[-3]
    assert expected_points(short.models[M14].output_length) != expected_points(long.models[M14].output_length)
    for rec, model in ((short, M14), (long, M14), (long, M72)):
        r = chat(pool.client(model), model, sketch_prompt(rec.prompt, 8), max_tokens=120)
        text = r.choices[0].message.content
        lines = text.split("\n")
        assert all(re.fullmatch(r"\d+\.( \w+){3,6}", ln) for ln in lines), text
        assert len(lines) == expected_points(rec.models[model].output_length)
        assert parse_points(text, 8) == [ln.split(". ", 1)[1] for ln in lines]
        assert r.choices[0].finish_reason == "stop"
    # the request's bound is kept
    r = chat(pool.client(M14), M14, sketch_prompt(long.prompt, 2), max_tokens=120)
    assert len(r.choices[0].message.content.split("\n")) == 2


def test_expansion_prompt_gets_its_share_of_the_labelled_length(pool):
    rec = max(pool.records, key=lambda r: r.models[M3].output_length)
    points = ["first idea here", "second idea here", "third idea here", "fourth idea"]
    want = round(rec.models[M3].output_length / len(points))
    r2 = chat(pool.client(M3), M3, expansion_prompt(rec.prompt, points, 2), max_tokens=400, logprobs=True)
    r3 = chat(pool.client(M3), M3, expansion_prompt(rec.prompt, points, 3), max_tokens=400, logprobs=True)
    assert r2.usage.completion_tokens == r3.usage.completion_tokens == want
    assert r2.choices[0].message.content != r3.choices[0].message.content  # each point its own text
    # the confidence reads the question's label, with noise drawn per point's prompt
    target = answer_mean_logprob(model=M3, quality=rec.models[M3].score, prompt=expansion_prompt(rec.prompt, points, 2),
                                 emulator_seed=pool.pool.lengths.seed, request_seed=None)
    assert mean([t.logprob for t in r2.choices[0].logprobs.content]) == pytest.approx(target, abs=1e-9)


def test_unknown_question_falls_back_to_the_length_model(pool):
    q = "a question no label knows about"
    lengths = pool.pool.lengths
    r = chat(pool.client(M14), M14, sketch_prompt(q, 8), max_tokens=120)
    assert len(r.choices[0].message.content.split("\n")) == expected_points(lengths.for_prompt(q, M14))
    assert lengths.quality(sketch_prompt(q, 8), M14) is None


def test_prompt_templates_round_trip():
    q = "Explain tides.\n\nQuestion:\nand why?"  # the markers inside the question do not confuse the parsers
    s = parse_sketch_prompt(sketch_prompt(q, 5))
    assert s is not None and (s.question, s.max_points) == (q, 5)
    e = parse_expansion_prompt(expansion_prompt(q, ["gravity of  the moon", "two bulges"], 2))
    assert e is not None and (e.question, e.point, e.points) == (q, 2, ["gravity of the moon", "two bulges"])
    assert original_question("Explain tides.") is None
    assert parse_expansion_prompt(expansion_prompt(q, ["a"], 1).replace("1. a", "2. a")) is None
    with pytest.raises(ValueError):
        expansion_prompt(q, ["a"], 2)


# --- the planning core ---------------------------------------------------------------------------------


@pytest.mark.parametrize("prompt,predicted,reason", [
    ("", 500, Fallback.EMPTY),
    ("Fix this:\n```python\nprint(1)\n```", 500, Fallback.CODE),
    ("def add(a, b):\n    return a + b\nwhat does it do", 500, Fallback.CODE),
    ("Write a function that reverses a string", 500, Fallback.CODE),
    ("select name from users where id = 3, explain", 500, Fallback.CODE),
    ("What is the capital of France?", 30, Fallback.SINGLE_FACT),
    ("Who wrote Hamlet?", None, Fallback.SINGLE_FACT),
    ("Summarise the causes of the first world war", 120, Fallback.SHORT_ANSWER),
    ("Summarise the causes of the first world war", 600, None),
    ("What is the history of the Roman empire, its rise and fall?", 800, None),  # a long answer is no single fact
    ("Describe a good morning routine", None, None),  # no estimate: allowed unless required
])
def test_fallback_rule(prompt, predicted, reason):
    assert fallback_reason(prompt, predicted) == reason


def test_fallback_rule_is_configurable():
    assert fallback_reason("Describe a routine", None, FallbackRule(require_estimate=True)) == Fallback.NO_ESTIMATE
    assert fallback_reason("Summarise the war", 150, FallbackRule(min_answer_tokens=100)) is None
    assert fallback_reason("Fix this ```x```", 500, FallbackRule(code_patterns=())) is None


def test_parse_points_formats():
    assert parse_points("1. Alpha\n2) Beta\n(3) Gamma\n- Delta\n* **Epsilon**", 8) == \
        ["Alpha", "Beta", "Gamma", "Delta", "Epsilon"]
    assert parse_points("Here is a skeleton:\n1. Alpha\n   continued\n2. alpha continued\n3. Beta", 8) == \
        ["Alpha continued", "Beta"]  # preamble dropped, continuation joined, case-insensitive dedupe
    assert parse_points("one\ntwo\n\nthree", 2) == ["one", "two"]  # unmarked lines, bounded
    assert parse_points("", 5) == []


def test_choose_by_mean_logprob_alone_then_shorter_then_first():
    """With all of Eq. 3's weight on the token probability, the choice is the mean logprob's (the rest:
    tests/test_progressive_confidence.py)."""
    only_logprob = ConfidenceWeights(1.0, 0.0)
    a = Candidate("a b c", [-0.5, -0.5, -0.5], Usage(10, 3))
    b = Candidate("a b", [-0.2, -0.4], Usage(10, 2))
    assert choose([a, b], "", only_logprob) == 1
    tie_long = Candidate("x y z", [-0.3, -0.3, -0.3], Usage(10, 3))
    tie_short = Candidate("x", [-0.3], Usage(10, 1))
    assert choose([tie_long, tie_short], "", only_logprob) == 1
    assert choose([tie_short, Candidate("y", [-0.3], Usage(10, 1))], "", only_logprob) == 0
    assert choose([Candidate("no logprobs", None), a], "", only_logprob) == 1
    with pytest.raises(ValueError):
        choose([])


def test_assemble_in_point_order_and_streamed_parts_agree():
    points = ["Tides", "Moon", "Sun"]
    text = assemble(points, ["Water rises  and falls.", None, "The sun adds a little."])
    assert text == "1. Water rises and falls.\n\n2. Moon\n\n3. The sun adds a little."
    assert "".join(answer_part(i, p, e) for i, (p, e) in
                   enumerate(zip(points, ["Water rises  and falls.", None, "The sun adds a little."], strict=True))) \
        == text
    with pytest.raises(ValueError):
        assemble(points, ["x"])


def test_sum_usage():
    total = sum_usage([Usage(100, 40, 0.002), Usage(150, 60, 0.0005), Usage(150, 0, 0.0001)])
    assert (total.prompt_tokens, total.completion_tokens, total.total_tokens) == (400, 100, 500)
    assert total.cost == pytest.approx(0.0026)


def test_plan_and_budget():
    limits = ProgressiveLimits(max_points=4, sketch_max_tokens=100, expansion_max_tokens=50, candidates=2)
    plan = plan_calls(M72, [M3, "Qwen/Qwen2.5-7B-Instruct"], 3, limits)
    assert plan[0] == Call("sketch", M72, 100)
    assert len(plan) == 1 + 3 * 2
    assert [(c.point, c.candidate, c.model) for c in plan[1:3]] == [(1, 0, M3), (1, 1, "Qwen/Qwen2.5-7B-Instruct")]
    prices = {M72: Price(1e-6, 4e-6), M3: Price(1e-7, 2e-7), "Qwen/Qwen2.5-7B-Instruct": Price(2e-7, 4e-7)}
    tokens = {"sketch": 50, "expand": 200}
    # sketch 50e-6 + 400e-6; per point: 3B 20e-6 + 10e-6, 7B 40e-6 + 20e-6 -> 90e-6 per point
    worst = 450e-6 + 3 * 90e-6
    check = check_budget(plan, tokens, prices, budget=worst)
    assert check.fits and check.worst_case == pytest.approx(worst)
    assert not check_budget(plan, tokens, prices, budget=worst * 0.99).fits
    assert check_budget(plan, tokens, prices, budget=None).fits
    # before the sketch, the bound is max_points (4): two candidates cost 450 + 4 * 90, one 450 + 4 * 30
    assert candidates_within(M72, [M3, "Qwen/Qwen2.5-7B-Instruct"], tokens, prices, 810e-6, limits) == 2
    assert candidates_within(M72, [M3, "Qwen/Qwen2.5-7B-Instruct"], tokens, prices, 700e-6, limits) == 1
    assert candidates_within(M72, [M3, "Qwen/Qwen2.5-7B-Instruct"], tokens, prices, 500e-6, limits) == 0
    # after the sketch (paid), 3 points against what is left: two candidates 3 * 90, one 3 * 30
    small = [M3, "Qwen/Qwen2.5-7B-Instruct"]
    assert candidates_within(M72, small, tokens, prices, 270e-6, limits, 3, sketched=True) == 2
    assert candidates_within(M72, small, tokens, prices, 269e-6, limits, 3, sketched=True) == 1
    assert candidates_within(M72, small, tokens, prices, 89e-6, limits, 3, sketched=True) == 0
