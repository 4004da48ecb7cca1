"""The terms of the paper's Eq. 1, as small functions a policy composes.

Each term maps one request's candidates to [0, 1], higher is better:

    score = w_q * quality_term + w_c * cost_term + w_l * latency_term

Cost and latency are scaled by the candidates' maxima (1 - x / max x), so a
6x cheaper candidate counts in proportion rather than all or nothing; a term
whose maximum is 0 (every candidate free, or latency off) is equal for all.
"""

from __future__ import annotations

from typing import Literal

import numpy as np

QualityTerm = Literal["raw", "minmax"]
Slots = np.ndarray | np.floating  # every instance's column, or one instance's value

# KV-cache use (vllm:kv_cache_usage_perc) from which requests that wait are taken to wait for memory: a scrape
# is up to an interval old and one prompt rarely needs more than a few percent of an instance's cache.
KV_FULL = 0.9


def quality_term(quality: np.ndarray, mode: QualityTerm = "raw") -> np.ndarray:
    """Predicted quality as is ("raw"), or min-max normalised over the candidates."""
    return min_max(quality) if mode == "minmax" else quality


def cost_term(cost_usd: np.ndarray) -> np.ndarray:
    return 1.0 - _share_of_max(cost_usd)


def latency_term(latency_s: np.ndarray) -> np.ndarray:
    return 1.0 - _share_of_max(latency_s)


def eq1(weights: tuple[float, float, float], quality: np.ndarray, cost_usd: np.ndarray,
        latency_s: np.ndarray) -> np.ndarray:
    """Eq. 1 over one request's candidates; `weights` are (quality, latency, cost) and `quality` is
    already the quality term."""
    w_q, w_l, w_c = weights
    return w_q * quality + w_c * cost_term(cost_usd) + w_l * latency_term(latency_s)


def no_free_slot(running: Slots, waiting: Slots, kv_usage: Slots, max_num_seqs: Slots) -> np.ndarray | np.bool_:
    """Whether a request sent now must wait for a running one to finish before it decodes: every one of
    max_num_seqs runs, or requests wait while the KV cache is full (KV_FULL). Requests waiting beside a cache
    with room are between steps (an arrival waits for the step in flight, a long prefill takes a step's token
    budget): they wait a step, not a running request's answer. Elementwise over arrays, or one instance's
    scalars. Eq. 1's decode term and dead reckoning both ask it, so they agree on where a dispatch lands."""
    return (running >= max_num_seqs) | ((waiting > 0) & (kv_usage >= KV_FULL))


def expected_latency(tpot_s: np.ndarray, length: np.ndarray, pending_decode: np.ndarray, running: np.ndarray,
                     waiting: np.ndarray, kv_usage: np.ndarray, max_num_seqs: np.ndarray) -> np.ndarray:
    """Seconds to the end of the answer (paper section 4.2).

    With a free decode slot the request decodes at once: L x tpot.
    Otherwise (no_free_slot) it first waits through d/b iterations of the
    running batch (d pending decode tokens over b running sequences):
    (d/b + L) x tpot. A step's wait behind a prefill is the prefill term's to
    price. Counted as a full instance, a scrape that caught one arrival
    between steps priced a warm instance seconds slower and moved
    conversations off their cached history (measured in the simulator,
    docs/results/prefix.md).
    """
    busy = no_free_slot(running, waiting, kv_usage, max_num_seqs)
    wait = np.where(busy, pending_decode / np.maximum(running, 1), 0.0)
    return tpot_s * (wait + length)


def prefill_latency(prefill_s_per_token: np.ndarray, input_tokens: int, cached_tokens: np.ndarray,
                    pending_prefill: np.ndarray, own_weight: float = 1.0) -> np.ndarray:
    """Seconds each candidate would make the request wait for prefill before its first token, at its prefill
    rate: the prompt tokens already pending there (vLLM schedules prefills first come, first served), then its
    own prompt less the prefix the candidate holds cached; `own_weight` times (once as part of its end-to-end
    time, more to favour its first token). Measured in the simulator, leaving out the prefill pending ahead
    sent prompts into the queues of long ones (docs/results/prefix.md)."""
    return prefill_s_per_token * own_weight * (pending_prefill + missed_tokens(input_tokens, cached_tokens))


def prefill_hold(prefill_s_per_token: np.ndarray, input_tokens: int, cached_tokens: np.ndarray,
                 running: np.ndarray, weight: float = 1.0) -> np.ndarray:
    """Seconds the request's prefill would hold the requests running on each candidate, `weight` times: vLLM
    runs a prefill chunk in the decode batch's step, so each of the `running` requests waits for the prompt
    less what the candidate holds (what is already pending holds them wherever this request goes)."""
    return prefill_s_per_token * weight * running * missed_tokens(input_tokens, cached_tokens)


def missed_tokens(input_tokens: int, cached_tokens: np.ndarray) -> np.ndarray:
    """The prompt tokens each candidate would have to prefill: the prompt less the prefix it holds cached."""
    return np.maximum(input_tokens - cached_tokens, 0.0)


def min_max(x: np.ndarray) -> np.ndarray:
    lo, hi = x.min(), x.max()
    return (x - lo) / (hi - lo) if hi > lo else np.zeros_like(x)


def _share_of_max(x: np.ndarray) -> np.ndarray:
    top = x.max()
    return x / top if top > 0 else np.zeros_like(x)
