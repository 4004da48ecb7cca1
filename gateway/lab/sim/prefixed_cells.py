"""A simulated cell whose prompts share prefixes: the Mooncake trace or the synthetic multi-turn mix.

The prompts come from lab/workload/prefixed.py as segments; here they become
what the simulator feeds the gateway and the engines: each row's prompt
length, the chained hashes of its token blocks (core/prefix.py: the same
function for the gateway's index and the engines' caches, so their blocks
agree, as the gateway's hashing of the real tokens agrees with vLLM's
blocks), its arrival time and its max_tokens.

Row i of the workload borrows held-out synthetic prompt i (modulo the
evaluation set's size): its quality labels and the estimators' predictions
(quality, answer length, embedding), so that quality and cost are defined,
and paired across modes. The steps of a synthetic agent run all borrow the
run's first row: the gateway's estimators see a chat's last user turn
(api/parse.py), and an agent loop appends tool calls and their results after
its one task, so live every step is estimated as its task. A conversation's
turns each bring a new user message, so each borrows its own. A trace row
keeps its own answer length on every model (the trace's, capped by the
window); a synthetic row answers with the borrowed prompt's labelled
lengths. Every request asks for what the window leaves (vLLM's default
max_tokens), so no answer is cut.

Arrival times are the workload's own, scaled to the cell's mean rate. The
trace's timestamps are whole milliseconds (many requests share one): the
seed jitters each within its millisecond, which reorders the ties, and picks
the tie-breaks; a synthetic workload is drawn anew from the seed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from gateway.core.prefix import block_hashes
from gateway.lab.workload.prefixed import (
    DEFAULT_MIX,
    MOONCAKE_TRACE,
    PrefixedWorkload,
    ceiling_hit_rate,
    parse_mix,
    read_mooncake,
    row_tokens,
    synthetic_prefixed,
)

TRACE_SCALE = 1 / 8  # the trace's prompts average 12k tokens; the pool's windows are 8,192


@dataclass(frozen=True, slots=True)
class PrefixSource:
    """Where a cell's prompts come from: "trace" (a file in the Mooncake format) or "synthetic" (a mix)."""

    kind: str = "trace"
    path: str = str(MOONCAKE_TRACE)  # trace
    scale: float = TRACE_SCALE  # trace: prompt lengths and block size times this
    mix: str = ""  # synthetic: e.g. "conversation=0.5,single=0.5" ("": the default mix)

    def __post_init__(self):
        if self.kind not in ("trace", "synthetic"):
            raise ValueError(f"unknown prefix source {self.kind!r} (known: trace, synthetic)")
        if not 0 < self.scale <= 1:
            raise ValueError("trace scale must be in (0, 1]")
        if self.mix:
            parse_mix(self.mix)  # refused now, not minutes into a sweep

    def label(self) -> str:
        if self.kind == "trace":
            return f"trace x{self.scale:g}"
        return f"multi-turn {self.mix}" if self.mix else "multi-turn"

    def workload(self, n: int, seed: int, window: int) -> PrefixedWorkload:
        if self.kind == "trace":
            return _trace(self.path, self.scale, window, n)
        return synthetic_prefixed(n, seed, mix=parse_mix(self.mix) if self.mix else dict(DEFAULT_MIX),
                                  max_model_len=window)


@dataclass(frozen=True)
class PrefixedRows:
    """One cell's requests in arrival order; `borrowed` is the workload row whose held-out prompt each one
    borrows (the evaluation set's row: borrowed mod its size)."""

    borrowed: np.ndarray
    times: np.ndarray
    prompt_tokens: np.ndarray
    output_tokens: np.ndarray  # -1: the borrowed prompt's labelled lengths
    max_tokens: np.ndarray
    prefix: tuple[tuple[int, ...], ...]  # chained block hashes, per request
    session: tuple[str, ...]  # the conversation, agent run or document each belongs to
    truncated: int  # rows whose prompt was cut to the window
    ceiling: float  # what one unbounded cache serving everything would hit (share of prompt tokens)


def prefixed_rows(source: PrefixSource, n: int, rate: float, seed: int, block_size: int,
                  window: int) -> PrefixedRows:
    work = source.workload(n, seed, window)
    if len(work.rows) < n:
        raise ValueError(f"{source.label()} holds {len(work.rows)} requests; asked for {n}")
    rows = work.rows[:n]
    rel = np.array([r.arrival_s for r in rows])
    if source.kind == "trace":  # whole milliseconds: jitter within each, as the seed says
        rel = rel + np.random.default_rng(seed).uniform(0, 1e-3, n)
    order = np.argsort(rel, kind="stable")
    rel = rel[order] - rel[order[0]]
    span = rel[-1] if rel[-1] > 0 else 1.0
    times = rel * (n / rate) / span  # n arrivals over n / rate seconds: the cell's mean rate
    hashes = _hashes(source, n, block_size, window) if source.kind == "trace" else tuple(
        block_hashes(row_tokens(r).tolist(), block_size) for r in rows)
    prompt = np.array([r.prompt_tokens for r in rows])
    out = np.array([-1 if r.output_tokens is None else r.output_tokens for r in rows])
    return PrefixedRows(_borrowed(rows)[order], times, prompt[order], out[order], window - prompt[order],
                        tuple(hashes[k] for k in order), tuple(rows[k].session for k in order), work.truncated,
                        ceiling_hit_rate(rows, block_size))


def _borrowed(rows) -> np.ndarray:
    """Per row, the row whose held-out prompt it borrows: its own, or its agent run's first (see above)."""
    first: dict[str, int] = {}
    return np.array([first.setdefault(r.session, k) if r.kind == "agent" else k for k, r in enumerate(rows)])


@functools.lru_cache(maxsize=2)  # every cell of a sweep replays the same file
def _trace(path: str, scale: float, window: int, n: int) -> PrefixedWorkload:
    return read_mooncake(path, scale=scale, max_model_len=window, requests=n)


@functools.lru_cache(maxsize=2)
def _hashes(source: PrefixSource, n: int, block_size: int, window: int) -> tuple[tuple[int, ...], ...]:
    rows = _trace(source.path, source.scale, window, n).rows
    return tuple(block_hashes(row_tokens(r).tolist(), block_size) for r in rows)
