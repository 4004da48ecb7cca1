"""Learning from the gateway's own traffic, through the real gateway in front of stub instances: answer
lengths stored (censored when cut), POST /v1/feedback from the openai SDK and raw HTTP, and the export."""

from __future__ import annotations

import subprocess
import sys

import httpx
import openai
import pytest
from stubs import MODEL, Stub, StubStack, stub_config

from conftest import wait_for
from gateway.learning.labels import prompt_hash
from gateway.records import read_jsonl
from gateway.tenancy.keys import hash_key
from gateway.tenancy.ratelimit import RateLimiter

KEY, OTHER, QUIET = "rb-feedback-a", "rb-feedback-b", "rb-feedback-quiet"
KEYS = [{"name": "a", "sha256": hash_key(KEY)}, {"name": "b", "sha256": hash_key(OTHER)},
        {"name": "quiet", "sha256": hash_key(QUIET), "learn": False}]
ANSWER_TOKENS = 5  # the stubs end their answers ("stop") after this many tokens


def start(tmp_path, **sections) -> StubStack:
    stubs = [Stub(mode={"stop": ANSWER_TOKENS})]
    sections.setdefault("auth", {"keys": KEYS})
    sections["learning"] = {"path": str(tmp_path / "labels.db"), **sections.get("learning", {})}
    return StubStack(stub_config(tmp_path, stubs, state={"path": str(tmp_path / "state.db")}, **sections), stubs)


def sdk(stack, key=KEY, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=key, max_retries=0, timeout=20, **kwargs)


def ask(client: openai.OpenAI, prompt: str, **kwargs) -> str:
    """The id of a chat completion of `prompt` (streamed when asked), as the client saw it."""
    messages = [{"role": "user", "content": prompt}]
    if kwargs.get("stream"):
        ids = {chunk.id for chunk in client.chat.completions.create(model=MODEL, messages=messages, **kwargs)}
        assert len(ids) == 1
        return ids.pop()
    return client.chat.completions.create(model=MODEL, messages=messages, **kwargs).id


def rate(client: openai.OpenAI, **body) -> dict:
    return client.post("/feedback", body=body, cast_to=object)


def labels(stack, source: str) -> dict[str, tuple]:
    """prompt -> (value, censored, key) of the stored labels of `source`."""
    return {lb.prompt: (lb.value, lb.censored, lb.key) for lb in stack.gateway.learner.store.labels()
            if lb.source == source}


def logged(stack, cid: str):
    """The completion log's entry for `cid` now (read on the gateway's loop, with its clock)."""
    return stack.run(lambda: stack.gateway.learner.completions.get(cid, stack.loop.time()))


def metric(stack, line_start: str) -> float:
    page = httpx.get(stack.root + "/metrics", timeout=5).text
    found = [line for line in page.splitlines() if line.startswith(line_start)]
    return float(found[0].rsplit(" ", 1)[1]) if found else 0.0


# ---- who may rate ------------------------------------------------------------------------------

def test_feedback_is_taken_from_the_key_that_made_the_completion_only(tmp_path):
    stack = start(tmp_path)
    try:
        a, b = sdk(stack), sdk(stack, OTHER)
        cid = ask(a, "Tell me about rivers.")
        assert cid.startswith("chatcmpl-")
        with pytest.raises(openai.NotFoundError) as foreign:
            rate(b, id=cid, score=0.1)
        with pytest.raises(openai.NotFoundError) as unknown:
            rate(a, id="chatcmpl-never-made", score=0.1)
        # Someone else's id and an unknown one get the same answer: an id's existence does not leak.
        assert foreign.value.code == unknown.value.code == "completion_not_found"
        assert foreign.value.message.replace(cid, "ID") == unknown.value.message.replace("chatcmpl-never-made", "ID")

        assert rate(a, id=cid, score=0.75) == {"id": cid, "accepted": True, "source": "feedback", "duplicate": False}
        # A streamed answer (its usage chunk hidden from the client) is rated by the id its chunks carried.
        streamed = ask(a, "Tell me about lakes.", stream=True)
        assert rate(a, id=streamed, thumbs="down")["accepted"]
        assert labels(stack, "feedback") == {"Tell me about rivers.": (0.75, False, "a"),
                                             "Tell me about lakes.": (0.0, False, "a")}
        stored = [lb for lb in stack.gateway.learner.store.labels() if lb.source == "feedback"]
        assert {lb.model for lb in stored} == {MODEL}
        assert {lb.prompt_hash for lb in stored} == {prompt_hash("Tell me about rivers."),
                                                     prompt_hash("Tell me about lakes.")}
        assert metric(stack, 'routebalance_feedback_total{outcome="accepted",reason="stored"}') == 2
        assert metric(stack, 'routebalance_feedback_total{outcome="refused",reason="completion_not_found"}') == 2
    finally:
        stack.stop()


def test_anonymous_feedback_only_from_the_address_that_asked(tmp_path):
    stack = start(tmp_path, auth={"allow_anonymous": True, "keys": KEYS})
    here = httpx.Client(timeout=20)
    elsewhere = httpx.Client(timeout=20, transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    try:
        def chat(client: httpx.Client, prompt: str) -> str:
            r = client.post(stack.base_url + "/chat/completions",
                            json={"model": MODEL, "messages": [{"role": "user", "content": prompt}]})
            assert r.status_code == 200, r.text
            return r.json()["id"]

        def feedback(client: httpx.Client, cid: str, **headers) -> httpx.Response:
            return client.post(stack.base_url + "/feedback", json={"id": cid, "thumbs": "up"}, headers=headers)

        mine = chat(here, "An anonymous question.")
        assert feedback(elsewhere, mine).status_code == 404  # another client address
        assert feedback(here, mine, Authorization=f"Bearer {KEY}").status_code == 404  # a key did not make it
        keyed = ask(sdk(stack), "A keyed question.")
        assert feedback(here, keyed).status_code == 404  # nor may an anonymous client rate a key's completion
        ok = feedback(here, mine)
        assert ok.status_code == 200 and ok.json()["accepted"]
        assert labels(stack, "feedback") == {"An anonymous question.": (1.0, False, None)}
    finally:
        here.close()
        elsewhere.close()
        stack.stop()


def test_a_key_with_learn_false_stays_out_of_learning(tmp_path):
    stack = start(tmp_path)
    try:
        quiet = sdk(stack, QUIET)
        cid = ask(quiet, "A private question.")
        with pytest.raises(openai.PermissionDeniedError) as e:
            rate(quiet, id=cid, score=1.0)
        assert e.value.code == "learning_off" and "learning is off for the key 'quiet'" in e.value.message
        ask(sdk(stack), "A public question.")  # the writer keeps order: once this one is stored...
        wait_for(lambda: "A public question." in labels(stack, "length"), 10, "the public answer's length")
        assert "A private question." not in labels(stack, "length")  # ...the private one would have been
        public = ask(sdk(stack), "Another public question.")
        assert logged(stack, cid) is None and logged(stack, public) is not None  # its id was never kept
        assert all(lb.key != "quiet" for lb in stack.gateway.learner.store.labels())
    finally:
        stack.stop()


# ---- once per id, within bounds ------------------------------------------------------------------

def test_an_id_is_rated_once(tmp_path):
    stack = start(tmp_path)
    try:
        a = sdk(stack)
        cid = ask(a, "Rate me once.")
        assert rate(a, id=cid, score=1)["duplicate"] is False
        assert rate(a, id=cid, thumbs="up")["duplicate"] is True  # the same score again: idempotent
        with pytest.raises(openai.ConflictError) as e:
            rate(a, id=cid, score=0.0)
        assert e.value.status_code == 409 and e.value.code == "feedback_conflict"
        assert e.value.response.headers["x-should-retry"] == "false"  # an SDK would otherwise retry a 409
        assert e.value.body["type"] == "conflict_error"
        assert labels(stack, "feedback") == {"Rate me once.": (1.0, False, "a")}
        assert metric(stack, 'routebalance_feedback_total{outcome="accepted",reason="duplicate"}') == 1
    finally:
        stack.stop()


def test_bad_feedback_bodies_get_clear_openai_errors(tmp_path):
    stack = start(tmp_path, learning={"feedback_max_bytes": 256})
    try:
        cid = ask(sdk(stack), "Something to rate.")
        auth = {"Authorization": f"Bearer {KEY}"}

        def post(status: int, param: str | None, **kwargs) -> str:
            r = httpx.post(stack.base_url + "/feedback", timeout=10, headers={**auth, **kwargs.pop("headers", {})},
                           **kwargs)
            assert r.status_code == status, r.text
            error = r.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
            return error["message"]

        json_type = {"Content-Type": "application/json"}
        assert "must be a JSON object" in post(400, None, content=b"not json", headers=json_type)
        assert "got a JSON list" in post(400, None, json=[cid, 1.0])
        assert "id must be the completion's id" in post(400, "id", json={"score": 0.5})
        assert "id must be" in post(400, "id", json={"id": 7, "score": 0.5})
        assert "in [0, 1], got 1.5" in post(400, "score", json={"id": cid, "score": 1.5})
        assert "in [0, 1], got True" in post(400, "score", json={"id": cid, "score": True})
        assert "one of score" in post(400, "score", json={"id": cid})
        assert "one of score" in post(400, "score", json={"id": cid, "score": 1, "thumbs": "up"})
        assert '"up" or "down"' in post(400, "thumbs", json={"id": cid, "thumbs": "sideways"})
        assert "unknown field 'rating'" in post(400, "rating", json={"id": cid, "rating": "up"})
        assert "too large" in post(413, None, json={"id": cid + "x" * 300, "score": 1.0})
        assert "Content-Type" in post(415, None, content=b"{}", headers={"Content-Type": "text/plain"})
        assert "API key" in post(401, None, json={"id": cid, "score": 1.0}, headers={"Authorization": ""})
        assert labels(stack, "feedback") == {}  # none of them was stored...
        assert rate(sdk(stack), id=cid, score=0.5)["accepted"]  # ...nor spoilt the id's one rating
    finally:
        stack.stop()


def test_feedback_is_rate_limited_per_principal(tmp_path):
    stack = start(tmp_path, learning={"feedback_rate_per_min": 2})
    try:
        a = sdk(stack)
        for _ in range(2):  # every call counts, refused ones too
            with pytest.raises(openai.NotFoundError):
                rate(a, id="chatcmpl-unknown", score=1.0)
        with pytest.raises(openai.RateLimitError) as e:
            rate(a, id="chatcmpl-unknown", score=1.0)
        assert int(e.value.response.headers["Retry-After"]) >= 1 and e.value.code == "rate_limit_exceeded"
        with pytest.raises(openai.NotFoundError):  # another key has its own minute
            rate(sdk(stack, OTHER), id="chatcmpl-unknown", score=1.0)
    finally:
        stack.stop()


def test_the_rate_limiter_tracks_a_bounded_number_of_principals():
    limiter = RateLimiter(max_names=2)
    assert limiter.allow("x", 1, 0.0) is None and limiter.allow("y", 1, 0.0) is None
    assert limiter.allow("x", 1, 1.0) is not None  # x used again: now the most recent
    assert limiter.allow("z", 1, 2.0) is None  # y, idle longest, is forgotten...
    assert limiter.allow("x", 1, 3.0) is not None  # ...not x, still limited
    assert limiter.allow("y", 1, 3.0) is None  # y starts afresh


def test_a_full_store_refuses_with_503_and_the_feedback_can_be_sent_again(tmp_path):
    stack = start(tmp_path, learning={"max_labels": 1})
    try:
        a = sdk(stack)
        cid = ask(a, "The first answer.")  # its length takes the one row
        wait_for(lambda: stack.gateway.learner.store.rows == 1, 10, "the length stored")
        ask(a, "The second answer.")
        wait_for(lambda: metric(stack, 'routebalance_length_labels_total{result="full"}') == 1, 10,
                 "the second length refused")
        with pytest.raises(openai.InternalServerError) as e:
            rate(a, id=cid, score=1.0)
        assert e.value.status_code == 503 and e.value.code == "label_store_full"
        stack.gateway.learner.store.max_labels = 10  # as a reload raising the bound does
        assert rate(a, id=cid, score=1.0) == {"id": cid, "accepted": True, "source": "feedback", "duplicate": False}
        assert labels(stack, "feedback") == {"The first answer.": (1.0, False, "a")}
    finally:
        stack.stop()


def test_feedback_is_off_with_learning(tmp_path):
    stack = start(tmp_path, learning={"enabled": False})
    try:
        cid = ask(sdk(stack), "Not learned.")
        with pytest.raises(openai.NotFoundError) as e:
            rate(sdk(stack), id=cid, score=1.0)
        assert e.value.code == "learning_off" and "[learning] enabled = false" in e.value.message
        assert not (tmp_path / "labels.db").exists()
    finally:
        stack.stop()


def test_a_store_that_cannot_open_leaves_serving_alone_and_feedback_says_why(tmp_path):
    (tmp_path / "a-file").write_text("not a folder")
    stack = start(tmp_path, learning={"path": str(tmp_path / "a-file" / "labels.db")})
    try:
        a = sdk(stack)
        cid = ask(a, "Still answered.")
        with pytest.raises(openai.InternalServerError) as e:
            rate(a, id=cid, score=1.0)
        assert e.value.status_code == 503 and e.value.code == "learning_off"
        assert "label store" in e.value.message and "a-file" in e.value.message
    finally:
        stack.stop()


# ---- answer lengths ----------------------------------------------------------------------------------

def test_answer_lengths_are_stored_and_censored_when_cut(tmp_path):
    stack = start(tmp_path)
    try:
        a = sdk(stack)
        ask(a, "whole")  # ends by itself ("stop") after ANSWER_TOKENS
        ask(a, "whole, streamed", stream=True)
        ask(a, "cut", max_tokens=2)  # finish_reason "length": at least 2 tokens
        ask(a, "cut, streamed", max_tokens=3, stream=True, stream_options={"include_usage": True})
        a.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "two answers"}], n=2)
        ask(a, "last")  # the writer keeps order: once this one is stored, the ones before it are
        wait_for(lambda: "last" in labels(stack, "length"), 10, "the lengths stored")
        assert labels(stack, "length") == {
            "whole": (ANSWER_TOKENS, False, "a"), "whole, streamed": (ANSWER_TOKENS, False, "a"),
            "cut": (2, True, "a"), "cut, streamed": (3, True, "a"), "last": (ANSWER_TOKENS, False, "a")}
        assert metric(stack, 'routebalance_length_labels_total{result="stored"}') == 5
        ask(a, "whole")  # the same prompt and model again: its first length stays
        wait_for(lambda: metric(stack, 'routebalance_length_labels_total{result="exists"}') == 1, 10,
                 "the repeat counted")
    finally:
        stack.stop()


def test_prompt_text_can_be_kept_as_a_hash_only(tmp_path):
    stack = start(tmp_path, learning={"keep_prompt_text": False})
    try:
        a = sdk(stack)
        rate(a, id=ask(a, "Nobody may read this."), score=1.0)
        wait_for(lambda: stack.gateway.learner.store.rows == 2, 10, "the length and the feedback stored")
        stored = list(stack.gateway.learner.store.labels())
        assert {lb.prompt for lb in stored} == {None}
        assert {lb.prompt_hash for lb in stored} == {prompt_hash("Nobody may read this.")}
    finally:
        stack.stop()


def test_traffic_labels_export_as_a_workload_for_train(tmp_path):
    stack = start(tmp_path)
    try:
        a = sdk(stack)
        rate(a, id=ask(a, "What is a river?"), thumbs="up")
        rate(a, id=ask(a, "What is a lake?", max_tokens=2), score=0.25)
        ask(a, "Nobody rated this.")
        wait_for(lambda: stack.gateway.learner.store.rows == 5, 10, "three lengths and two feedbacks stored")
        out = tmp_path / "traffic.jsonl"
        run = subprocess.run([sys.executable, "-m", "gateway.cli", "labels", "export", "--out", str(out),
                              "--config", str(stack.config_path)], capture_output=True, text=True, timeout=60)
        assert run.returncode == 0, run.stderr
        assert "exported 2 prompts" in run.stdout and f"no quality label for {MODEL}" in run.stdout
        assert "1 labels have only a censored length" in run.stdout
        records = {r.prompt: r.models[MODEL] for r in read_jsonl(out)}
        assert {p: (m.score, m.output_length) for p, m in records.items()} == {
            "What is a river?": (1.0, ANSWER_TOKENS), "What is a lake?": (0.25, 2)}
    finally:
        stack.stop()
