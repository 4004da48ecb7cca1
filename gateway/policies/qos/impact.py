"""The action-impact estimator of the QoS routing paper (papers/qos-aware-edge-routing.txt, Eqs. 13-15).

How much does admitting a new request j on instance n raise the time per
output token of the requests already running there, and what time per
token will j itself see? Both come from the engine model's step-time curve
(gateway/core/engine/engine.py), one per instance:

    step = tpot * (1 + batch_slope * (n_seqs - 1) + kv_read_per_token * kv_tokens)
           + prefill_s_per_token * prefill_tokens

Admitting j (prompt p_j, answer d_j tokens) costs every running request i
(answer d_i tokens, of which r_i are still to come):

- its prefill step, once: prefill_s_per_token * p_j               (Eq. 13, k_1 = prefill_s_per_token)
- then, for each of the m = min(r_i, d_j) steps both decode, one more
  sequence in the batch and j's growing context to read:
  tpot * (batch_slope + kv_read_per_token * (p_j + k)), k = 1..m  (Eq. 14, k_2 = tpot * kv_read_per_token)

so i's time per token rises by

    l+_i = (prefill_s_per_token * p_j + tpot * (m * batch_slope + kv_read_per_token * (m * p_j + m (m + 1) / 2))) / d_i

which is the paper's Eq. 15 with the engine's per-sequence cost (batch_slope)
added to its per-token one. Whether i then still meets its bound L_i uses
its projected time per token: what it has waited so far plus its remaining
steps at the current step time, over its (predicted) answer length.

Pure numpy over per-instance and per-request arrays: no clock (the instant
is passed in), no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.core.engine.engine import EngineSpec


@dataclass(frozen=True, slots=True)
class StepCurves:
    """The engine step model of each instance, as arrays in config order."""

    tpot_s: np.ndarray  # a lone sequence's decode step
    batch_slope: np.ndarray  # extra step share per extra sequence
    kv_read_per_token: np.ndarray  # extra step share per context token in the batch
    prefill_s_per_token: np.ndarray  # seconds of prefill per prompt token
    max_num_seqs: np.ndarray
    kv_capacity: np.ndarray  # tokens of KV cache (blocks x block size)

    @classmethod
    def of(cls, specs: Sequence[EngineSpec]) -> StepCurves:
        def col(name: str) -> np.ndarray:
            return np.array([float(getattr(s, name)) for s in specs], dtype=np.float64)

        return cls(col("tpot_s"), col("batch_slope"), col("kv_read_per_token"), col("prefill_s_per_token"),
                   col("max_num_seqs"), np.array([float(s.num_gpu_blocks * s.block_size) for s in specs]))

    def __len__(self) -> int:
        return len(self.tpot_s)

    def step_s(self, n_seqs: np.ndarray, kv_tokens: np.ndarray, idx: np.ndarray | slice = slice(None)) -> np.ndarray:
        """One decode step with `n_seqs` sequences reading `kv_tokens` of context, on instances `idx`."""
        return self.tpot_s[idx] * (1.0 + self.batch_slope[idx] * np.maximum(n_seqs - 1.0, 0.0)
                                   + self.kv_read_per_token[idx] * kv_tokens)


def added_seconds(curves: StepCurves, idx: np.ndarray, prompt_j: np.ndarray | float, length_j: np.ndarray | float,
                  remaining_i: np.ndarray) -> np.ndarray:
    """Seconds request j (prompt_j, length_j, on the instance of each i) adds to the finish of running
    requests i with `remaining_i` answer tokens still to come (Eq. 15's numerator)."""
    m = np.minimum(np.maximum(remaining_i, 0.0), length_j)
    return (curves.prefill_s_per_token[idx] * prompt_j
            + curves.tpot_s[idx] * (m * curves.batch_slope[idx]
                                    + curves.kv_read_per_token[idx] * (m * prompt_j + m * (m + 1.0) / 2.0)))


def impact_per_token(curves: StepCurves, idx: np.ndarray, prompt_j: np.ndarray | float,
                     length_j: np.ndarray | float, remaining_i: np.ndarray, total_i: np.ndarray) -> np.ndarray:
    """l+_i of Eq. 15: the rise in time per token of running requests i of `total_i` answer tokens."""
    return added_seconds(curves, idx, prompt_j, length_j, remaining_i) / np.maximum(total_i, 1.0)


def meet_probability(tpot_s: np.ndarray, bound_s: np.ndarray | float, width: float) -> np.ndarray:
    """A soft [tpot <= bound]: 0.5 at the bound, `width` the relative error of the estimate (logistic scale)."""
    z = (1.0 - tpot_s / bound_s) / max(width, 1e-9)
    return 0.5 * (1.0 + np.tanh(0.5 * np.clip(z, -60.0, 60.0)))


@dataclass(frozen=True, slots=True)
class Load:
    """Per instance: sequences running and waiting in the engine, and tokens of context in its KV cache."""

    running: np.ndarray
    waiting: np.ndarray
    kv_tokens: np.ndarray


@dataclass(frozen=True, slots=True)
class RunningArrays:
    """The requests already on the instances (the ones a policy tracks), one entry each."""

    instance: np.ndarray  # int index into the instances
    prompt: np.ndarray  # p_i
    total: np.ndarray  # predicted answer tokens d_i (at least what has streamed, plus one)
    generated: np.ndarray  # d_{i,t}: answer tokens so far
    elapsed_s: np.ndarray  # now - arrival
    quality: np.ndarray  # predicted quality s_i of its instance's answer
    bound_s: np.ndarray  # its time-per-token bound L_i

    def __len__(self) -> int:
        return len(self.instance)

    @property
    def remaining(self) -> np.ndarray:
        return np.maximum(self.total - self.generated, 0.0)

    @classmethod
    def empty(cls) -> RunningArrays:
        z = np.zeros(0)
        return cls(np.zeros(0, dtype=np.int64), z, z, z, z, z, z)


@dataclass(frozen=True, slots=True)
class Assessment:
    """What admitting one request on each instance would do (one entry per instance; NaN-free)."""

    step_s: np.ndarray  # (I,) a decode step there now
    wait_s: np.ndarray  # (I,) estimated wait in the engine's queue before its prefill
    tpot_s: np.ndarray  # (I,) the new request's estimated time per token there
    meet: np.ndarray  # (I,) soft probability it meets its bound there
    loss: np.ndarray  # (I,) expected QoS the running requests there lose (sum of s_i x drop in meet probability)
    violations: np.ndarray  # (I,) Eq. 16's penalty: sum of s_i x [projected tpot_i + l+_i >= L_i] there
    flips: np.ndarray  # (I,) the part of it the new request causes: s_i x [tpot_i < L_i <= tpot_i + l+_i]
    # Per running request (aligned with `RunningArrays`): projected time per token without and with the new
    # request on its instance.
    projected_s: np.ndarray
    impact_s: np.ndarray


def projected_tpot(running: RunningArrays, step_s: np.ndarray) -> np.ndarray:
    """Each running request's time per token at its end if its remaining steps run at its instance's step now."""
    return (running.elapsed_s + running.remaining * step_s[running.instance]) / np.maximum(running.total, 1.0)


def assess(curves: StepCurves, load: Load, running: RunningArrays, prompt: float, length: np.ndarray,
           bound_s: float, width: float, waited_s: float = 0.0) -> Assessment:
    """The new request (prompt tokens, predicted answer tokens per instance `length`, bound `bound_s`)
    placed on each instance in turn.

    Its own time per token there: the wait for a slot or KV room (when the
    instance queues, or has no free slot or cache: the waiting requests plus
    itself, each taking one running request's mean remaining steps over the
    running count), its prefill, then its answer at the step time with
    itself in the batch; plus what it already waited (`waited_s`), all over
    its answer tokens.
    """
    n, kv = load.running, load.kv_tokens
    length = np.maximum(np.asarray(length, dtype=np.float64), 1.0)
    step = curves.step_s(n, kv)
    count = np.bincount(running.instance, minlength=len(curves)).astype(np.float64)
    left = np.bincount(running.instance, weights=running.remaining, minlength=len(curves))
    mean_left = np.divide(left, count, out=length.copy(), where=count > 0)
    full = (load.waiting > 0) | (n >= curves.max_num_seqs) | (kv + prompt + length > curves.kv_capacity)
    wait = np.where(full, (load.waiting + 1.0) * step * mean_left / np.maximum(n, 1.0), 0.0)
    step_with = curves.step_s(n + 1.0, kv + prompt + length / 2.0)
    tpot = (waited_s + wait + curves.prefill_s_per_token * prompt + length * step_with) / length
    meet = meet_probability(tpot, bound_s, width)

    before = projected_tpot(running, step)
    idx = running.instance
    impact = impact_per_token(curves, idx, prompt, length[idx], running.remaining, running.total)
    after = before + impact
    lost = running.quality * (meet_probability(before, running.bound_s, width)
                              - meet_probability(after, running.bound_s, width))
    loss = np.bincount(idx, weights=lost, minlength=len(curves))
    violated = running.quality * (after >= running.bound_s)
    violations = np.bincount(idx, weights=violated, minlength=len(curves))
    flipped = violated * (before < running.bound_s)
    flips = np.bincount(idx, weights=flipped, minlength=len(curves))
    return Assessment(step, wait, tpot, meet, loss, violations, flips, before, impact)
