"""Shared state through a real redis-server: spend that replicas cannot overspend together,
bookings written once, holds of a dead replica that expire, outages, and the pool view
(in-flight work and cooldowns) that replicas exchange."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time

import httpx
import openai
import pytest
from redis_server import RedisServer
from stubs import MODEL, Stub, StubStack, stub_config

from conftest import Stack, wait_for
from gateway.config.sections import ApiKey
from gateway.config.store import ConfigStore
from gateway.core.budget import per_token, predicted_cost
from gateway.core.pool_state import Share
from gateway.state.link import RedisLink
from gateway.state.sync import ReplicaSync
from gateway.tenancy.keys import hash_key
from gateway.tenancy.spend.redis import RedisSpendLedger
from gateway.tenancy.spend.sqlite import SpendStoreError

KEY, FREE = "rb-test-key-shared", "rb-test-key-free"
NOW = 1_795_000_000.0  # a fixed instant: spend periods are calendar days and months


@pytest.fixture
def server(tmp_path):
    s = RedisServer(tmp_path).start()
    yield s
    s.stop()


def limited(limit: float | None = 1.0, name: str = "team") -> ApiKey:
    return ApiKey(name=name, sha256=hash_key(KEY), spend_limit_usd=limit)


def replica(server: RedisServer, on_unavailable: str = "refuse", hold_ttl_s: float = 60.0,
            timeout_s: float = 1.0) -> RedisSpendLedger:
    return RedisSpendLedger(RedisLink(server.url, "test:", timeout_s), on_unavailable, hold_ttl_s)


async def booked(server: RedisServer, key: ApiKey) -> tuple[float, int]:
    """What Redis has booked for the key (read as `routebalance keys list` would)."""
    ledger = replica(server)
    try:
        [row] = await ledger.report([key], NOW)
    finally:
        await ledger.link.close()
    return row.spent_usd, row.requests


# ---- spend ----------------------------------------------------------------------------

async def test_replicas_reserving_at_once_never_hold_more_than_the_limit(server):
    ledgers = [replica(server) for _ in range(3)]
    key = limited(1.0)
    # 90 holds of 0.1 from three replicas at once, interleaved at the server: exactly ten fit.
    held = await asyncio.gather(*(ledgers[i % 3].acquire(key, 0.1, NOW) for i in range(90)))
    granted = [r for r in held if r is not None]
    assert len(granted) == 10
    assert {r.key for r in granted} == {"team"}
    for ledger in ledgers:
        await ledger.refresh(key, NOW)
        assert ledger.remaining(key, NOW) == pytest.approx(0.0, abs=1e-12)
    # Settling one at 0.05 frees 0.05 for everyone.
    owner = next(ledger for ledger in ledgers for r in granted[:1] if r.id in ledger._open)
    owner.settle(granted[0], 0.05)
    await owner.flush()
    other = next(ledger for ledger in ledgers if ledger is not owner)
    await other.refresh(key, NOW)
    assert other.remaining(key, NOW) == pytest.approx(0.05)
    assert await other.acquire(key, 0.06, NOW) is None
    assert await other.acquire(key, 0.05, NOW) is not None
    for ledger in ledgers:
        await ledger.link.close()


async def test_a_settlement_written_twice_books_once(server):
    ledger = replica(server)
    key = limited(1.0)
    r = await ledger.acquire(key, 0.5, NOW)
    ledger.settle(r, 0.2)
    write = ledger.outbox[0]
    await ledger.flush()
    ledger.outbox.append(write)  # as if the first write's answer was lost and it went again
    await ledger.flush()
    ledger.settle(r, 0.2)  # and as if the request ended twice
    assert not ledger.outbox
    await ledger.link.close()
    assert await booked(server, key) == (pytest.approx(0.2), 1)


async def test_a_dead_replicas_holds_expire(server):
    dead, alive = replica(server, hold_ttl_s=0.3), replica(server)
    key = limited(1.0)
    assert await dead.acquire(key, 1.0, NOW) is not None  # ...and its replica dies before settling
    assert await alive.acquire(key, 0.5, NOW) is None
    await asyncio.sleep(0.4)
    assert await alive.acquire(key, 1.0, NOW) is not None
    for ledger in (dead, alive):
        await ledger.link.close()


async def test_without_redis_limits_are_refused_or_checked_locally_and_bookings_wait(server):
    key = limited(1.0)
    refusing, local = replica(server, timeout_s=2.0), replica(server, "local", timeout_s=2.0)
    first = await local.acquire(key, 0.3, NOW)
    local.settle(first, 0.3)
    await local.flush()
    await refusing.refresh(key, NOW)
    server.stop()

    with pytest.raises(SpendStoreError):
        await refusing.refresh(key, NOW)
    with pytest.raises(SpendStoreError):
        await refusing.acquire(key, 0.1, NOW)
    assert not refusing.link.reachable
    # A key without a limit needs no check: served, its booking kept for later.
    free = await refusing.acquire(limited(None, "free"), 0.1, NOW)
    refusing.settle(free, 0.1)
    with pytest.raises(SpendStoreError):
        await refusing.flush()
    assert refusing.unwritten == 1

    # "local": the last view (0.3 booked) plus what this replica holds since.
    await local.refresh(key, NOW)
    during = await local.acquire(key, 0.5, NOW)
    assert during is not None and local.remaining(key, NOW) == pytest.approx(0.2)
    assert await local.acquire(key, 0.3, NOW) is None
    local.settle(during, 0.4)
    assert local.remaining(key, NOW) == pytest.approx(0.3)

    server.start()  # back, empty (no persistence in the test server): only what waited arrives
    await local.flush()
    await refusing.flush()
    assert local.link.reachable and not local.outbox
    for ledger in (refusing, local):
        await ledger.link.close()
    assert await booked(server, key) == (pytest.approx(0.4), 1)
    assert await booked(server, limited(None, "free")) == (pytest.approx(0.1), 1)


async def test_a_full_outbox_refuses_keyed_requests(server):
    ledger = RedisSpendLedger(RedisLink(server.url, "test:", 2.0), "local", 60.0, max_unwritten=2)
    server.stop()
    key = limited(None, "free")
    for _ in range(2):
        ledger.settle(await ledger.acquire(key, 0.1, NOW), 0.1)
    with pytest.raises(SpendStoreError, match="2 spend writes wait"):
        await ledger.acquire(key, 0.1, NOW)
    await ledger.link.close()


# ---- the pool view ---------------------------------------------------------------------

async def test_replicas_see_each_others_work_and_cooldowns_until_one_dies(server, tmp_path):
    path = stub_config(tmp_path, [Stub(), Stub()], state={"sync_interval_s": 0.05})
    store = ConfigStore(path)
    from gateway.core.pool_state import PoolState
    pools = [PoolState(), PoolState()]
    syncs = [ReplicaSync(RedisLink(server.url, "test:", 1.0), pool, store) for pool in pools]
    loop = asyncio.get_running_loop()
    a, b = pools
    a.of("stub-0").dispatched("r1", 100, 50.0, loop.time())
    a.of("stub-0").dispatched("r2", 40, 10.0, loop.time())
    b.of("stub-0").dispatched("r3", 7, 3.0, loop.time())
    a.of("stub-1").health.unreachable(None, loop.time(), store.current.health)
    for sync in (*syncs, *syncs):  # both publish, then both read the other
        await sync.sync()
    assert b.of("stub-0").others == Share(2, 140, 60.0)
    assert a.of("stub-0").others == Share(1, 7, 3.0)
    view = b.snapshot(store.current.instances, loop.time(), 120.0)
    assert view.in_flight.tolist() == [3.0, 0.0] and view.pending_decode[0] == pytest.approx(63.0)
    assert not b.routable("stub-1", loop.time()) and b.routable("stub-0", loop.time())

    await asyncio.sleep(1.1)  # a stops publishing: its share lives one second, its cooldown ends
    await syncs[1].sync()
    assert b.of("stub-0").others == Share()
    assert b.routable("stub-1", loop.time())
    for sync in syncs:
        await sync.link.close()


async def test_replicas_share_what_they_sent_where_so_a_conversation_finds_its_instance(server, tmp_path):
    from gateway.core.pool_state import PoolState
    from gateway.core.prefix import block_hashes
    from gateway.state.prefixes import PrefixSync

    path = stub_config(tmp_path, [Stub(), Stub()], state={"sync_interval_s": 0.05})
    store = ConfigStore(path)
    cfg = store.current
    pools = [PoolState(), PoolState()]
    syncs = [PrefixSync(RedisLink(server.url, "test:", 1.0), pool, store) for pool in pools]
    a, b = pools
    history = block_hashes(list(range(640)), 16)
    turn = block_hashes(list(range(640)) + list(range(9000, 9100)), 16)
    a.sent_prompt("stub-1", history, 1000)  # the conversation's first turn went through replica a
    for sync in (*syncs, *syncs):
        await sync.sync()
    view = b.snapshot(cfg.instances, 0.0, 120.0, cfg.scheduler)  # its next turn reaches replica b
    assert view.cached_tokens(turn, 740).tolist() == [0.0, 640.0]
    assert len(a.sent_outbox) == 0 and len(b.sent_outbox) == 0  # b does not send a's prompts back
    # A replica started later reads what the stream still holds: it starts warm.
    late, late_sync = PoolState(), PrefixSync(RedisLink(server.url, "test:", 1.0), PoolState(), store)
    late_sync.pool_state = late
    await late_sync.sync()
    assert late.snapshot(cfg.instances, 0.0, 120.0, cfg.scheduler).cached_tokens(turn, 740).tolist() == [0.0, 640.0]
    # A malformed entry is skipped, not fatal.
    await syncs[0].link.client.xadd(syncs[0].key, {"r": "someone", "p": b"not json"})
    await syncs[1].sync()
    for sync in (*syncs, late_sync):
        await sync.link.close()


# ---- two gateways behind one key ------------------------------------------------------------

PRICE_IN, PRICE_OUT = per_token(0.2), per_token(0.4)  # stub_instance's prices
MESSAGES = [{"role": "user", "content": "Tell me about rivers."}]


def replica_configs(tmp_path, stubs, server, limit, **state):
    keys = [{"name": "team", "sha256": hash_key(KEY), "spend_limit_usd": limit},
            {"name": "free", "sha256": hash_key(FREE)}]
    paths = []
    for n in range(2):
        (tmp_path / f"r{n}").mkdir()
        paths.append(stub_config(tmp_path / f"r{n}", stubs, auth={"keys": keys},
                                 state={"backend": "redis", "url": server.url, "prefix": "test:",
                                        "sync_interval_s": 0.05, "timeout_s": 2.0, **state}))
    return paths


def test_two_gateways_spend_one_limit_and_share_their_in_flight_work(tmp_path, server):
    stubs = [Stub(), Stub()]
    one = predicted_cost(30, 20, PRICE_IN, PRICE_OUT)  # about one answer of 20 tokens
    limit = 10 * one
    first, second = replica_configs(tmp_path, stubs, server, limit)
    a = StubStack(first, stubs)
    b = Stack(second, emulate=False)  # the same stubs, served from a's loop
    try:
        clients = [openai.OpenAI(base_url=s.base_url, api_key=KEY, max_retries=0, timeout=20) for s in (a, b)]

        def ask(n):
            try:
                r = clients[n % 2].chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=20)
                return r.usage.model_extra["cost_usd"]
            except openai.APIStatusError as e:
                return e.status_code, e.code

        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            outcomes = list(pool.map(ask, range(40)))
        costs = [o for o in outcomes if isinstance(o, float)]
        assert {o for o in outcomes if not isinstance(o, float)} == {(402, "spend_limit_exceeded")}
        assert costs and sum(costs) <= limit * (1 + 1e-9)
        wait_for(lambda: asyncio.run(booked(server, limited(limit)))[1] == len(costs), 5, "every booking written")
        assert asyncio.run(booked(server, limited(limit)))[0] == pytest.approx(sum(costs))

        # Slow answers sent through a show up in b's view of the pool (its /metrics).
        for stub in stubs:
            stub.mode["delay_s"] = 1.5
        free = openai.OpenAI(base_url=a.base_url, api_key=FREE, max_retries=0, timeout=20)
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            pending = [pool.submit(free.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=5)
                       for _ in range(4)]

            def b_sees_four():
                page = httpx.get(b.root + "/metrics", timeout=2).text
                lines = [ln for ln in page.splitlines() if ln.startswith("routebalance_instance_in_flight{")]
                return sum(float(ln.rsplit(" ", 1)[1]) for ln in lines) == 4

            wait_for(b_sees_four, 5, "b counting a's four requests")
            assert all(f.result().choices for f in pending)
    finally:
        b.stop()
        a.stop()


def test_a_gateway_that_loses_redis_says_so_and_refuses_limited_keys(tmp_path, server):
    stubs = [Stub(), Stub()]
    [path, _] = replica_configs(tmp_path, stubs, server, 1.0)
    stack = StubStack(path, stubs)
    try:
        c = openai.OpenAI(base_url=stack.base_url, api_key=KEY, max_retries=0, timeout=20)
        assert c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5).choices
        ready = httpx.get(stack.root + "/health/ready", timeout=5).json()
        assert ready["state"]["backend"] == "redis" and ready["state"]["reachable"]
        server.stop()
        with pytest.raises(openai.APIStatusError) as e:
            c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5)
        assert e.value.status_code == 503 and e.value.code == "ledger_unavailable"
        r = httpx.get(stack.root + "/health/ready", timeout=5)
        assert r.status_code == 200 and r.json()["state"]["reachable"] is False
        assert "refused" in r.json()["state"]["spend_limits"]
        assert "routebalance_state_backend_up 0.0" in httpx.get(stack.root + "/metrics", timeout=5).text
        server.start()
        wait_for(lambda: httpx.get(stack.root + "/health/ready", timeout=5).json()["state"]["reachable"], 5,
                 "redis reachable again")
        assert c.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5).choices
    finally:
        stack.stop()


def test_shutdown_takes_its_bound_with_a_request_in_flight_and_redis_gone(tmp_path, server):
    """[server].shutdown_timeout_s bounds what requests in flight get at shutdown; closing a link to a Redis
    that is gone adds a bounded moment, not aiohttp's 60 s graceful default."""
    stubs = [Stub(), Stub()]
    [path, _] = replica_configs(tmp_path, stubs, server, 1.0)
    path.write_text(path.read_text().replace("[server]\n", "[server]\nshutdown_timeout_s = 1.0\n", 1))
    stack = StubStack(path, stubs)
    for stub in stubs:
        stub.mode["delay_s"] = 8.0  # an answer that would outlast the bound
    c = openai.OpenAI(base_url=stack.base_url, api_key=FREE, max_retries=0, timeout=60)
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(c.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=5)
            wait_for(lambda: sum(len(stub.requests) for stub in stubs) == 1, 10, "the request at its instance")
            server.stop()
            started = time.monotonic()
            async def gateway_stops():  # the gateway alone, not the stubs
                for runner in stack.runners:
                    await runner.cleanup()

            stack.call(gateway_stops())
            took = time.monotonic() - started
            stack.runners = []
            with pytest.raises(openai.APIConnectionError):  # cut off at the bound, before its answer came
                pending.result(10)
        # The 1 s bound, then the spend's last write and the link's close: Redis refuses at once here, so each
        # takes a moment (gateway/serving/app.py bounds them at 2.5 s and 2 s when it does not answer at all).
        assert took < 1.0 + 2.0 + 2.0, took
    finally:
        stack.stop()  # the stubs (their slow handlers end first)
        server.start()


def test_the_state_backend_is_checked_in_the_config(tmp_path):
    path = stub_config(tmp_path, [Stub()], state={"backend": "redis", "on_unavailable": "maybe"})
    with pytest.raises(Exception, match="on_unavailable"):
        ConfigStore(path)


async def test_keys_list_reads_the_spend_from_redis(server, tmp_path, capsys):
    from gateway.cli import main

    path = stub_config(tmp_path, [Stub()], auth={"keys": [{"name": "team", "sha256": hash_key(KEY),
                                                           "spend_limit_usd": 2.0}]},
                       state={"backend": "redis", "url": server.url, "prefix": "test:"})
    ledger = replica(server)
    key = ConfigStore(path).current.auth.keys[0]
    ledger.settle(await ledger.acquire(key, 1.0, time.time()), 0.75)
    await ledger.flush()
    await ledger.link.close()
    assert await asyncio.to_thread(main, ["keys", "list", "--config", str(path)]) == 0
    row = next(line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("team"))
    assert row[1:] == ["2.000000", "total", "0.750000", "1", "1.250000", "-"]
    server.stop()
    assert await asyncio.to_thread(main, ["keys", "list", "--config", str(path)]) == 1
    assert "redis at" in capsys.readouterr().err


async def test_flushes_at_once_write_each_booking_once(server):
    ledger = replica(server)
    key = limited(None, "free")
    for _ in range(20):
        ledger.settle(await ledger.acquire(key, 0.1, NOW), 0.01)
    await asyncio.gather(ledger.flush(), ledger.flush(), ledger.flush())  # the writer task and a shutdown, say
    assert not ledger.outbox
    await ledger.link.close()
    assert await booked(server, key) == (pytest.approx(0.2), 20)


async def test_a_burst_wider_than_the_connection_pool_waits_for_connections(server):
    ledger = replica(server, timeout_s=2.0)
    held = await asyncio.gather(*(ledger.acquire(limited(1000.0), 0.1, NOW) for _ in range(300)))
    assert all(r is not None for r in held)  # none failed for want of one of the 64 connections
    await ledger.link.close()


async def test_without_redis_a_replica_keeps_its_last_read_for_a_while_then_its_own_view(server, tmp_path,
                                                                                        monkeypatch):
    from gateway.core.pool_state import PoolState
    from gateway.state import sync as sync_module

    monkeypatch.setattr(sync_module, "KEEP_LAST_READ_S", 0.3)
    store = ConfigStore(stub_config(tmp_path, [Stub()]))
    a, b = PoolState(), PoolState()
    syncs = [ReplicaSync(RedisLink(server.url, "test:", 2.0), ledger, store) for ledger in (a, b)]
    a.of("stub-0").dispatched("r1", 10, 5.0, asyncio.get_running_loop().time())
    for sync in syncs:
        await sync.sync()
    await syncs[1].sync()
    assert b.of("stub-0").others == Share(1, 10, 5.0)
    server.stop()
    await syncs[1].sync()
    assert b.of("stub-0").others == Share(1, 10, 5.0) and not syncs[1].link.reachable
    await asyncio.sleep(0.35)
    await syncs[1].sync()
    assert b.of("stub-0").others == Share()
    for sync in syncs:
        await sync.link.close()


async def test_a_hold_whose_request_left_while_it_was_taken_is_freed(server):
    ledger = replica(server)
    key = limited(1.0)
    taking = asyncio.ensure_future(ledger.acquire(key, 1.0, NOW))
    await asyncio.sleep(0)  # the script is on its way
    taking.cancel()
    with pytest.raises(asyncio.CancelledError):
        await taking
    await asyncio.sleep(0.2)  # the script's answer arrives: its hold is released, not left for an hour
    await ledger.flush()
    other = replica(server)
    assert await other.acquire(key, 1.0, NOW) is not None
    for led in (ledger, other):
        await led.link.close()
