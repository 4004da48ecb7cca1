"""`serve --workers N` on one host without Redis: key spend and reservations shared through the SQLite file.

The ledger first (tenancy/spend/host.py): two processes racing holds on one file never pass the limit, a
dead process's holds expire, a settlement books once, and one the file refuses is kept and written later.
Then the whole: `routebalance serve --workers 2` (real processes on one port, stub instances, the openai SDK)
with one limited key hammered over many connections books within its limit, from both workers."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import multiprocessing
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.mmap_dict import MmapedDict
from stubs import MODEL, LoopThread, Stub, stub_config

from conftest import wait_for
from gateway.config.sections import ApiKey
from gateway.core.budget import predicted_cost
from gateway.learning.completions import LoggedCompletion, Principal
from gateway.learning.host_completions import HostCompletions
from gateway.tenancy.keys import hash_key
from gateway.tenancy.spend.host import HostSpendLedger
from gateway.tenancy.spend.sqlite import SpendStoreError

KEY, FREE = "rb-host-team", "rb-host-free"
ANSWER_TOKENS = 5
REPO = Path(__file__).resolve().parents[1]
LIMITED = ApiKey(name="team", sha256=hash_key("rb-a"), spend_limit_usd=50.0)
TOL = 1 + 1e-9  # the limit's relative tolerance (core/budget.py REL_TOL)


def _booked(path: Path, key: str = "team") -> tuple[float, int]:
    with sqlite3.connect(path) as db:
        row = db.execute("SELECT SUM(usd), SUM(requests) FROM spend WHERE key = ?", (key,)).fetchone()
    return float(row[0] or 0.0), int(row[1] or 0)


def _holds(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return db.execute("SELECT COUNT(*) FROM holds").fetchone()[0]


def _race(path: str, start, granted) -> None:
    """One process: 100 holds of 1 USD as fast as it can, every other one settled at its full amount."""
    ledger = HostSpendLedger(path, hold_ttl_s=600)
    start.wait()
    got = 0
    for k in range(100):
        held = asyncio.run(ledger.acquire(LIMITED, 1.0, 1000.0))
        if held is not None:
            got += 1
            if k % 2:
                ledger.settle(held, 1.0)
    granted.put(got)
    asyncio.run(ledger.aclose(1.0))


def test_two_processes_racing_holds_on_one_file_never_pass_the_limit(tmp_path):
    path = tmp_path / "state.db"
    # The file set up before the race, as the first worker would, and closed: a SQLite connection open across
    # a fork breaks the children's locks (the workers of `serve --workers` are fresh interpreters, not forks).
    asyncio.run(HostSpendLedger(path, hold_ttl_s=600).aclose(1.0))
    ctx = multiprocessing.get_context("fork")
    start, granted = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(str(path), start, granted)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    grants = [granted.get(timeout=5) for _ in procs]
    # Each process alone would grant 50 (its own memory saw only its own holds): together exactly 50.
    assert sum(grants) == 50 and all(g > 0 for g in grants), grants
    usd, requests = _booked(path)
    assert usd + _holds(path) * 1.0 == 50.0 and requests == usd


async def test_a_dead_process_hold_expires_and_a_settlement_books_once(tmp_path):
    path = tmp_path / "state.db"
    dead, live = HostSpendLedger(path, hold_ttl_s=10), HostSpendLedger(path, hold_ttl_s=10)
    assert await dead.acquire(LIMITED, 40.0, 0.0) is not None  # never settled: its process "dies"
    assert live.remaining(LIMITED, 5.0) == 10.0
    assert await live.acquire(LIMITED, 20.0, 5.0) is None  # the dead one's hold still counts
    held = await live.acquire(LIMITED, 20.0, 10.0)  # expired at 0 + 10 s
    assert held is not None and _holds(path) == 1
    live.settle(held, 15.0)
    live.settle(held, 15.0)  # again: nothing more
    assert _booked(path) == (15.0, 1) and _holds(path) == 0
    unlimited = await live.acquire(ApiKey(name="free", sha256=hash_key("rb-b")), 3.0, 10.0)
    assert unlimited is not None and _holds(path) == 0  # no limit: nothing to hold
    live.settle(unlimited, 2.0)
    assert _booked(path, "free") == (2.0, 1)
    released = await live.acquire(LIMITED, 1.0, 10.0)
    assert released is not None
    live.release(released)
    assert _holds(path) == 0 and live.remaining(LIMITED, 10.0) == 35.0
    await live.aclose(1.0)


async def test_a_settlement_the_file_refuses_is_kept_and_written_later(tmp_path):
    path = tmp_path / "state.db"
    ledger = HostSpendLedger(path, hold_ttl_s=600)
    held = await ledger.acquire(LIMITED, 10.0, 0.0)
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN IMMEDIATE")  # another process holds the write lock past the wait
    with pytest.raises(SpendStoreError):
        ledger.settle(held, 8.0)
    assert ledger.unwritten == 1
    with pytest.raises(SpendStoreError):  # keyed requests are refused while a booking waits
        await ledger.acquire(LIMITED, 1.0, 0.0)
    other.execute("ROLLBACK")
    assert ledger.remaining(LIMITED, 0.0) == 40.0  # its hold counted meanwhile
    assert await ledger.acquire(LIMITED, 1.0, 0.0) is not None  # writes the waiting booking first
    assert ledger.unwritten == 0 and _booked(path) == (8.0, 1) and _holds(path) == 1
    other.close()
    await ledger.aclose(1.0)


def _completion(cid: str, prompt: str = "p") -> LoggedCompletion:
    return LoggedCompletion(cid, Principal("free"), MODEL, "hash-" + cid, prompt, 0.0)


def test_completions_logged_by_one_worker_are_found_and_rated_by_another(tmp_path):
    path, now = tmp_path / "state-completions.db", time.time()  # (lookups read the host's clock)
    one, two = HostCompletions(path, 100.0, 3, 10), HostCompletions(path, 100.0, 3, 10)
    one.put([_completion("a"), _completion("b", "012345678")], now=now - 2)
    two.put([_completion("b"), _completion("c")], now=now - 1)  # "b" again: ambiguous, never rated
    found = asyncio.run(two.lookup("a"))
    assert found is not None and found.owner == Principal("free") and found.rating is None
    assert asyncio.run(one.lookup("b")) is None
    asyncio.run(two.rate("a", 0.5))
    rated = asyncio.run(one.lookup("a"))
    assert rated is not None and rated.rating == 0.5  # a different score from another worker is a conflict
    one.put([_completion("d"), _completion("e", "012345678")], now=now)  # 5 ids, 12 chars: past both bounds
    with sqlite3.connect(path) as db:
        kept = [row[0] for row in db.execute("SELECT id FROM completions ORDER BY at, rowid")]
    assert kept == ["d", "e"], kept  # oldest first until both bounds hold: "a" "b" for the count, "c" for the text
    one.put([], now=now + 200)  # past the ttl: every entry expires
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM completions").fetchone()[0] == 0


def _answer(base_url: str, prompt: str, key: str = KEY):
    """(cost, None) of one answer on a connection of its own (so the kernel picks a worker anew), or
    (status, error body) of a refusal."""
    with openai.OpenAI(base_url=base_url, api_key=key, max_retries=0, timeout=30) as client:
        try:
            r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=20)
            return r.usage.model_extra["cost_usd"], None if key == KEY else r.id
        except openai.APIStatusError as e:
            return e.status_code, e.response.json()


def _answers_per_worker(supervisor: int) -> dict[int, float]:
    """Each worker's 200 answers, from its own file of the host's multiprocess metrics (the page adds them up)."""
    counts: dict[int, float] = {}
    for pid in subprocess.run(["pgrep", "-P", str(supervisor)], capture_output=True, text=True).stdout.split():
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        metrics_dir = next(v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"PROMETHEUS_MULTIPROC_DIR="))
        counts[int(pid)] = 0.0
        own = Path(metrics_dir, f"counter_{pid}.db")
        if own.exists():
            for key, value, *_ in MmapedDict.read_all_values_from_file(str(own)):
                _metric, name, labels, _help = json.loads(key)
                if name == "routebalance_requests_total" and labels.get("status") == "200":
                    counts[int(pid)] += value
    return counts


def test_two_workers_on_the_sqlite_file_share_one_spend_limit(tmp_path):
    stubs = [Stub(mode={"stop": ANSWER_TOKENS}), Stub(mode={"stop": ANSWER_TOKENS})]
    limit = 12 * predicted_cost(30, ANSWER_TOKENS, 0.2e-6, 0.4e-6)  # room for about 12 answers
    state = tmp_path / "state.db"
    keys = [{"name": "team", "sha256": hash_key(KEY), "spend_limit_usd": limit},
            {"name": "free", "sha256": hash_key(FREE)}]
    path = stub_config(tmp_path, stubs, auth={"keys": keys},
                       state={"backend": "sqlite", "path": str(state)})
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    root, base_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1"
    loop = LoopThread()
    for stub in stubs:
        loop.call(stub.start())
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "--log-level", "WARNING", "serve", "--workers", "2",
                             "--config", str(path)], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        seen: set[int] = set()

        def both_workers_answer() -> bool:
            if httpx.get(root + "/health/ready", timeout=2).status_code == 200:  # a fresh connection each time
                seen.add(httpx.get(root + "/health", timeout=2).json()["worker"]["index"])
            return seen == {0, 1}

        wait_for(both_workers_answer, 60, "both workers listening on the port")

        # Room for about 12 answers, asked 48 times from 16 clients at once, each on a new connection.
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(lambda k: _answer(base_url, f"question {k}"), range(48)))
        costs = [cost for cost, body in outcomes if body is None]
        refusals = [body for status, body in outcomes if body is not None and status == 402]
        assert costs and len(costs) + len(refusals) == len(outcomes), outcomes
        for body in refusals:  # the OpenAI error shape
            assert body["error"]["code"] == "spend_limit_exceeded" and body["error"]["message"], body
            assert set(body["error"]) >= {"message", "type", "param", "code"}
        assert sum(costs) <= limit * TOL
        usd, requests = _booked(state)
        assert requests == len(costs) and usd == pytest.approx(sum(costs)) and usd <= limit * TOL
        assert _holds(state) == 0  # every hold settled
        served = _answers_per_worker(proc.pid)
        assert len(served) == 2 and all(n > 0 for n in served.values()), served
        assert sum(served.values()) == len(costs)

        # Feedback on 16 answers, each on a connection of its own: whichever worker it reaches takes it
        # (about one in two reaches a worker that did not serve the answer), through the same file.
        answers = [_answer(base_url, f"rate me {k}", FREE) for k in range(16)]
        for _, completion_id in answers:
            with openai.OpenAI(base_url=base_url, api_key=FREE, max_retries=0, timeout=30) as c:
                assert c.post("/feedback", body={"id": completion_id, "score": 1.0}, cast_to=object)["accepted"]
        with openai.OpenAI(base_url=base_url, api_key=FREE, max_retries=0, timeout=30) as c:
            with pytest.raises(openai.APIStatusError) as e:  # another score for a rated answer: a conflict
                c.post("/feedback", body={"id": answers[0][1], "score": 0.0}, cast_to=object)
        assert e.value.status_code == 409
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        for stub in stubs:
            loop.call(stub.stop())
        loop.stop()
