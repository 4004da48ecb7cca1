"""Workloads whose prompts share prefixes, as segments (DESIGN.md, "Prefix caches").

A prompt is a list of segments, (segment id, tokens): segment s with n tokens stands for the tokens
s * SEGMENT_SPAN + 0 .. n-1, so equal ids give equal tokens, a shorter run of a segment is a prefix of a
longer one, and two prompts share a prefix exactly when they share leading segments. The simulator builds
token streams and block hashes from them (segment_tokens, row_tokens); live replay sends segment_text.

Two sources:

- read_mooncake: Mooncake's conversation trace (../shared/data/prefix-traces/), one segment per
  512-token block id, prompt lengths and the block size scaled by one factor to fit the pool's windows.
  Every line of the file lists exactly ceil(input_length / 512) ids (checked on all 12,031), so no id is
  ever dropped; a line with too few ids is an error.
- synthetic_prefixed: seeded sessions of five kinds, DEFAULT_MIX giving each kind's share of rows
  (conversation 0.4, agent 0.15, system 0.15, document 0.15, single 0.15):
    conversation  a chat: one of 4 system prompts (100-400 tokens), then 2-8 turns; turn k's prompt is the
                  system prompt, every earlier user message and answer, and a new user message (user
                  messages median 60 tokens within 20-150, answers median 180 within 100-300). The next
                  turn comes after the answer (0.03 s a token) and an exponential think time of mean 15 s.
    agent         one shared tool-description system prompt (500-700 tokens), a task (30-200), then 3-10
                  steps, each appending a tool call (30-80) and its result (100-600); 1-3 s between steps
                  after the call's own generation time.
    system        one of 3 long system prompts (800-2,000 tokens, equally popular), a unique user message.
    document      a shared instruction (40-100 tokens), one of 10 documents (1,500-4,000 tokens, popularity
                  1/rank), a unique question (median 30 within 8-120).
    single        a unique prompt, lengths as the labelled synthetic workload's (lognormal, median 55,
                  mean about 85, at most 999).
  Sessions start as one Poisson process of 1 session a second, in unit time: the simulator rescales time to
  its target rate, so only the relative structure matters. The rows are the first n by arrival of that
  endless process (sessions are generated until the next start is later than the n-th earliest row), so a
  conversation may be cut after any turn, and synthetic_prefixed(n, s) is the first n rows of
  synthetic_prefixed(m, s) for m > n. A multi-turn session ends early when its next prompt would not leave
  ANSWER_ROOM tokens in the window (never at 8,192; in smaller windows the multi-turn kinds' shares of rows fall,
  and system and document prompts that do not fit are cut and counted in `truncated`).

Synthetic segment ids start at SYNTHETIC_BASE (1 << 30), far above the trace's ids (at most 182,789).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

SEGMENT_SPAN = 1 << 20  # a segment holds at most this many tokens
SYNTHETIC_BASE = 1 << 30
MOONCAKE_TRACE = (Path(__file__).resolve().parents[4] / "shared" / "data" / "prefix-traces"
                  / "mooncake_conversation_trace.jsonl")
TRACE_BLOCK = 512  # tokens per hash id in the Mooncake trace
ANSWER_ROOM = 1024  # synthetic prompts leave room for an answer this long (the labels' cap)
TOKEN_S = 0.03  # seconds to generate one answer token, for the time until a session's next turn
KINDS = ("conversation", "agent", "system", "document", "single")
DEFAULT_MIX = {"conversation": 0.4, "agent": 0.15, "system": 0.15, "document": 0.15, "single": 0.15}
# Rows per session on average (turns 2-8, steps 3-10): a session's kind is drawn with probability share / this,
# so that the mix holds for rows, not sessions.
_ROWS_PER_SESSION = {"conversation": 5.0, "agent": 6.5, "system": 1.0, "document": 1.0, "single": 1.0}
# (median, sigma, least, most) of lognormal lengths in tokens.
_LENGTHS = {
    "message": (55, 0.93, 4, 999),  # mean about 85, p90 about 180, p99 about 460, as in synthetic.py
    "user": (60, 0.5, 20, 150),
    "answer": (180, 0.35, 100, 300),
    "question": (30, 0.5, 8, 120),
    "task": (80, 0.5, 30, 200),
    "call": (50, 0.3, 30, 80),
    "result": (250, 0.6, 100, 600),
}
_POOL_IDS = 1024  # ids SYNTHETIC_BASE + [0, 1024) name the shared prompts; each session has its own range after
_SESSION_IDS = 32  # ids per session: a conversation draws at most 2 * 8, an agent run 1 + 2 * 9


@dataclass(frozen=True, slots=True)
class PrefixedRow:
    arrival_s: float  # seconds from the start of the workload
    segments: tuple[tuple[int, int], ...]  # (segment id, tokens), in prompt order; equal ids = equal tokens
    output_tokens: int | None  # answer length when the source gives it (the trace), else None
    session: str  # the conversation / agent run / document reader it belongs to
    kind: str  # "conversation" | "system" | "document" | "agent" | "single" | "trace"

    @property
    def prompt_tokens(self) -> int:
        return sum(n for _, n in self.segments)


@dataclass(frozen=True)
class PrefixedWorkload:
    rows: tuple[PrefixedRow, ...]  # sorted by arrival_s (stable)
    truncated: int  # rows whose prompt was cut to fit the window
    source: str  # "mooncake:<file name>" or "synthetic:<mix>:seed=<s>"


def segment_tokens(segment_id: int, tokens: int) -> np.ndarray:
    return segment_id * SEGMENT_SPAN + np.arange(tokens, dtype=np.int64)


def row_tokens(row: PrefixedRow) -> np.ndarray:
    return np.concatenate([segment_tokens(s, n) for s, n in row.segments])


def ceiling_hit_rate(rows: Iterable[PrefixedRow], block_size: int) -> float:
    """Share of all prompt tokens that lie in full blocks (of block_size tokens, chained: a block is equal to an
    earlier one only if it and every block before it in its prompt are equal) which appeared in an earlier row:
    what one unbounded prefix cache serving everything would hit.

    Block k of a row appeared before exactly when an earlier row shares its first (k + 1) * block_size tokens,
    so a row hits its longest common prefix with any earlier row, rounded down to whole blocks. That prefix is
    found in a trie of segments, without building any tokens: node (parent, id, n) is a prefix ending with
    segment id of n tokens; `longest` keeps, per (parent, id), the most tokens of id seen there, which is how far
    a row matches when its own run of id differs in length (a shorter run is a prefix of a longer one).
    """
    children: dict[tuple[int, int, int], int] = {}
    longest: dict[tuple[int, int], int] = {}
    hits = total = 0
    for row in rows:
        node, shared, matching = 0, 0, True
        for seg, n in row.segments:
            if matching:
                matching = (node, seg, n) in children
                shared += n if matching else min(n, longest.get((node, seg), 0))
            longest[node, seg] = max(n, longest.get((node, seg), 0))
            node = children.setdefault((node, seg, n), len(children) + 1)
        hits += shared // block_size * block_size
        total += row.prompt_tokens
    return hits / total if total else 0.0


def _cut(segments: Sequence[tuple[int, int]], limit: int) -> tuple[tuple[int, int], ...]:
    """The first `limit` tokens of a prompt (a cut segment keeps its id: its shorter run is its prefix)."""
    kept, left = [], limit
    for seg, n in segments:
        if left <= 0:
            break
        kept.append((seg, min(n, left)))
        left -= n
    return tuple(kept)


def read_mooncake(path: Path | str = MOONCAKE_TRACE, *, scale: float = 1 / 8, max_model_len: int = 8192,
                  requests: int | None = None) -> PrefixedWorkload:
    """The trace's rows as segments: block id k of a row is segment hash_ids[k] of round(512 * scale) tokens,
    the last block the rest of the scaled prompt, max(1, round(input_length * scale)) (at least 1 token).
    Answers keep their length, capped at half the window; a prompt that leaves too little room for its answer
    loses its tail and counts in `truncated` (about 2% of rows at scale 1/8 in 8,192 tokens)."""
    path = Path(path)
    block = max(1, round(TRACE_BLOCK * scale))
    rows: list[PrefixedRow] = []
    truncated = 0
    with path.open("rb") as lines:
        for number, line in enumerate(lines, 1):
            if requests is not None and len(rows) >= requests:
                break
            if not line.strip():
                continue
            item = orjson.loads(line)
            ids, length = item["hash_ids"], item["input_length"]
            blocks = max(1, math.ceil(length / TRACE_BLOCK))
            if len(ids) < blocks:
                raise ValueError(f"{path.name} line {number}: {len(ids)} hash ids for {length} tokens "
                                 f"(blocks of {TRACE_BLOCK} need {blocks})")
            last = max(1, round(length * scale) - block * (blocks - 1))
            segments = tuple((h, block) for h in ids[:blocks - 1]) + ((ids[blocks - 1], last),)
            answer = min(max(1, item["output_length"]), max_model_len // 2)
            if block * (blocks - 1) + last + answer > max_model_len:
                segments = _cut(segments, max_model_len - answer)
                truncated += 1
            rows.append(PrefixedRow(item["timestamp"] / 1000, segments, answer, _family(ids), "trace"))
    rows.sort(key=lambda r: r.arrival_s)
    return PrefixedWorkload(tuple(rows), truncated, f"mooncake:{path.name}")


def _family(ids: Sequence[int]) -> str:
    """A trace row's conversation, as far as the trace shows one: it has no session ids, and every row begins
    with the same block (a shared system prompt), so rows that share their first two blocks count as one."""
    return "trace" + "-".join(map(str, ids[:2]))


def parse_mix(text: str) -> dict[str, float]:
    """"conversation=0.5,single=0.5" -> {"conversation": 0.5, "single": 0.5} (shares of rows, summing to 1)."""
    mix: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        kind, sep, share = item.partition("=")
        kind = kind.strip()
        if not sep:
            raise ValueError(f"mix item {item!r} is not kind=share")
        if kind in mix:
            raise ValueError(f"mix names {kind!r} twice")
        try:
            mix[kind] = float(share)
        except ValueError:
            raise ValueError(f"mix share of {kind!r} is not a number: {share.strip()!r}") from None
    return _checked(mix)


def mix_name(mix: dict[str, float]) -> str:
    """The inverse of parse_mix (kinds in KINDS order, zero shares left out)."""
    return ",".join(f"{kind}={mix[kind]:g}" for kind in KINDS if mix.get(kind, 0) > 0)


def _checked(mix: dict[str, float]) -> dict[str, float]:
    unknown = sorted(set(mix) - set(KINDS))
    if unknown:
        raise ValueError(f"unknown workload kind(s) {', '.join(unknown)}: the kinds are {', '.join(KINDS)}")
    bad = [kind for kind, share in mix.items() if not share >= 0]
    if bad:
        raise ValueError(f"the share of {bad[0]!r} must be at least 0, not {mix[bad[0]]}")
    if not math.isclose(sum(mix.values()), 1.0, abs_tol=1e-6):
        raise ValueError(f"the mix's shares sum to {sum(mix.values()):g}, not 1")
    return mix


def _length(rng: np.random.Generator, what: str) -> int:
    median, sigma, least, most = _LENGTHS[what]
    return int(np.clip(round(median * math.exp(sigma * rng.standard_normal())), least, most))


class _Pools:
    """The prompts sessions share, drawn once per seed."""

    def __init__(self, rng: np.random.Generator):
        ids = iter(range(SYNTHETIC_BASE, SYNTHETIC_BASE + _POOL_IDS))

        def draw(count, low, high):
            return [(next(ids), int(n)) for n in rng.integers(low, high, count, endpoint=True)]

        self.chat = draw(4, 100, 400)
        self.long = draw(3, 800, 2000)
        self.instruction = draw(1, 40, 100)[0]
        self.documents = draw(10, 1500, 4000)
        popularity = 1 / np.arange(1, len(self.documents) + 1)
        self.popularity = popularity / popularity.sum()
        self.tools = draw(1, 500, 700)[0]


def _session(kind: str, index: int, start: float, rng: np.random.Generator, pools: _Pools,
             limit: int) -> list[tuple[PrefixedRow, bool]]:
    """One session's rows, each with whether its prompt was cut to `limit` tokens."""
    ids = itertools.count(SYNTHETIC_BASE + _POOL_IDS + index * _SESSION_IDS)
    name = f"{kind}-{index}"

    def own(what: str) -> tuple[int, int]:
        return next(ids), _length(rng, what)

    if kind in ("single", "system", "document"):
        if kind == "single":
            segments = [own("message")]
        elif kind == "system":
            segments = [pools.long[rng.integers(len(pools.long))], own("message")]
        else:
            document = pools.documents[rng.choice(len(pools.documents), p=pools.popularity)]
            segments = [pools.instruction, document, own("question")]
        cut = sum(n for _, n in segments) > limit
        return [(PrefixedRow(start, _cut(segments, limit), None, name, kind), cut)]
    if kind == "conversation":
        prefix, steps = [pools.chat[rng.integers(len(pools.chat))]], int(rng.integers(2, 8, endpoint=True))
    else:
        prefix, steps = [pools.tools, own("task")], int(rng.integers(3, 10, endpoint=True))
    rows, t = [], start
    for step in range(steps):
        if kind == "conversation":
            prefix.append(own("user"))
        elif step:
            call = own("call")
            t += call[1] * TOKEN_S + rng.uniform(1, 3)
            prefix += [call, own("result")]
        # A first prompt (at most 550 tokens, or 900 for an agent) always fits, since limit >= ANSWER_ROOM.
        if sum(n for _, n in prefix) > limit:
            break
        rows.append((PrefixedRow(t, tuple(prefix), None, name, kind), False))
        if kind == "conversation":
            answer = own("answer")
            prefix.append(answer)
            t += answer[1] * TOKEN_S + rng.exponential(15.0)
    return rows


def synthetic_prefixed(n: int, seed: int, *, mix: dict[str, float] | None = None,
                       max_model_len: int = 8192) -> PrefixedWorkload:
    """The first n rows, by arrival, of seeded sessions of the mix's kinds (see the module's docstring)."""
    mix = _checked(dict(DEFAULT_MIX if mix is None else mix))
    limit = max_model_len - ANSWER_ROOM
    if limit < ANSWER_ROOM:
        raise ValueError(f"max_model_len {max_model_len} leaves no room for prompts and {ANSWER_ROOM}-token answers")
    kinds = [kind for kind in KINDS if mix.get(kind, 0) > 0]
    weights = np.array([mix[kind] / _ROWS_PER_SESSION[kind] for kind in kinds])
    # Independent streams: the shared prompts, the session starts, and one per session, so that a session's
    # rows do not depend on how many sessions came before it or after.
    pools = _Pools(np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(0,))))
    gaps = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(1,)))
    rows: list[tuple[PrefixedRow, bool]] = []
    earliest: list[float] = []  # the n earliest arrivals so far, negated (a max-heap)
    start, index = 0.0, 0
    while n > 0 and not (len(earliest) == n and start >= -earliest[0]):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(2, index)))
        kind = kinds[rng.choice(len(kinds), p=weights / weights.sum())]
        for row, cut in _session(kind, index, start, rng, pools, limit):
            rows.append((row, cut))
            if len(earliest) < n:
                heapq.heappush(earliest, -row.arrival_s)
            elif row.arrival_s < -earliest[0]:
                heapq.heapreplace(earliest, -row.arrival_s)
        index += 1
        start += gaps.exponential(1.0)
    kept = sorted(rows, key=lambda pair: pair[0].arrival_s)[:n]
    return PrefixedWorkload(tuple(row for row, _ in kept), sum(cut for _, cut in kept),
                            f"synthetic:{mix_name(mix)}:seed={seed}")


# 256 common English words, each a single Qwen2.5 token with its leading space (tests/test_prefixed_workload.py
# checks this with the tokenizer). Qwen's pre-tokenizer splits text before every " word", so a run of them never
# merges across words or across segments: a segment of n words is exactly n tokens, wherever it stands.
_WORDS = tuple(" " + word for word in """
the of and to in is that for it as with was on be by at this have from or one had not but what all were when we
there can an your which their said if do will each about how up out them then she many some so these would other
into has more her two like him see time could no make than first been its who now people my made over did down
only way find use may water long little very after words called just where most know get through back much go good
new write our me man too any day same right look think also around another came come work three word must because
does part even place well such here take why things help put years different away again off went old number great
tell men say small every found still between name should home big give air line set own under read last never us
left end along while might next sound below saw something thought both few those always looked show large often
together asked house world going want school important until form food keep children feet land side without boy
once animals life enough took sometimes four head above kind began almost live page got earth need far hand high
year mother light parts country father let night following picture being study second eyes soon times story boys
since white days ever paper hard near sentence better best across during today others however sure means
""".split())


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scatters nearby inputs."""
    x = (x ^ (x >> 30)) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> 27)) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> 31)


def segment_text(segment_id: int, tokens: int) -> str:
    """Text that Qwen2.5's tokenizer encodes to exactly `tokens` tokens, the same for the same id, and the first
    `tokens` words of any longer text of that id. Word 8j + b is byte b of the mixed token value of word 8j: the
    first 8 words of a segment spell its id through a bijection, so different ids share at most 7 leading tokens
    (their first words differ with probability 255/256); a vocabulary cannot do better for every pair of ids,
    since there are more ids (the trace alone has 182,790) than Qwen has tokens."""
    groups = segment_tokens(segment_id, -(-tokens // 8) * 8)[::8].astype(np.uint64)
    codes = _mix64(groups).astype("<u8").view(np.uint8)[:tokens]
    return "".join([_WORDS[code] for code in codes.tolist()])


def row_text(row: PrefixedRow) -> str:
    return "".join(segment_text(s, n) for s, n in row.segments)
