"""The pool ledger: each instance's last /metrics scrape plus the gateway's own accounting.

vLLM's metrics say how many requests run and wait, but not how much answer
is still to come; the gateway knows that for what it dispatched (predicted
tokens minus what has streamed back). Between scrapes the accounting keeps
the view current. The same bookkeeping produces the TPOT heads' training
features (estimators/traces.py, estimators/profile.py) and their serving
features, so a head sees features computed one way.

No clock is read here: every method takes `now`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from gateway.scheduling.budget import per_token
from gateway.scheduling.view import PoolView, tier_key

DOWN_FOR_S = 2.0  # after a connect failure, skip the instance this long before trying it again


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The few numbers of one /metrics scrape the scheduler uses (gateway/telemetry.py reads them)."""

    running: float
    waiting: float
    kv_usage: float  # 0..1, the mean over ranks
    generation_tokens: float  # cumulative counter
    prompt_tokens: float


NO_SCRAPE = EngineSnapshot(0, 0, 0, 0, 0)


@dataclass(slots=True)
class InFlight:
    prompt_tokens: int
    output_tokens: float  # predicted answer tokens
    started_at: float = 0.0
    streamed: int = 0  # answer tokens seen coming back
    streaming: bool = True  # False: nothing comes back before the end, so progress is estimated


@dataclass(slots=True)
class InstanceState:
    """One instance: the last two scrapes and the requests the gateway has on it."""

    last: EngineSnapshot | None = None
    last_at: float = 0.0
    decode_rate: float = 0.0  # generation tokens/s between the last two scrapes
    down_until: float = 0.0
    in_flight: dict = field(default_factory=dict)

    def scraped(self, snap: EngineSnapshot, now: float) -> None:
        if self.last is not None and now > self.last_at:
            self.decode_rate = max(0.0, (snap.generation_tokens - self.last.generation_tokens) / (now - self.last_at))
        self.last, self.last_at = snap, now

    def dispatched(self, rid, prompt_tokens: int, output_tokens: float, now: float = 0.0,
                   streaming: bool = True) -> None:
        self.in_flight[rid] = InFlight(prompt_tokens, output_tokens, now, streaming=streaming)

    def streamed(self, rid, tokens: int) -> None:
        if rid in self.in_flight:
            self.in_flight[rid].streamed = tokens

    def done(self, rid) -> None:
        self.in_flight.pop(rid, None)

    def fresh(self, now: float, stale_after_s: float) -> bool:
        return self.last is not None and now - self.last_at <= stale_after_s

    def state(self, now: float = 0.0, tpot_s: float = 0.0, stale_after_s: float = float("inf"),
              max_num_seqs: int = 1 << 30) -> list[float]:
        """The instance's columns (view.STATE_FEATURES order), best known at `now`.

        A stale or missing scrape counts as nothing running; the gateway's own
        requests then stand in for running and waiting. A request answered
        in one piece is assumed to decode at the tier's prior TPOT after its
        dispatch, since nothing of it is seen before the end.
        """
        snap = self.last if self.last is not None and self.fresh(now, stale_after_s) else NO_SCRAPE
        own = len(self.in_flight)
        running = max(snap.running, min(own, max_num_seqs))
        waiting = max(snap.waiting, own - max_num_seqs)
        prefill = decode = 0.0
        for f in self.in_flight.values():
            done = f.streamed if f.streaming or tpot_s <= 0 else max(f.streamed, (now - f.started_at) / tpot_s)
            if done == 0:
                prefill += f.prompt_tokens
            decode += max(f.output_tokens - done, 0.0)
        rate = self.decode_rate if snap is self.last else 0.0
        return [running, waiting, snap.kv_usage, rate, own, prefill, decode]

    def features(self, prompt_tokens: int, output_tokens: float, now: float = 0.0) -> list[float]:
        """A TPOT head's whole feature row for a request about to be dispatched (training traces)."""
        return [*self.state(now), prompt_tokens, output_tokens]


class PoolLedger:
    """InstanceState per instance name, so the ledger survives config reloads."""

    def __init__(self) -> None:
        self.by_name: dict[str, InstanceState] = {}

    def of(self, name: str) -> InstanceState:
        state = self.by_name.get(name)
        if state is None:
            state = self.by_name[name] = InstanceState()
        return state

    def mark_down(self, name: str, now: float) -> None:
        self.of(name).down_until = now + DOWN_FOR_S

    def mark_up(self, name: str) -> None:
        self.of(name).down_until = 0.0

    def waiting(self, instances, now: float, stale_after_s: float) -> list[float]:
        """Requests waiting in each instance's own queue, from fresh scrapes (0 if unknown)."""
        out = []
        for inst in instances:
            s = self.of(inst.name)
            out.append(s.last.waiting if s.last is not None and s.fresh(now, stale_after_s) else 0.0)
        return out

    def snapshot(self, instances: tuple, now: float, stale_after_s: float) -> PoolView:
        states = [self.of(i.name) for i in instances]
        rows = [s.state(now, i.tpot_prior_ms / 1000, stale_after_s, i.max_num_seqs)
                for s, i in zip(states, instances, strict=True)]
        columns = np.array(rows, dtype=np.float64).reshape(len(instances), 7).T.copy()
        running, waiting, kv_usage, decode_rate, in_flight, pending_prefill, pending_decode = columns
        return PoolView(
            instances=instances,
            available=np.array([s.down_until <= now for s in states], dtype=bool),
            running=running, waiting=waiting, kv_usage=kv_usage, decode_rate=decode_rate, in_flight=in_flight,
            pending_prefill=pending_prefill, pending_decode=pending_decode,
            max_num_seqs=np.array([i.max_num_seqs for i in instances], dtype=np.float64),
            price_in=np.array([per_token(i.price_input_per_mtok) for i in instances]),
            price_out=np.array([per_token(i.price_output_per_mtok) for i in instances]),
            tpot_prior_s=np.array([i.tpot_prior_ms / 1000 for i in instances]),
            tiers=tuple(tier_key(i.model, i.gpu) for i in instances),
        )
