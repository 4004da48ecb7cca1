"""API keys, anonymous access, the spend ledger and its stores, the per-key rate limiter."""

from __future__ import annotations

import asyncio
import calendar
import dataclasses
import math
import random
import sqlite3
import time

import pytest

from gateway.config.sections import ApiKey, AuthConfig
from gateway.config.store import default_config_path, load_config
from gateway.tenancy.keys import (
    KeyRing,
    anonymous_allowed,
    bearer_token,
    exposure_problem,
    hash_key,
    is_loopback,
    new_key,
)
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.spend.sqlite import (
    MemorySpendStore,
    SpendLedger,
    SpendStoreError,
    SqliteSpendStore,
    period_start,
)


def utc(*fields: int) -> float:
    """Epoch seconds of a UTC date and time."""
    return float(calendar.timegm((*fields, *(0,) * (6 - len(fields)))))


def api_key(name: str = "team-a", key: str | None = None, **options) -> ApiKey:
    return ApiKey(name=name, sha256=hash_key(key or new_key()), **options)


# --------------------------------------------------------------------------
# Keys and anonymous access


def test_a_key_is_found_by_its_hash_and_nothing_else_is():
    alice, bob = new_key(), new_key()
    ring = KeyRing(AuthConfig(keys=(api_key("alice", alice), api_key("bob", bob))))
    assert ring.lookup(alice).name == "alice"
    assert ring.lookup(bob).name == "bob"
    assert ring.lookup(alice + "x") is None
    assert ring.lookup(alice[:-1]) is None
    assert ring.lookup(hash_key(alice)) is None  # the stored hash is not a key
    assert ring.lookup("") is None
    assert ring and not KeyRing(AuthConfig())


def test_new_keys_are_distinct_and_hash_to_the_configured_form():
    keys = {new_key() for _ in range(100)}
    assert len(keys) == 100
    assert all(k.startswith("rb-") and len(k) > 40 for k in keys)
    assert hash_key("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"


@pytest.mark.parametrize("header, token", [
    ("Bearer abc", "abc"),
    ("bearer abc", "abc"),
    ("  BEARER \t abc  ", "abc"),
    (None, None),
    ("", None),
    ("Bearer", None),
    ("Bearer ", None),
    ("Basic YWxhZGRpbjpvcGVu", None),
    ("Bearer a b", None),
    ("abc", None),
    ("Bearerabc", None),
])
def test_bearer_token(header, token):
    assert bearer_token(header) == token


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("localhost", True), ("LOCALHOST", True),
    ("::ffff:127.0.0.1", True),
    ("0.0.0.0", False), ("::", False), ("10.0.0.5", False), ("192.168.1.2", False), ("fe80::1", False),
    ("example.com", False), ("localhost.example.com", False), ("", False),
])
def test_is_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_anonymous_requests_only_on_loopback_without_keys_unless_allowed():
    with_keys = AuthConfig(keys=(api_key(),))
    assert anonymous_allowed(AuthConfig(), "127.0.0.1")
    assert not anonymous_allowed(AuthConfig(), "0.0.0.0")
    assert not anonymous_allowed(with_keys, "127.0.0.1")  # keys configured: a key is needed, even locally
    assert not anonymous_allowed(with_keys, "0.0.0.0")
    assert anonymous_allowed(AuthConfig(allow_anonymous=True), "0.0.0.0")
    assert anonymous_allowed(AuthConfig(allow_anonymous=True, keys=with_keys.keys), "0.0.0.0")


def test_exposure_problem_refuses_an_open_gateway_beyond_loopback():
    cfg = load_config(default_config_path())
    assert not cfg.auth.keys and not cfg.auth.allow_anonymous
    problem = exposure_problem(cfg, "0.0.0.0")
    assert problem and "routebalance keys add" in problem and "allow_anonymous = true" in problem
    assert exposure_problem(cfg, "::") is not None
    assert exposure_problem(cfg, "127.0.0.1") is None
    assert exposure_problem(dataclasses.replace(cfg, auth=AuthConfig(keys=(api_key(),))), "0.0.0.0") is None
    assert exposure_problem(dataclasses.replace(cfg, auth=AuthConfig(allow_anonymous=True)), "0.0.0.0") is None


# --------------------------------------------------------------------------
# Periods


@pytest.fixture
def far_from_utc(monkeypatch):
    """A local time zone 14 hours ahead of UTC: periods computed in local time would be off by a day."""
    monkeypatch.setenv("TZ", "Pacific/Kiritimati")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_periods_roll_over_at_utc_midnight_and_month_start(far_from_utc):
    last_second = utc(2026, 11, 30, 23, 59, 59)
    assert period_start("day", last_second) == "2026-11-30"
    assert period_start("month", last_second) == "2026-11-01"
    assert period_start("day", last_second + 1) == "2026-12-01"
    assert period_start("month", last_second + 1) == "2026-12-01"
    assert period_start("month", utc(2026, 12, 31, 23, 59, 59)) == "2026-12-01"
    assert period_start("month", utc(2027, 1, 1)) == "2027-01-01"
    assert period_start("day", utc(2028, 2, 29, 12)) == "2028-02-29"
    assert period_start("total", utc(2026, 11, 23)) == period_start("total", utc(2031, 1, 1)) == "total"


def test_periods_reject_bad_input():
    with pytest.raises(ValueError):
        period_start("day", math.nan)
    with pytest.raises(ValueError):
        period_start("month", math.inf)
    with pytest.raises(ValueError):
        period_start("week", utc(2026, 11, 23))


# --------------------------------------------------------------------------
# The ledger, on both stores


@pytest.fixture(params=["memory", "sqlite"])
def ledger(request, tmp_path):
    store = MemorySpendStore() if request.param == "memory" else SqliteSpendStore(tmp_path / "state.db")
    yield SpendLedger(store)
    store.close()


NOV_23 = utc(2026, 11, 23, 12)


def test_reservations_hold_spend_until_settled_at_the_real_cost(ledger):
    key = api_key(spend_limit_usd=1.0)
    first = ledger.reserve(key, 0.6, NOV_23)
    assert first is not None
    assert ledger.remaining(key, NOV_23) == pytest.approx(0.4)
    assert ledger.reserve(key, 0.5, NOV_23) is None  # 0.6 held + 0.5 > 1.0
    second = ledger.reserve(key, 0.4, NOV_23)
    assert second is not None and ledger.remaining(key, NOV_23) == 0.0
    ledger.settle(first, 0.1)  # cheaper than its worst case: the rest is free again
    assert ledger.spent(key.name, "total") == pytest.approx(0.1)
    assert ledger.remaining(key, NOV_23) == pytest.approx(0.5)
    ledger.settle(second, 0.95)  # dearer than reserved: the real cost is booked
    assert ledger.booked(key.name, "total") == (pytest.approx(1.05), 2)
    assert ledger.remaining(key, NOV_23) == 0.0  # floored, never negative
    assert ledger.reserve(key, 0.0, NOV_23) is None  # over its limit: not even a free request


def test_a_key_at_its_limit_still_gets_free_requests(ledger):
    key = api_key(spend_limit_usd=0.5)
    ledger.settle(ledger.reserve(key, 0.5, NOV_23), 0.5)
    assert ledger.remaining(key, NOV_23) == 0.0
    assert ledger.reserve(key, 1e-9, NOV_23) is None
    assert ledger.reserve(key, 0.0, NOV_23) is not None


def test_settling_twice_or_after_release_books_nothing_more(ledger):
    key = api_key(spend_limit_usd=10.0)
    r = ledger.reserve(key, 1.0, NOV_23)
    ledger.settle(r, 0.5)
    ledger.settle(r, 0.5)
    ledger.release(r)
    assert ledger.booked(key.name, "total") == (0.5, 1)
    refused = ledger.reserve(key, 2.0, NOV_23)
    ledger.release(refused)  # refused before dispatch: no cost, no request
    ledger.settle(refused, 2.0)
    ledger.release(refused)
    assert ledger.booked(key.name, "total") == (0.5, 1)
    assert ledger.remaining(key, NOV_23) == pytest.approx(9.5)


def test_a_key_without_a_limit_always_gets_a_reservation(ledger):
    key = api_key()
    assert ledger.remaining(key, NOV_23) is None
    r = ledger.reserve(key, 1e9, NOV_23)
    assert r is not None
    ledger.settle(r, 123.0)
    assert ledger.spent(key.name, "total") == 123.0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.01, "1.0", None])
def test_amounts_must_be_finite_and_not_negative(ledger, bad):
    key = api_key(spend_limit_usd=5.0)
    with pytest.raises(ValueError):
        ledger.reserve(key, bad, NOV_23)
    r = ledger.reserve(key, 1.0, NOV_23)
    with pytest.raises(ValueError):
        ledger.settle(r, bad)
    ledger.settle(r, 0.25)  # the refused settle left the reservation open
    assert ledger.booked(key.name, "total") == (0.25, 1)


def test_a_monthly_limit_resets_next_month_and_late_settlements_book_to_their_month(ledger, far_from_utc):
    key = api_key(spend_limit_usd=1.0, period="month")
    end_of_november = utc(2026, 11, 30, 23, 59, 59)
    spent_all = ledger.reserve(key, 0.7, end_of_november)
    in_flight = ledger.reserve(key, 0.3, end_of_november)
    ledger.settle(spent_all, 0.7)
    assert ledger.reserve(key, 0.01, end_of_november) is None
    december = end_of_november + 1
    assert ledger.remaining(key, december) == 1.0  # November's reservation does not hold December's money
    ledger.settle(in_flight, 0.3)  # finished after midnight: still November's spend
    assert ledger.booked(key.name, "2026-11-01") == (pytest.approx(1.0), 2)
    assert ledger.booked(key.name, "2026-12-01") == (0.0, 0)
    assert ledger.reserve(key, 1.0, december) is not None


def test_a_daily_limit_resets_at_utc_midnight(ledger, far_from_utc):
    key = api_key(spend_limit_usd=2.0, period="day")
    ledger.settle(ledger.reserve(key, 2.0, utc(2026, 11, 23, 0, 0, 0)), 2.0)
    assert ledger.reserve(key, 0.5, utc(2026, 11, 23, 23, 59, 59)) is None
    assert ledger.remaining(key, utc(2026, 11, 24)) == 2.0


async def test_concurrent_requests_never_overspend_a_key(ledger):
    """Many requests in flight at once reserve, wait for their answers, then settle at most what they reserved."""
    limit = 1.0
    key = api_key(spend_limit_usd=limit, period="day")
    rng = random.Random(7)
    granted: list[float] = []
    held_most = 0.0

    async def request(worst_case: float) -> None:
        nonlocal held_most
        reservation = ledger.reserve(key, worst_case, NOV_23)
        if reservation is None:
            return
        granted.append(worst_case)
        held_most = max(held_most, limit - ledger.remaining(key, NOV_23))
        await asyncio.sleep(rng.random() / 1000)
        if rng.random() < 0.1:
            ledger.release(reservation)  # e.g. refused by the scheduler before dispatch
        else:
            ledger.settle(reservation, worst_case * rng.random())

    await asyncio.gather(*(request(rng.uniform(0.001, 0.05)) for _ in range(1000)))
    booked = ledger.booked(key.name, period_start("day", NOV_23))
    assert 0 < booked.requests < len(granted) < 1000  # some were refused, some released
    assert booked.usd <= limit
    assert held_most <= limit
    assert ledger.remaining(key, NOV_23) == pytest.approx(limit - booked.usd)


def test_interleaved_reserve_settle_release_keep_held_plus_spent_within_the_limit(ledger):
    limit = 3.0
    key = api_key(spend_limit_usd=limit)
    rng = random.Random(11)
    open_reservations = []
    for _ in range(3000):
        action = rng.random()
        if action < 0.5 or not open_reservations:
            r = ledger.reserve(key, rng.uniform(0, 0.2), NOV_23)
            if r is not None:
                open_reservations.append(r)
        else:
            r = open_reservations.pop(rng.randrange(len(open_reservations)))
            if action < 0.9:
                ledger.settle(r, r.amount_usd * rng.random())
            else:
                ledger.release(r)
        held = sum(r.amount_usd for r in open_reservations)
        spent = ledger.spent(key.name, "total")
        assert spent + held <= limit + 1e-9
        assert ledger.remaining(key, NOV_23) == pytest.approx(max(0.0, limit - spent - held), abs=1e-9)


# --------------------------------------------------------------------------
# The SQLite store


def test_spend_survives_a_restart(tmp_path):
    path = tmp_path / "nested" / "dir" / "state.db"  # parent directories are made
    key = api_key(spend_limit_usd=1.0, period="month")
    store = SqliteSpendStore(path)
    ledger = SpendLedger(store)
    ledger.settle(ledger.reserve(key, 0.5, NOV_23), 0.4)
    ledger.settle(ledger.reserve(key, 0.5, NOV_23), 0.35)
    store.close()

    restarted = SpendLedger(SqliteSpendStore(path))
    assert restarted.booked(key.name, "2026-11-01") == (pytest.approx(0.75), 2)
    assert restarted.remaining(key, NOV_23) == pytest.approx(0.25)
    assert restarted.reserve(key, 0.3, NOV_23) is None
    assert restarted.remaining(key, utc(2026, 12, 1)) == 1.0
    restarted.store.close()


def test_a_corrupt_database_raises_spend_store_error(tmp_path):
    path = tmp_path / "state.db"
    path.write_bytes(b"this is not a SQLite database, just some bytes\n" * 100)
    with pytest.raises(SpendStoreError, match="state.db"):
        SqliteSpendStore(path)


def test_an_unusable_path_raises_spend_store_error(tmp_path):
    (tmp_path / "a-file").write_text("")
    with pytest.raises(SpendStoreError, match="a-file"):
        SqliteSpendStore(tmp_path / "a-file" / "state.db")  # its parent is a file
    (tmp_path / "a-dir.db").mkdir()
    with pytest.raises(SpendStoreError):
        SqliteSpendStore(tmp_path / "a-dir.db")


def test_a_refused_write_keeps_the_spend_in_memory_and_books_it_once_later(tmp_path):
    path = tmp_path / "state.db"
    key = api_key(spend_limit_usd=1.0)
    store = SqliteSpendStore(path)
    ledger = SpendLedger(store)
    ledger.settle(ledger.reserve(key, 0.2, NOV_23), 0.2)

    other_writer = sqlite3.connect(path, isolation_level=None)
    other_writer.execute("BEGIN IMMEDIATE")  # holds the write lock
    reservation = ledger.reserve(key, 0.5, NOV_23)  # reading still works in WAL mode
    started = time.monotonic()
    with pytest.raises(SpendStoreError, match="locked"):
        ledger.settle(reservation, 0.5)
    assert time.monotonic() - started < 2  # the event loop is not held for long
    assert ledger.booked(key.name, "total") == (pytest.approx(0.7), 2)  # still counts against the key
    assert ledger.reserve(key, 0.4, NOV_23) is None
    ledger.settle(reservation, 0.5)  # the settlement itself happened: not booked again
    other_writer.execute("ROLLBACK")
    other_writer.close()

    ledger.flush()
    ledger.flush()
    assert store.booked(key.name, "total") == (pytest.approx(0.7), 2)
    store.close()
    assert SqliteSpendStore(path).booked(key.name, "total") == (pytest.approx(0.7), 2)


# --------------------------------------------------------------------------
# Requests per minute


def test_rate_limit_slides_over_the_last_minute():
    limiter = RateLimiter()
    assert [limiter.allow("a", 3, t) for t in (0.0, 10.0, 20.0)] == [None, None, None]
    assert limiter.allow("a", 3, 30.0) == pytest.approx(30.0)  # the request at 0 leaves the window at 60
    assert limiter.allow("b", 3, 30.0) is None  # per key
    assert limiter.allow("a", 3, 60.0) is None
    assert limiter.allow("a", 3, 61.0) == pytest.approx(9.0)
    assert limiter.allow("a", 3, 70.0) is None


def test_rate_limit_memory_is_bounded_and_follows_reloads():
    limiter = RateLimiter()
    allowed = sum(limiter.allow("a", 100, i / 10_000) is None for i in range(100_000))  # 10 s of requests
    assert allowed == 100
    assert len(limiter._recent["a"]) == 100
    assert limiter.allow("a", 10, 100.0) is None  # the window has passed; a new, lower limit
    assert len(limiter._recent["a"]) <= 10
    for t in range(9):
        limiter.allow("a", 10, 100.0 + t)
    assert limiter.allow("a", 10, 110.0) is not None
    limiter.allow("b", 5, 0.0)
    limiter.retain(["a"])
    assert set(limiter._recent) == {"a"}
    with pytest.raises(ValueError):
        limiter.allow("a", 0, 200.0)
