"""Automatic prefix caching in the engine model, and the gateway's index of what each instance holds."""

from __future__ import annotations

import sys
import tracemalloc
from dataclasses import replace

import pytest

import gateway.core.prefix as prefix_module
from gateway.core.engine.engine import Engine, EngineSpec
from gateway.core.prefix import BYTES_PER_BLOCK, PrefixIndex, block_hashes, cacheable_blocks, chain_root

SPEC = EngineSpec(tpot_s=0.02, batch_slope=0.02, kv_read_per_token=0.0, prefill_s_per_token=1e-4, max_num_seqs=8,
                  max_num_batched_tokens=4096, max_model_len=4096, block_size=16, num_gpu_blocks=400)


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def serve(engine: Engine, rid, toks: list[int], now: float, out: int = 4):
    seq = engine.add(rid, prompt_tokens=len(toks), max_tokens=64, output_tokens=out, now=now,
                     prefix=block_hashes(toks, engine.spec.block_size))
    engine.advance(now + 100)
    assert seq.finished
    return seq


def test_hashes_chain_over_everything_before_a_block():
    a = block_hashes(tokens(0, 40), 16)
    assert len(a) == 2  # the partial third block is not cached
    b = block_hashes(tokens(0, 32) + [999] * 16, 16)
    assert a == b[:2] and b[2] not in a
    # Equal block contents after different prefixes are different blocks.
    c = block_hashes([7] * 16 + tokens(100, 16), 16)
    d = block_hashes([8] * 16 + tokens(100, 16), 16)
    assert c[1] != d[1]
    # A salt gives a chain of its own.
    assert block_hashes(tokens(0, 32), 16, salt="tenant-a") != a[:2]
    assert chain_root("x") == chain_root("x") != chain_root("y")


def test_a_repeated_prompt_reuses_its_blocks_but_computes_its_last_token():
    engine = Engine(SPEC)
    prompt = tokens(0, 160)  # exactly 10 blocks
    first = serve(engine, "a", prompt, 0.0)
    assert first.cached_tokens == 0
    second = serve(engine, "b", prompt, 200.0)
    assert second.cached_tokens == 9 * 16 == cacheable_blocks(160, 16) * 16  # the last block holds the last token
    assert engine.cache.queries == 320 and engine.cache.hits == 144
    # The shorter prefill shows in the time to the first token.
    assert (second.first_token_time - second.arrival) < (first.first_token_time - first.arrival)


def test_a_shared_prefix_hits_only_its_full_blocks():
    engine = Engine(SPEC)
    serve(engine, "a", tokens(0, 100) + tokens(5000, 60), 0.0)  # 100 shared tokens: 6 full blocks and 4 tokens
    seq = serve(engine, "b", tokens(0, 100) + tokens(9000, 60), 200.0)
    assert seq.cached_tokens == 6 * 16


def test_off_caches_nothing():
    engine = Engine(replace(SPEC, prefix_caching=False))
    serve(engine, "a", tokens(0, 160), 0.0)
    assert serve(engine, "b", tokens(0, 160), 200.0).cached_tokens is None
    assert engine.cache is None


def test_cached_blocks_nobody_holds_are_free_and_evicted_least_recently_used():
    spec = replace(SPEC, num_gpu_blocks=42)
    engine = Engine(spec)
    serve(engine, "a", tokens(0, 320), 0.0)  # 20 blocks, cached after it ends
    assert engine.kv_usage() == 0.0  # nothing runs: the cached blocks are free
    assert len(engine.cache.free) == 20
    serve(engine, "b", tokens(10_000, 320), 200.0)  # 20 more (21 while it runs): nothing evicted yet
    assert len(engine.cache.free) == 40
    serve(engine, "c", tokens(20_000, 160), 400.0)  # needs 11 with its answer: 9 of a's go
    a_blocks = block_hashes(tokens(0, 320), 16)
    assert a_blocks[-1] not in engine.cache and a_blocks[0] in engine.cache  # a chain loses its tail first
    assert serve(engine, "a2", tokens(0, 320), 600.0).cached_tokens < 19 * 16
    assert all(h in engine.cache for h in block_hashes(tokens(10_000, 320), 16)[:5])


def test_running_requests_share_cached_blocks_once():
    engine = Engine(SPEC)
    system = tokens(0, 320)
    serve(engine, "warm", system + tokens(50_000, 8), 0.0)
    seqs = [engine.add(k, prompt_tokens=328, max_tokens=500, output_tokens=500, now=200.0,
                       prefix=block_hashes(system + tokens(60_000 + 100 * k, 8), 16)) for k in range(4)]
    engine.advance(201.0)
    assert all(s.cached_tokens == 320 for s in seqs)
    shared, own = 20, sum(-(-s.computed // 16) - len(s.held) for s in seqs)
    assert engine.blocks_used() == shared + own
    assert engine.kv_usage() == pytest.approx((shared + own) / SPEC.num_gpu_blocks)


def test_preemption_under_pressure_keeps_the_cache_consistent():
    spec = replace(SPEC, num_gpu_blocks=60, max_num_seqs=8)
    engine = Engine(spec)
    for k in range(8):
        engine.add(k, prompt_tokens=200, max_tokens=400, output_tokens=400, now=0.0,
                   prefix=block_hashes(tokens(0, 100) + tokens(1000 * (k + 1), 100), 16))
    report = engine.advance(1e4)
    assert len(report.finished) == 8 and report.preemptions > 0
    assert engine.cache.referenced == 0 and engine.blocks_used() == 0
    assert len(engine.cache.free) <= spec.num_gpu_blocks


def test_events_record_what_enters_and_leaves():
    engine = Engine(replace(SPEC, num_gpu_blocks=30), record_events=True)
    serve(engine, "a", tokens(0, 320), 0.0)
    stored, removed = engine.take_cache_events()
    assert stored == list(block_hashes(tokens(0, 320), 16)) and removed == []
    serve(engine, "b", tokens(5000, 320), 200.0)
    stored, removed = engine.take_cache_events()
    assert len(stored) == 20 and len(removed) >= 10
    assert engine.take_cache_events() == ([], [])


def test_the_index_matches_leading_blocks_and_stays_within_its_bound():
    index = PrefixIndex(capacity=10)
    a = block_hashes(tokens(0, 16 * 6), 16)
    index.record(a)
    assert index.match(a) == 6
    assert index.match(block_hashes(tokens(0, 16 * 3) + [1] * 48, 16)) == 3
    b = block_hashes(tokens(9000, 16 * 6), 16)
    evicted = index.record(b)
    assert len(index) == 10 and len(evicted) == 2
    assert index.match(a) == 4  # a's tail went first
    index.remove(a[:1])
    assert index.match(a) == 0
    index.resize(3)
    assert len(index) == 3 and index.match(b) == 3


def test_the_index_memory_bound_is_what_it_states():
    n = 50_000
    hashes = block_hashes(tokens(0, 16 * n), 16)
    # Only what prefix.py's own lines allocate counts: threads left running by earlier tests in the same process
    # allocate meanwhile, and once made this read 10% high in the full suite.
    tracemalloc.start()
    index = PrefixIndex(capacity=n)
    index.record(hashes)
    snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(True, prefix_module.__file__)])
    tracemalloc.stop()
    per_block = sum(stat.size for stat in snapshot.statistics("filename")) / n
    assert len(index) == n
    assert per_block <= BYTES_PER_BLOCK * 1.05, f"{per_block:.0f} bytes a block (stated {BYTES_PER_BLOCK})"
    assert sys.getsizeof(index) < 100


def test_reported_blocks_rehash_vllm_events_into_the_gateways_chain():
    from gateway.core.prefix import ReportedBlocks

    reported = ReportedBlocks(capacity=100, block_size=16)
    toks = tokens(0, 64)
    ours = block_hashes(toks, 16)
    # vLLM's own hashes are opaque numbers; the first event's parent is None (a chain's first block).
    reported.stored([901, 902], None, toks[:32], 16)
    reported.stored([903, 904], 902, toks[32:64], 16)
    assert reported.index.match(ours) == 4  # the request's own hashes find the reported blocks
    reported.removed([904])
    assert reported.index.match(ours) == 3
    reported.stored([999], 555, tokens(7, 16), 16)  # a parent it never heard of: left out
    reported.stored([998], None, tokens(7, 32), 32)  # another block size: left out
    assert reported.unchained == 2 and len(reported.index) == 3
    reported.resize(2)  # the least recently stored goes: the first event's second block
    assert len(reported.index) == 2 and reported.index.match(ours) == 1
    assert len(reported._ours) == 2  # the map forgets what the index let go
    reported.removed([902])  # already gone with the resize: nothing breaks
    reported.cleared()
    assert len(reported.index) == 0 and reported.index.match(ours) == 0
