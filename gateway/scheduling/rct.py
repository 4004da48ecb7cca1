"""QLM's request completion time (RCT) estimator (papers/qlm-queue-management.txt section 6).

A request's completion time is C = W + P + D: the wait in its instance's
virtual queue, the prefill and the decode. The answer length O is not known,
so it is a normal distribution (mean from the estimators, spread a share of
the mean, or what the request's group has shown); so are W (Eq. 2: the tokens
ahead over the instance's token rate) and D (Eq. 4: O x the time per decode
step at the batch the instance runs). A request meets its SLO with
probability P(C <= slack), read from the normal approximation.

The instance figures come from the engine model (gateway/engine): the same
step-time curve the simulator and the emulator run, standing in for QLM's
one-batch hardware profile. Pure arithmetic over floats: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.engine.engine import EngineSpec


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """What the estimator needs of one instance: its step-time curve and how many requests it may run."""

    tpot_s: float  # a decode step with one sequence
    batch_slope: float  # extra step time per extra sequence, as a share of tpot_s
    prefill_s_per_token: float
    cap: int  # requests the gateway lets run on it at once (request pulling keeps the rest)

    @classmethod
    def of(cls, spec: EngineSpec, slowdown: float) -> InstanceModel:
        """The cap is the batch at which a decode step is `slowdown` times the lone step:
        beyond it every running request slows for the throughput the others gain."""
        cap = 1 + int((slowdown - 1) / spec.batch_slope) if spec.batch_slope > 0 else spec.max_num_seqs
        return cls(spec.tpot_s, spec.batch_slope, spec.prefill_s_per_token, max(1, min(cap, spec.max_num_seqs)))

    def step_s(self, batch: float) -> float:
        """Seconds per decode step (per token of each running request) with `batch` sequences."""
        return self.tpot_s * (1 + self.batch_slope * (max(batch, 1.0) - 1))

    def token_rate(self) -> float:
        """Answer tokens per second across the batch when the instance runs at its cap (Eq. 2's Theta)."""
        return self.cap / self.step_s(self.cap)


@dataclass(frozen=True, slots=True)
class Normal:
    mean: float
    var: float

    def __add__(self, other: Normal) -> Normal:
        return Normal(self.mean + other.mean, self.var + other.var)

    def p_at_most(self, x: float) -> float:
        """P(value <= x)."""
        if self.var <= 0:
            return 1.0 if self.mean <= x else 0.0
        return 0.5 * (1.0 + math.erf((x - self.mean) / math.sqrt(2.0 * self.var)))


def length(mean_tokens: float, cv: float) -> Normal:
    """An answer length of this mean with a spread of `cv` x the mean (Eq. 3)."""
    return Normal(mean_tokens, (cv * mean_tokens) ** 2)


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """An instance's virtual queue as the estimator sees it: what runs, and what is queued ahead."""

    running: float  # requests on the instance now
    cap: int
    count: int = 0  # requests queued ahead
    beyond: Normal = Normal(0.0, 0.0)  # answer tokens of those queued past the free slots

    @classmethod
    def empty(cls, model: InstanceModel, running: float) -> QueueLoad:
        return cls(running, model.cap)

    @property
    def free(self) -> int:
        return max(0, self.cap - int(self.running))

    def plus(self, answer: Normal, n: int = 1) -> QueueLoad:
        """The queue with n more requests of this answer length behind it."""
        into_slots = max(0, min(n, self.free - self.count))
        rest = n - into_slots
        beyond = self.beyond + Normal(answer.mean * rest, answer.var * rest) if rest else self.beyond
        return QueueLoad(self.running, self.cap, self.count + n, beyond)


def wait(model: InstanceModel, load: QueueLoad, typical: Normal) -> Normal:
    """Time before the next request of `load` starts (Eq. 2). Nothing while the cap leaves a slot
    for it; else, in the fluid view of continuous batching, the tokens of the queued requests that
    take the next slots before it, plus the tail of the running answer that frees the first slot
    (about half a `typical` answer), over the instance's token rate."""
    if load.count < load.free:
        return Normal(0.0, 0.0)
    before = load.beyond + Normal(typical.mean / 2, typical.var / 4)
    rate = model.token_rate()
    return Normal(before.mean / rate, before.var / rate ** 2)


def execution(model: InstanceModel, answer: Normal, prompt_tokens: float, batch: float) -> Normal:
    """Prefill plus decode (Eq. 4) at the batch the instance will run."""
    step = model.step_s(batch)
    return Normal(model.prefill_s_per_token * prompt_tokens + answer.mean * step, answer.var * step ** 2)


def completion(model: InstanceModel, load: QueueLoad, answer: Normal, prompt_tokens: float) -> Normal:
    """C = W + P + D for a request placed behind the queue `load`."""
    batch = min(model.cap, load.running + load.count + 1)
    return wait(model, load, answer) + execution(model, answer, prompt_tokens, batch)
