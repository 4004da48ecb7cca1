"""Failover and bounds (issue 11, findings 4, 5 and 6), against the real gateway in front of stubs.

Findings, as first found: a failing instance kept getting first attempts and its
requests were lost although a healthy one was up, a 404 reached the client; a
1 MB prompt was tokenized on the event loop; a huge upstream answer was buffered
whole, deep JSON and a huge budget gave 500s, slow and idle clients held
connections, and a stream cut by its instance ended as a normal 200.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import select
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import openai
import orjson
import pytest
from aiohttp import web
from stubs import TOKEN, Stub, StubStack, stub_config, stub_instance

from conftest import wait_for
from gateway.core.pool_state import InstanceHealth
from gateway.tenancy.keys import hash_key

HI = [{"role": "user", "content": "hi"}]
CHAT = {"model": "auto", "messages": HI, "max_tokens": 4}
TIMEOUT = httpx.Timeout(10.0)  # every request of these tests answers in well under this


@contextlib.contextmanager
def running(tmp, stubs: list[Stub], **sections):
    stack = StubStack(stub_config(tmp, stubs, **sections), stubs)
    try:
        yield stack
    finally:
        stack.stop()


def ready(stack: StubStack) -> httpx.Response:
    return httpx.get(stack.root + "/health/ready", timeout=TIMEOUT)


def sse_events(text: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order."""
    return [e.strip()[len("data:"):].strip() for e in text.split("\n\n") if e.strip().startswith("data:")]


def assert_openai_error(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"]
    assert {"message", "type", "param", "code"} <= err.keys()
    return err


# ---- finding 4: failover memory ----------------------------------------------------------------

LONG_COOLDOWN = {"failure_threshold": 2, "cooldown_s": 60.0, "max_cooldown_s": 120.0}  # longer than any test here


def test_a_failing_instance_loses_no_request_and_gets_only_threshold_attempts(tmp_path):
    """Sequential: the bad instance fails its first attempts (each retried on the healthy one),
    then cools down for longer than the test and gets no attempt at all."""
    bad, good = Stub(mode={"status": 500}), Stub()
    with running(tmp_path, [bad, good], health=LONG_COOLDOWN) as stack, httpx.Client(timeout=TIMEOUT) as client:
        answers = [client.post(stack.base_url + "/chat/completions", json=CHAT) for _ in range(100)]
        assert [r.status_code for r in answers] == [200] * 100  # 0 lost
        assert {r.headers["X-Route-Instance"] for r in answers} == {"stub-1"}
        assert len(good.requests) == 100  # the healthy one answered every request, each once
        assert 1 <= len(bad.requests) <= LONG_COOLDOWN["failure_threshold"]
        state = ready(stack)
        assert state.status_code == 200
        assert state.json()["cooling_down"] == ["stub-0"] and state.json()["routable"] == 1


def test_a_failing_instance_under_concurrency(tmp_path):
    """Concurrency 8: only the attempts already on their way when the cooldown began can reach the
    bad instance after it (failure_threshold - 1 before, at most 8 in flight at that moment)."""
    concurrency, total = 8, 100
    bad, good = Stub(mode={"status": 500}), Stub()

    async def burst(url: str) -> list[httpx.Response]:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(timeout=TIMEOUT, limits=httpx.Limits(max_connections=concurrency)) as client:
            async def one() -> httpx.Response:
                async with sem:
                    return await client.post(url, json=CHAT)
            return await asyncio.gather(*(one() for _ in range(total)))

    with running(tmp_path, [bad, good], health=LONG_COOLDOWN) as stack:
        answers = asyncio.run(burst(stack.base_url + "/chat/completions"))
        assert [r.status_code for r in answers].count(200) == total  # 0 lost
        assert {r.headers["X-Route-Instance"] for r in answers} == {"stub-1"}
        assert len(good.requests) == total
        assert 1 <= len(bad.requests) <= LONG_COOLDOWN["failure_threshold"] - 1 + concurrency


def test_unreachable_instances_do_not_use_up_the_retries(tmp_path):
    """Two instances refuse connections (nothing listens on their ports) and `retries` is 0: a
    request the round robin sends to them first still reaches the healthy one, since a request
    that never reached an instance is not a failed attempt that costs a retry."""
    good = Stub()
    instances = [stub_instance(Stub(), "dead-0"), stub_instance(Stub(), "dead-1"), stub_instance(good, "good")]
    with running(tmp_path, [good], instances=instances, upstream={"retries": 0},
                 health={"failure_threshold": 1000}) as stack, httpx.Client(timeout=TIMEOUT) as client:
        answers = [client.post(stack.base_url + "/chat/completions", json=CHAT) for _ in range(9)]
    assert [r.status_code for r in answers] == [200] * 9
    assert {r.headers["X-Route-Instance"] for r in answers} == {"good"}
    assert len(good.requests) == 9


def test_all_instances_failing_then_one_recovers_through_a_probe(tmp_path):
    health = {"failure_threshold": 2, "cooldown_s": 2.0, "max_cooldown_s": 4.0}
    a, b = Stub(mode={"status": 500}), Stub(mode={"status": 500})
    with running(tmp_path, [a, b], health=health) as stack, httpx.Client(timeout=TIMEOUT) as client:
        url = stack.base_url + "/chat/completions"
        seen = []
        for _ in range(6):  # two requests (each trying both) cool both down; then 503 at once
            t0 = time.monotonic()
            r = client.post(url, json=CHAT)
            assert time.monotonic() - t0 < 5.0  # never hangs
            seen.append(r)
            if r.status_code == 503:
                break
            assert_openai_error(r, 502)
        refused = seen[-1]
        err = assert_openai_error(refused, 503)
        assert err["code"] == "no_healthy_instance"
        assert 1 <= int(refused.headers["Retry-After"]) <= health["max_cooldown_s"] + 1
        assert len(seen) <= 3
        state = ready(stack)
        assert state.status_code == 503
        assert sorted(state.json()["cooling_down"]) == ["stub-0", "stub-1"] and state.json()["routable"] == 0
        before = len(a.requests) + len(b.requests)
        r = client.post(url, json=CHAT)  # still cooling: refused without touching either instance
        assert r.status_code == 503 and len(a.requests) + len(b.requests) == before

        b.mode = {}  # stub-1 comes back
        wait_for(lambda: "stub-1" not in ready(stack).json()["cooling_down"], timeout=3 * health["max_cooldown_s"],
                 what="stub-1's cooldown to end")
        answers = [client.post(url, json=CHAT) for _ in range(5)]
        assert [r.status_code for r in answers] == [200] * 5
        assert {r.headers["X-Route-Instance"] for r in answers} == {"stub-1"}
        state = ready(stack)
        assert state.status_code == 200 and "stub-1" not in state.json()["cooling_down"]


@pytest.mark.parametrize("threshold", [2, 1000])
def test_a_404_is_retried_elsewhere_never_passed_on(tmp_path, threshold):
    """A 404 (the instance does not serve the model) fails over, streamed or not. With a huge
    threshold the 404 instance keeps its turns, so many requests go through a retry."""
    bad, good = Stub(mode={"status": 404}), Stub()
    health = {**LONG_COOLDOWN, "failure_threshold": threshold}
    with running(tmp_path, [bad, good], health=health) as stack, httpx.Client(timeout=TIMEOUT) as client:
        url = stack.base_url + "/chat/completions"
        statuses, instances = [], set()
        for k in range(20):
            stream = k % 2 == 1
            with client.stream("POST", url, json={**CHAT, "stream": stream}) as r:
                text = r.read().decode()
            statuses.append(r.status_code)
            instances.add(r.headers.get("X-Route-Instance"))
            if stream and r.status_code == 200:
                assert sse_events(text)[-1] == "[DONE]"
        assert 404 not in statuses
        assert statuses == [200] * 20
        assert instances == {"stub-1"}
        assert len(good.requests) == 20
        if threshold == 2:
            assert 1 <= len(bad.requests) <= 2  # then cooled down like any failing instance
        else:
            assert len(bad.requests) >= 8  # it was tried on its turns and each time retried on stub-1


def test_health_breaker_threshold_backoff_cap_and_half_open_probe():
    rules = SimpleNamespace(failure_threshold=3, cooldown_s=1.0, max_cooldown_s=5.0)
    h = InstanceHealth()
    a, b, c = object(), object(), object()
    assert h.routable(0.0) and not h.cooling(0.0)

    # Below the threshold nothing changes; a success resets the count.
    h.failed(a, 0.0, rules)
    h.failed(b, 0.0, rules)
    assert h.routable(0.0)
    h.succeeded(c)
    h.failed(a, 0.1, rules)
    h.failed(b, 0.1, rules)
    assert h.routable(0.1)
    h.failed(c, 0.2, rules)  # the third in a row: cooled down for cooldown_s
    assert h.cooling(0.2) and not h.routable(0.2) and not h.routable(1.19)
    h.failed(a, 0.5, rules)  # an attempt sent before the cooldown began: does not extend it
    assert h.cooldown_until == pytest.approx(1.2)

    # Half-open: routable again, and the first attempt is the only probe.
    assert h.routable(1.2) and not h.cooling(1.2)
    h.attempt(a, 1.2)
    assert h.probe is a and not h.routable(1.3)  # one probe in flight, no other request
    h.attempt(b, 1.3)
    assert h.probe is a

    # A failed probe opens the circuit again for twice as long ...
    h.failed(a, 1.5, rules)
    assert h.probe is None and h.cooldown_until == pytest.approx(1.5 + 2.0)
    assert not h.routable(3.49) and h.routable(3.5)
    # ... and again (4 s), then capped at max_cooldown_s (5 s, not 8), and stays there.
    ends = []
    now = 3.5
    for _ in range(3):
        h.attempt(b, now)
        h.failed(b, now, rules)
        ends.append(h.cooldown_until - now)
        now = h.cooldown_until
    assert ends == pytest.approx([4.0, 5.0, 5.0])

    # A probe whose client left frees the half-open slot for another request.
    h.attempt(c, now)
    assert not h.routable(now)
    h.abandoned(a)  # not the probe: nothing changes
    assert h.probe is c
    h.abandoned(c)
    assert h.probe is None and h.routable(now)

    # A successful probe closes the circuit: back to the full threshold, backoff reset.
    h.attempt(a, now)
    h.succeeded(a)
    assert h.probe is None and h.routable(now) and h.cooldowns == 0 and h.failures == 0
    for x in (a, b):
        h.failed(x, now, rules)
    assert h.routable(now)
    h.failed(c, now, rules)
    assert h.cooldown_until == pytest.approx(now + rules.cooldown_s)  # the base cooldown, not a doubled one


def test_health_a_failure_without_a_request_counts_and_a_non_probe_does_not_take_the_probe():
    rules = SimpleNamespace(failure_threshold=1, cooldown_s=1.0, max_cooldown_s=60.0)
    h = InstanceHealth()
    h.failed(None, 0.0, rules)  # an unreachable scrape: as good as a failed attempt
    assert not h.routable(0.5)
    probe, other = object(), object()
    h.attempt(probe, 1.0)
    h.failed(other, 1.0, rules)  # not the probe (sent earlier): the probe still decides
    assert h.probe is probe
    h.succeeded(probe)
    assert h.routable(1.0) and h.cooldowns == 0


# ---- findings 5 and 6 on one stack: bounds --------------------------------------------------------

BOUNDS = {
    # The stub's failures here (cuts, huge answers) must not cool it down for the next test.
    "health": {"failure_threshold": 1000},
    "upstream": {"max_response_bytes": 1 << 20},
    "server": {"keepalive_timeout_s": 1.0, "body_timeout_s": 1.0, "max_body_bytes": 4 << 20},
}


class ChunkedStub(Stub):
    """A stub that can also send a huge non-streamed answer without a Content-Length (chunked),
    so the gateway cannot refuse it from its header and must stop reading at the cap."""

    sent: int = 0  # bytes of the last chunked answer written before the gateway hung up
    finished: bool = False  # the last chunked answer's handler has returned

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        size = self.mode.get("huge_chunked")
        if not size:
            return await super()._chat(request)
        self.requests.append((dict(request.headers), await request.json()))
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        self.sent, self.finished = 0, False
        piece = b"x" * (1 << 16)
        try:
            await resp.write(b'{"pad": "')
            while self.sent < size:
                await resp.write(piece)
                self.sent += len(piece)
            await resp.write(b'"}')
        except ConnectionResetError:
            pass  # the gateway hung up
        finally:
            self.finished = True
        return resp


@pytest.fixture(scope="module")
def bounds(tmp_path_factory):
    stub = ChunkedStub()
    with running(tmp_path_factory.mktemp("bounds"), [stub], **BOUNDS) as stack:
        yield stack, stub


@pytest.fixture
def stub(bounds):
    """The bounds stack's stub, healthy again after each test."""
    _, s = bounds
    s.mode = {}
    yield s
    s.mode = {}


def test_stream_cut_by_the_upstream_ends_with_an_error_event(bounds, stub):
    stack, _ = bounds
    stub.mode = {"cut": 3}
    with httpx.Client(timeout=TIMEOUT) as client, \
            client.stream("POST", stack.base_url + "/chat/completions", json={**CHAT, "stream": True}) as r:
        assert r.status_code == 200  # the first events went out before the cut
        text = r.read().decode()  # a properly ended HTTP body: no transport error
    events = sse_events(text)
    assert "[DONE]" not in events
    chunks = [orjson.loads(e) for e in events]
    assert [c["choices"][0]["delta"]["content"] for c in chunks[:-1]] == [TOKEN] * 3
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    err = chunks[-1]["error"]
    assert err["type"] == "upstream_error" and "stub-0" in err["message"]


def test_stream_cut_raises_an_api_error_in_the_openai_sdk(bounds, stub):
    stack, _ = bounds
    stub.mode = {"cut": 3}
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=10, max_retries=0)
    got = []
    try:
        stream = client.chat.completions.create(model="auto", messages=HI, max_tokens=4, stream=True)
        with pytest.raises(openai.APIError) as caught:
            for chunk in stream:
                got.append(chunk)
    finally:
        client.close()
    # The SDK raised on the error event itself: not a dropped connection (APIConnectionError, a subclass).
    assert type(caught.value) is openai.APIError
    assert caught.value.body["type"] == "upstream_error"
    assert "stub-0" in caught.value.message
    assert [c.choices[0].delta.content for c in got] == [TOKEN] * 3


def test_huge_answer_is_refused_with_502(bounds, stub):
    stack, _ = bounds
    stub.mode = {"huge": 64 << 20}
    t0 = time.monotonic()
    r = httpx.post(stack.base_url + "/chat/completions", json=CHAT, timeout=TIMEOUT)
    err = assert_openai_error(r, 502)
    assert err["type"] == "upstream_error" and "size cap" in err["message"]
    assert time.monotonic() - t0 < 8.0


def test_huge_chunked_answer_is_refused_without_reading_it_all(bounds, stub):
    stack, _ = bounds
    size = 64 << 20
    stub.mode = {"huge_chunked": size}
    r = httpx.post(stack.base_url + "/chat/completions", json=CHAT, timeout=TIMEOUT)
    err = assert_openai_error(r, 502)
    assert "size cap" in err["message"]
    # The gateway hung up soon after the cap (1 MiB): the instance could not send all of it.
    wait_for(lambda: stub.finished, timeout=5, what="the stub's answer to end")
    assert stub.sent < size // 4, f"the stub sent {stub.sent} bytes"


def _nested(depth: int) -> bytes:
    head = orjson.dumps({"model": "auto", "messages": HI, "max_tokens": 4})[:-1]
    return head + b',"extra":' + b"[" * depth + b"]" * depth + b"}"


@pytest.mark.parametrize("depth", [300, 1010])
def test_deeply_nested_json_is_a_400(bounds, stub, depth):
    stack, _ = bounds
    before = len(stub.requests)
    r = httpx.post(stack.base_url + "/chat/completions", content=_nested(depth),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error" and "nested" in err["message"]
    assert len(stub.requests) == before  # never forwarded


def test_nesting_within_the_limit_is_served(bounds, stub):
    stack, _ = bounds
    r = httpx.post(stack.base_url + "/chat/completions", content=_nested(60),
                   headers={"Content-Type": "application/json"}, timeout=TIMEOUT)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_an_astronomical_budget_is_served(bounds, stub, stream):
    stack, _ = bounds
    body = {**CHAT, "stream": stream, "routing": {"budget_usd": 1e303}}
    with httpx.Client(timeout=TIMEOUT) as client, \
            client.stream("POST", stack.base_url + "/chat/completions", json=body) as r:
        text = r.read().decode()
    assert r.status_code == 200, text
    if stream:
        events = sse_events(text)
        assert events[-1] == "[DONE]" and not any('"error"' in e for e in events)
    else:
        assert orjson.loads(text)["choices"][0]["message"]["content"] == TOKEN * 4


# ---- slow and idle clients (raw sockets) ----------------------------------------------------------

def _connect(stack: StubStack) -> socket.socket:
    server = stack.store.current.server
    return socket.create_connection((server.host, server.port), timeout=5)


def _closed_after(sock: socket.socket, limit: float, trickle: bool = False) -> float | None:
    """Seconds until the server closed `sock` (EOF or reset), None if it is still open after
    `limit`; anything the server says first is read and dropped. `trickle`: send one more header
    byte every 0.3 s meanwhile."""
    start = time.monotonic()
    while time.monotonic() - start < limit:
        readable, _, _ = select.select([sock], [], [], 0.3)
        try:
            if readable:
                if not sock.recv(65536):
                    return time.monotonic() - start
            elif trickle:
                sock.sendall(b"a")
        except (ConnectionResetError, BrokenPipeError):
            return time.monotonic() - start
    return None


def _read_response(sock: socket.socket, limit: float = 5.0) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length: (status, body)."""
    deadline = time.monotonic() + limit
    buf = b""
    while b"\r\n\r\n" not in buf:
        assert time.monotonic() < deadline, f"no response head in {limit} s: {buf!r}"
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a response: {buf!r}"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next(int(v) for k, _, v in (h.partition(":") for h in lines[1:]) if k.lower() == "content-length")
    while len(body) < length:
        assert time.monotonic() < deadline, "response body incomplete"
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        body += chunk
    return status, body


GET_HEALTH = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"


def test_slowloris_request_head_is_cut_off(bounds):
    stack, _ = bounds  # keepalive_timeout_s = 1
    with _connect(stack) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Pad: ")
        closed = _closed_after(sock, limit=8.0, trickle=True)
    assert closed is not None and closed < 3.5, f"slow header still open after {closed} s"


def test_idle_keepalive_connection_is_closed(bounds):
    stack, _ = bounds  # keepalive_timeout_s = 1
    with _connect(stack) as sock:
        sock.sendall(GET_HEALTH)
        status, _ = _read_response(sock)
        assert status == 200
        closed = _closed_after(sock, limit=8.0)
    assert closed is not None and closed < 3.5, "idle keep-alive connection still open"


def test_slow_request_body_gets_408(bounds, stub):
    stack, _ = bounds  # body_timeout_s = 1
    before = len(stub.requests)
    with _connect(stack) as sock:
        t0 = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n" + b'{"model": ')
        status, body = _read_response(sock, limit=8.0)
        elapsed = time.monotonic() - t0
    assert status == 408 and elapsed < 3.5
    err = orjson.loads(body)["error"]
    assert err["type"] and "body" in err["message"]
    assert len(stub.requests) == before


# ---- finding 6: the connection cap -----------------------------------------------------------------

def test_two_listeners_share_a_port_with_reuse_port():
    """SO_REUSEPORT through aiohttp's public API (the listener the gateway serves on): what several worker
    processes on one port need; without it the port is taken."""
    from conftest import free_port
    from gateway.serving.app import CappedListener

    port = free_port()

    async def health(request):
        return web.json_response({"status": "ok"})

    async def scenario() -> list[int]:
        app = web.Application()
        app.router.add_get("/health", health)
        runners = [web.AppRunner(app), web.AppRunner(app)]
        listeners = []
        try:
            for runner in runners:
                await runner.setup()
                listeners.append(CappedListener(runner, 8))
                await listeners[-1].start("127.0.0.1", port, reuse_port=True)
            lone = web.AppRunner(web.Application())
            await lone.setup()
            with pytest.raises(OSError):
                await CappedListener(lone, 8).start("127.0.0.1", port)
            await lone.cleanup()
            async with httpx.AsyncClient(timeout=5) as client:
                return [(await client.get(f"http://127.0.0.1:{port}/health")).status_code for _ in range(4)]
        finally:
            for listener in listeners:
                await listener.cleanup()

    assert asyncio.run(scenario()) == [200] * 4


def test_connections_beyond_the_cap_are_closed_at_once(tmp_path):
    cap = 4
    with running(tmp_path, [Stub()], server={"max_connections": cap}) as stack:
        server = stack.runners[0].runner.server

        def open_connections() -> int:
            return stack.run(lambda: len(server.connections))

        held = []
        try:
            for _ in range(cap):
                held.append(_connect(stack))
            wait_for(lambda: open_connections() == cap, timeout=5, what="the gateway to hold 4 connections")
            with _connect(stack) as extra:
                closed = _closed_after(extra, limit=1.0)
            assert closed is not None, "the connection over the cap was not closed within 1 s"
            for sock in held:  # the first four are still served
                sock.sendall(GET_HEALTH)
                assert _read_response(sock)[0] == 200
            held.pop().close()  # one leaves: its slot is free for a new client
            wait_for(lambda: open_connections() < cap, timeout=5, what="the closed connection to be dropped")
            with _connect(stack) as again:
                again.sendall(GET_HEALTH)
                assert _read_response(again)[0] == 200
        finally:
            for sock in held:
                sock.close()


# ---- finding 5: a long prompt is counted off the event loop ----------------------------------------

def test_long_prompt_is_counted_off_the_loop_thread(bounds, stub, monkeypatch):
    stack, _ = bounds
    counter = stack.gateway.token_counter
    original = counter.count_chat
    seen: list[tuple[int, threading.Thread]] = []

    def recording(messages, tools=()):
        seen.append((sum(len(str(m.get("content"))) for m in messages), threading.current_thread()))
        return original(messages, tools)

    monkeypatch.setattr(counter, "count_chat", recording)
    url = stack.base_url + "/chat/completions"
    big = "lorem ipsum " * 83_000  # ~1 MB, under the raised 4 MiB body limit
    with httpx.Client(timeout=httpx.Timeout(30.0)) as client:
        short = client.post(url, json=CHAT)
        long = client.post(url, json={**CHAT, "messages": [{"role": "user", "content": big}]})
    assert short.status_code == 200 and long.status_code == 200, long.text
    threads = {size: thread for size, thread in seen}
    assert threads[len("hi")] is stack.thread  # a short prompt: inline, on the loop
    assert threads[len(big)] is not stack.thread  # the long one: in a worker thread
    assert stack.gateway.store.current.server.tokenize_inline_chars < len(big)



# ---- what must not cool a healthy instance down (found in review) ---------------------

def test_a_busy_instance_fails_over_without_being_cooled_down(tmp_path):
    stubs = [Stub(mode={"delay_s": 1.0}), Stub(mode={"delay_s": 1.0})]
    with running(tmp_path, stubs, upstream={"max_connections_per_instance": 1, "acquire_timeout_s": 0.2,
                                            "connect_timeout_s": 0.2}) as stack:
        with httpx.Client(timeout=TIMEOUT) as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda _: http.post(stack.base_url + "/chat/completions", json=CHAT), range(4)))
        assert sorted(r.status_code for r in answers)[:2] == [200, 200]  # one request on each instance at once
        assert all(r.status_code in (200, 502) for r in answers)
        body = ready(stack).json()
        assert body["routable"] == 2 and body["cooling_down"] == []  # busy is not failing


def test_a_long_non_streamed_answer_times_out_without_a_retry_or_a_cooldown(tmp_path):
    stubs = [Stub(mode={"delay_s": 2.0}), Stub(mode={"delay_s": 2.0})]
    with running(tmp_path, stubs, upstream={"response_timeout_s": 0.5}, health={"failure_threshold": 1}) as stack:
        r = httpx.post(stack.base_url + "/chat/completions", json=CHAT, timeout=TIMEOUT)
        assert_openai_error(r, 504)
        assert len(stubs[0].requests) + len(stubs[1].requests) == 1  # as long anywhere else: not retried
        assert ready(stack).json()["cooling_down"] == []


def test_an_undecodable_authorization_header_is_a_401_not_a_500(tmp_path):
    stubs = [Stub()]
    keys = {"keys": [{"name": "a", "sha256": hash_key("rb-k")}]}
    with running(tmp_path, stubs, auth=keys, state={"backend": "memory"}) as stack:
        host, port = stack.root.split("//")[1].split(":")
        body = orjson.dumps(CHAT)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                         b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode()
                         + b"\r\n\r\n" + body)
            status, _ = _read_response(sock)
        assert status == 401
