"""Judged shadow answers through the real gateway in front of stub instances, with the openai SDK as the client
and a stub judge: a shadowed answer gives judge labels to both models and a length to the other; streams, keys
that do not learn and the day's spend cap are never shadowed."""

from __future__ import annotations

import time

import httpx
import openai
from stubs import Stub, StubJudge, StubStack, stub_config, stub_instance

from conftest import wait_for
from gateway.tenancy.keys import hash_key

SMALL, BIG = "acme/small", "acme/big"
KEY, QUIET = "rb-shadow-key", "rb-shadow-quiet"


def start(tmp_path, **learning) -> tuple[StubStack, StubJudge]:
    stubs = [Stub(mode={"stop": 5}), Stub(mode={"stop": 7})]
    judge = StubJudge(reply="Score: 0.75")
    instances = [stub_instance(stubs[0], "small-0", model=SMALL), stub_instance(stubs[1], "big-0", model=BIG)]
    path = stub_config(tmp_path, stubs, instances,
                       learning={"path": str(tmp_path / "labels.db"), "shadow_share": 1.0, **learning},
                       judge={"url": judge.url, "model": "judge-model", "outside_pool_may_see_prompts": True},
                       auth={"keys": [{"name": "a", "sha256": hash_key(KEY)},
                                      {"name": "quiet", "sha256": hash_key(QUIET), "learn": False}]})
    stack = StubStack(path, stubs)
    stack.call(judge.start())
    return stack, judge


def labels(stack) -> list[tuple[str, str, float, bool]]:
    return sorted((lb.model, lb.source, lb.value, lb.censored) for lb in stack.gateway.learner.store.labels())


def test_a_shadowed_answer_gives_both_models_judge_labels(tmp_path):
    stack, judge = start(tmp_path)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=20)
        client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "Name a prime."}])
        wait_for(lambda: len([lb for lb in labels(stack) if lb[1] == "judge"]) == 2, 10, "two judge labels")
        wait_for(lambda: (BIG, "length", 7.0, False) in labels(stack), 10, "the shadow's length")
        got = labels(stack)
        assert (SMALL, "judge", 0.75, False) in got and (BIG, "judge", 0.75, False) in got
        assert (SMALL, "length", 5.0, False) in got  # the served answer's own length, as always
        assert len(stack.stubs[1].requests) == 1 and len(judge.requests) == 2  # one shadow call, two judgements
        judged = {body["messages"][0]["content"] for _, body in judge.requests}
        assert all("Name a prime." in text for text in judged)
        metrics = httpx.get(stack.root + "/metrics").text
        assert 'routebalance_shadow_answers_total{outcome="judged"} 1.0' in metrics
        assert "routebalance_shadow_cost_usd_total 0.0" not in metrics
        # a stream and a key that does not learn are never shadowed
        list(client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "x"}], stream=True))
        quiet = openai.OpenAI(base_url=stack.base_url, api_key=QUIET, max_retries=0, timeout=20)
        quiet.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "y"}])
        time.sleep(0.5)  # a shadow call would have reached the stub within milliseconds
        assert len(stack.stubs[1].requests) == 1
    finally:
        stack.stop()


def test_the_days_spend_cap_stops_shadow_answers(tmp_path):
    stack, judge = start(tmp_path, shadow_usd_per_day=1e-9)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=20)
        client.chat.completions.create(model=SMALL, messages=[{"role": "user", "content": "Name a prime."}])
        wait_for(lambda: 'routebalance_shadow_answers_total{outcome="spend_cap"} 1.0'
                 in httpx.get(stack.root + "/metrics").text, 10, "the cap counted")
        assert stack.stubs[1].requests == [] and judge.requests == []
    finally:
        stack.stop()


def test_answers_the_request_shapes_are_never_shadowed(tmp_path):
    """A JSON response_format or tools (the stubs answer them in text, as an instance may): the answer's shape
    is the request's, so it is neither judged nor given a shadow's length; a plain request still is."""
    stack, judge = start(tmp_path)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=20)
        question = [{"role": "user", "content": "Name a prime."}]
        client.chat.completions.create(model=SMALL, messages=question, response_format={"type": "json_object"})
        client.chat.completions.create(model=SMALL, messages=question, tools=[
            {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}])
        time.sleep(0.5)  # a shadow call would have reached the stub within milliseconds
        assert stack.stubs[1].requests == [] and judge.requests == []
        client.chat.completions.create(model=SMALL, messages=question)
        wait_for(lambda: len(stack.stubs[1].requests) == 1, 10, "the plain request shadowed")
    finally:
        stack.stop()
