"""`routebalance serve --workers N`: real worker processes on one port, a real redis-server, stub instances,
the openai SDK as the client. What the workers must share is checked through the port, as a client sees it:
one key's spend limit, feedback on a completion another worker served, and /metrics counting every worker."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from redis_server import RedisServer
from stubs import MODEL, LoopThread, Stub, stub_config

from conftest import wait_for
from gateway.cli import main
from gateway.core.budget import predicted_cost
from gateway.tenancy.keys import hash_key

KEY, FREE = "rb-workers-team", "rb-workers-free"
ANSWER_TOKENS = 5
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def test_more_than_one_worker_needs_a_state_backend_they_share(tmp_path, capsys):
    path = stub_config(tmp_path, [Stub()], state={"backend": "memory"})
    assert main(["serve", "--workers", "2", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "--workers 2 needs a state backend the workers share" in err and '"sqlite"' in err
    assert main(["serve", "--workers", "0", "--config", str(path)]) == 2
    assert "--workers must be at least 1" in capsys.readouterr().err


def _workers(path: Path, n: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "serve", "--workers",
                             str(n), "--config", str(path)], cwd=REPO, env=env)


def _answer(base_url: str, key: str, prompt: str):
    """(cost, completion id) of one answer on a connection of its own (so the kernel picks a worker anew),
    or (status, code) of a refusal."""
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30) as client:
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=20)
            return r.usage.model_extra["cost_usd"], r.id
        except openai.APIStatusError as e:
            return e.status_code, e.code


def test_two_workers_share_the_port_one_spend_limit_feedback_and_metrics(tmp_path, server):
    stubs = [Stub(mode={"stop": ANSWER_TOKENS}), Stub(mode={"stop": ANSWER_TOKENS})]
    one = predicted_cost(30, ANSWER_TOKENS, 0.2e-6, 0.4e-6)  # about one answer (prices per token)
    limit = 12 * one
    keys = [{"name": "team", "sha256": hash_key(KEY), "spend_limit_usd": limit},
            {"name": "free", "sha256": hash_key(FREE)}]
    path = stub_config(tmp_path, stubs, auth={"keys": keys},
                       state={"backend": "redis", "url": server.url, "prefix": "workers:", "sync_interval_s": 0.05,
                              "timeout_s": 2.0},
                       learning={"path": str(tmp_path / "labels.db")})
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    root, base_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"
    loop = LoopThread()
    for stub in stubs:
        loop.call(stub.start())
    proc = _workers(path, 2)
    try:
        seen: set[int] = set()

        def both_workers_answer() -> bool:
            reply = httpx.get(root + "/health/ready", timeout=2)  # a fresh connection each time
            if reply.status_code == 200:
                seen.add(httpx.get(root + "/health", timeout=2).json()["worker"]["index"])
            return seen == {0, 1}

        wait_for(both_workers_answer, 60, "both workers listening on the port")

        # One key with room for about 12 answers, asked 48 times at once across the workers.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(lambda k: _answer(base_url, KEY, f"question {k}"), range(48)))
        costs = [o[0] for o in outcomes if isinstance(o[0], float)]
        refusals = {o for o in outcomes if not isinstance(o[0], float)}
        assert costs and refusals == {(402, "spend_limit_exceeded")}, refusals
        assert sum(costs) <= limit * (1 + 1e-9)
        client = server.client()

        def booked() -> tuple[float, int]:
            found = [k for k in client.scan_iter("workers:*team*") if client.type(k) == "hash"
                     and "usd" in client.hgetall(k)]
            return (sum(float(client.hget(k, "usd")) for k in found),
                    sum(int(client.hget(k, "requests")) for k in found))

        wait_for(lambda: booked()[1] == len(costs), 10, "every answer booked in redis")
        assert booked()[0] == pytest.approx(sum(costs))

        # Feedback on 16 answers, each sent on a connection of its own: whichever worker it reaches takes it
        # (one in two would reach a worker that did not serve the answer).
        answers = [_answer(base_url, FREE, f"rate me {k}") for k in range(16)]
        for _, completion_id in answers:
            with openai.OpenAI(base_url=base_url, api_key=FREE, max_retries=0, timeout=30) as c:
                assert c.post("/feedback", body={"id": completion_id, "score": 1.0}, cast_to=object)["accepted"]
        with openai.OpenAI(base_url=base_url, api_key=FREE, max_retries=0, timeout=30) as c:
            with pytest.raises(openai.APIStatusError) as e:  # another score for a rated answer: a conflict
                c.post("/feedback", body={"id": answers[0][1], "score": 0.0}, cast_to=object)
        assert e.value.status_code == 409

        # /metrics, rendered by whichever worker the scrape reaches, counts both workers' answers.
        answered = len(costs) + len(answers)

        def page_counts_all() -> bool:
            page = httpx.get(root + "/metrics", timeout=5).text
            rows = [ln for ln in page.splitlines()
                    if ln.startswith("routebalance_requests_total{") and 'status="200"' in ln]
            return sum(float(ln.rsplit(" ", 1)[1]) for ln in rows) == answered

        wait_for(page_counts_all, 10, f"/metrics counting all {answered} answers")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for stub in stubs:
            loop.call(stub.stop())
        loop.stop()
    with pytest.raises(httpx.ConnectError):  # every worker stopped with the supervisor
        httpx.get(root + "/health", timeout=2)


def test_a_worker_that_dies_stops_the_others(tmp_path, server):
    path = stub_config(tmp_path, [Stub()], state={"backend": "redis", "url": server.url, "prefix": "dies:"})
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    proc = _workers(path, 2)
    try:
        seen: set[int] = set()

        def both() -> bool:
            seen.add(httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()["worker"]["index"])
            return len(seen) == 2

        wait_for(both, 60, "both workers up")
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        os.kill(int(children[0]), signal.SIGKILL)
        assert proc.wait(30) != 0  # the supervisor says it failed, so a service manager restarts the whole
        assert not any(Path(f"/proc/{pid}").exists() for pid in children)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_workers_stop_when_their_supervisor_is_killed(tmp_path, server):
    path = stub_config(tmp_path, [Stub()], state={"backend": "redis", "url": server.url, "prefix": "orphan:"})
    proc = _workers(path, 2)
    children: list[str] = []
    try:
        def two_children() -> bool:
            children[:] = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
            return len(children) == 2

        wait_for(two_children, 30, "two workers started")
        proc.kill()  # no chance to pass a signal on
        proc.wait(10)
        wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in children), 30, "the workers gone")
    finally:
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def test_worker_parts_of_a_cap_add_up_to_the_cap():
    from gateway.serving.workers import Worker

    for total in (0, 1, 2, 3, 7, 10):
        for count in (1, 2, 3, 4):
            parts = [Worker(i, count).part_of_count(total) for i in range(count)]
            assert sum(parts) == total and max(parts) - min(parts) <= 1
    assert sum(Worker(i, 3).part(1.0) for i in range(3)) == pytest.approx(1.0)
    assert Worker.parse("1/2") == Worker(1, 2)
    with pytest.raises(ValueError):
        Worker.parse("2/2")
