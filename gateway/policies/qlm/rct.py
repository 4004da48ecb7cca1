"""QLM's request completion time (RCT) estimator (papers/qlm-queue-management.txt section 6).

A request's completion time is C = W + P + D: the wait in its instance's
virtual queue, the prefill and the decode. The answer length O is not known,
so it is a normal distribution (mean from the estimators, spread a share of
the mean, or what the request's group has shown); so are W (Eq. 2: the tokens
ahead over the instance's token rate) and D (Eq. 4: O x the time per decode
step at the batch the instance runs). A request meets its SLO with
probability P(C <= slack), read from the normal approximation.

A virtual queue belongs to a GPU. Most GPUs serve one instance; several
instances may time-share one (`gpu_id`, one model loaded at a time), and
then a request whose model is not the one its queue ends with waits for
everything ahead to drain and for its model to load (Eq. 10's swap time: a
constant per model, as in the paper).

The instance figures come from the engine model (gateway/core/engine): the same
step-time curve the simulator and the emulator run, standing in for QLM's
one-batch hardware profile. Pure arithmetic over floats: no clock, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.core.engine.engine import EngineSpec


@dataclass(frozen=True, slots=True)
class InstanceModel:
    """What the estimator needs of one instance: its step-time curve and how many requests it may run."""

    tpot_s: float  # a decode step with one sequence
    batch_slope: float  # extra step time per extra sequence, as a share of tpot_s
    prefill_s_per_token: float
    cap: int  # requests the gateway lets run on it at once (request pulling keeps the rest)
    swap_s: float = 0.0  # seconds to load its model when its GPU holds another one
    kv_swap_s_per_token: float = 0.0  # moving a token's KV cache to host memory and back (state swap)

    @classmethod
    def of(cls, spec: EngineSpec, slowdown: float, swap_s: float = 0.0) -> InstanceModel:
        """The cap is the batch at which a decode step is `slowdown` times the lone step:
        beyond it every running request slows for the throughput the others gain."""
        cap = 1 + int((slowdown - 1) / spec.batch_slope) if spec.batch_slope > 0 else spec.max_num_seqs
        return cls(spec.tpot_s, spec.batch_slope, spec.prefill_s_per_token, max(1, min(cap, spec.max_num_seqs)),
                   swap_s, spec.kv_swap_s_per_token)

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
        # Independent terms: means and variances add.
        return Normal(self.mean + other.mean, self.var + other.var)

    def p_at_most(self, x: float) -> float:
        """P(value <= x)."""
        if self.var <= 0:
            return 1.0 if self.mean <= x else 0.0
        return 0.5 * (1.0 + math.erf((x - self.mean) / math.sqrt(2.0 * self.var)))


def length(mean_tokens: float, cv: float) -> Normal:
    """An answer length of this mean with a spread of `cv` x the mean (Eq. 3)."""
    return Normal(mean_tokens, (cv * mean_tokens) ** 2)


ZERO = Normal(0.0, 0.0)


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """A virtual queue as the estimator sees it: what runs, and what is queued ahead. The figures
    are those of the stretch of one model the queue ends with (`member`); `start` is when that
    stretch can begin (0 for the model loaded now; after a swap, the drain before it and the load)."""

    running: float  # requests of the stretch's model running now
    cap: int
    count: int = 0  # requests queued ahead in the stretch
    beyond: Normal = ZERO  # answer tokens of those queued past the free slots
    member: int = -1  # the instance whose model the stretch is (-1: a queue that never swaps)
    start: Normal = ZERO
    tokens: Normal = ZERO  # answer tokens left in the stretch, running ones' rest included
    rate: float = 0.0  # the stretch's token rate at its cap (answer tokens per second)
    longest: float = 0.0  # seconds of the longest single request in the stretch

    @classmethod
    def empty(cls, model: InstanceModel, running: float, rest: tuple[float, ...] = (), member: int = -1) -> QueueLoad:
        """The queue of an instance running `running` requests, with `rest` answer tokens still to come of
        those it knows (what a swap would wait for)."""
        longest = max(rest, default=0.0) * model.step_s(running)
        return cls(running, model.cap, member=member, tokens=Normal(sum(rest), 0.0), rate=model.token_rate(),
                   longest=longest)

    @property
    def free(self) -> int:
        return max(0, self.cap - int(self.running))

    def plus(self, answer: Normal, n: int = 1) -> QueueLoad:
        """The queue with n more requests of this answer length behind it."""
        into_slots = max(0, min(n, self.free - self.count))
        rest = n - into_slots
        beyond = self.beyond + Normal(answer.mean * rest, answer.var * rest) if rest else self.beyond
        longest = max(self.longest, answer.mean * self.cap / self.rate) if self.rate > 0 else self.longest
        return QueueLoad(self.running, self.cap, self.count + n, beyond, self.member, self.start,
                         self.tokens + Normal(answer.mean * n, answer.var * n), self.rate, longest)

    def drained(self) -> Normal:
        """Seconds until everything in the queue is done: the stretch's tokens at its full rate, or its
        longest request when it is too short to fill the batch."""
        if self.rate <= 0:
            return self.start
        work = Normal(self.tokens.mean / self.rate, self.tokens.var / self.rate ** 2)
        return self.start + Normal(max(work.mean, self.longest), work.var)

    def toward(self, member: int, model: InstanceModel) -> QueueLoad:
        """The queue as a request of `member`'s model finds it: the same, if the stretch is that model's;
        else a new stretch that starts once this one has drained and the model has loaded."""
        if member == self.member or self.member < 0:
            return self
        return QueueLoad(0.0, model.cap, member=member, start=self.drained() + Normal(model.swap_s, 0.0),
                         rate=model.token_rate())


def wait(model: InstanceModel, load: QueueLoad, typical: Normal) -> Normal:
    """Time before the next request of `load` starts (Eq. 2). Nothing while the cap leaves a slot
    for it; else, in the fluid view of continuous batching, the tokens of the queued requests that
    take the next slots before it, plus the tail of the running answer that frees the first slot
    (about half a `typical` answer), over the instance's token rate."""
    if load.count < load.free:
        return load.start
    before = load.beyond + Normal(typical.mean / 2, typical.var / 4)
    rate = model.token_rate()
    return load.start + Normal(before.mean / rate, before.var / rate ** 2)


def execution(model: InstanceModel, answer: Normal, prompt_tokens: float, batch: float) -> Normal:
    """Prefill plus decode (Eq. 4) at the batch the instance will run."""
    step = model.step_s(batch)
    return Normal(model.prefill_s_per_token * prompt_tokens + answer.mean * step, answer.var * step ** 2)


def completion(model: InstanceModel, load: QueueLoad, answer: Normal, prompt_tokens: float) -> Normal:
    """C = W + P + D for a request placed behind the queue `load`."""
    batch = min(model.cap, load.running + load.count + 1)
    return wait(model, load, answer) + execution(model, answer, prompt_tokens, batch)
