"""The pool state: each instance's last /metrics scrape plus the gateway's own accounting.

vLLM's metrics say how many requests run and wait, but not how much answer
is still to come; the gateway knows that for what it dispatched (predicted
tokens minus what has streamed back). Between scrapes the accounting keeps
the view current. The same bookkeeping produces the TPOT heads' training
features (lab/training/traces.py, lab/training/profile.py) and their serving
features, so a head sees features computed one way.

Each instance also has an index of the prompt prefixes it is believed to
hold (core/prefix.py): what this gateway sent it ("approximate"), and, fed
by its KV-cache events where it publishes them, what it reported
("events"); the view takes the reported one while its event stream is
healthy, else the approximate one, which is always kept, so a lost stream
falls back at once.

No clock is read here: every method takes `now`.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.core.budget import price_arrays
from gateway.core.engine.profiles import prefill_s_per_token
from gateway.core.prefill_rate import PrefillFit
from gateway.core.prefix import REPORTED_SLACK, PrefixIndex, ReportedBlocks, cacheable_blocks
from gateway.core.settings import HealthRules, InstanceSettings, SchedulerSettings
from gateway.core.view import PoolView, tier_key


@dataclass(slots=True)
class InstanceHealth:
    """Passive health of one instance, a circuit breaker: closed while attempts succeed;
    open (cooling down, not routable) after `failure_threshold` failures in a row; then
    half-open: one request probes it, and its outcome closes the circuit or opens it
    again for twice as long (up to the rules' maximum)."""

    failures: int = 0  # consecutive failed attempts since the last success
    cooldown_until: float = 0.0
    cooldowns: int = 0  # cooldowns since the last success: the backoff's exponent
    probe: object | None = None  # the request probing a half-open instance

    def routable(self, now: float) -> bool:
        return now >= self.cooldown_until and (self.cooldowns == 0 or self.probe is None)

    def cooling(self, now: float) -> bool:
        return now < self.cooldown_until

    def attempt(self, rid: object, now: float) -> None:
        """An attempt goes out; after a cooldown the first one is the probe."""
        if self.cooldowns and self.probe is None and not self.cooling(now):
            self.probe = rid

    def succeeded(self, rid: object) -> None:
        """It answered: the circuit closes, whatever it was (an answer is the best health check)."""
        self.failures = self.cooldowns = 0
        self.cooldown_until = 0.0
        self.probe = None

    def failed(self, rid: object, now: float, rules: HealthRules) -> None:
        probing = rid is not None and self.probe is rid
        if probing:
            self.probe = None
        if self.cooling(now):  # an attempt sent before the cooldown began: the circuit is open already
            return
        self.failures += 1
        if probing or self.failures >= rules.failure_threshold:
            self.cooldown_until = now + min(rules.cooldown_s * 2 ** self.cooldowns, rules.max_cooldown_s)
            self.cooldowns += 1
            self.failures = 0

    def unreachable(self, rid: object, now: float, rules: HealthRules) -> None:
        """It refused a connection (an attempt's or a scrape's): down now, without waiting for a
        threshold, and kept down while it keeps refusing; then a probe decides."""
        if rid is not None and self.probe is rid:
            self.probe = None
        self.cooldown_until = max(self.cooldown_until, now + rules.cooldown_s)
        self.cooldowns = max(self.cooldowns, 1)
        self.failures = 0

    def abandoned(self, rid: object) -> None:
        """The request ended without a verdict on the instance (its client left): another may probe."""
        if self.probe is rid:
            self.probe = None


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The few numbers of one /metrics scrape the scheduler uses (gateway/serving/telemetry.py reads them)."""

    running: float
    waiting: float
    kv_usage: float  # 0..1, the mean over ranks
    generation_tokens: float  # cumulative counter
    prompt_tokens: float
    num_gpu_blocks: int = 0  # its KV capacity in blocks (vllm:cache_config_info); 0: not known
    prefix_queries: float = 0.0  # cumulative prompt tokens looked up in its prefix cache (vllm:prefix_cache_queries)
    prefix_hits: float = 0.0  # of which it found cached (vllm:prefix_cache_hits)
    # finished requests' prefill: how many (vllm:request_prefill_time_seconds_count), their seconds (its _sum) and
    # the prompt tokens they computed, not found cached (vllm:request_prefill_kv_computed_tokens_sum)
    prefills: float = 0.0
    prefill_seconds: float = 0.0
    prefill_computed_tokens: float = 0.0


NO_SCRAPE = EngineSnapshot(0, 0, 0, 0, 0)


@dataclass(slots=True)
class InFlight:
    prefill_tokens: float  # prompt tokens it must compute: its prompt minus the prefix the instance is believed to hold
    output_tokens: float  # predicted answer tokens
    started_at: float = 0.0
    streamed: int = 0  # answer tokens seen coming back
    streaming: bool = True  # False: nothing comes back before the end, so progress is estimated


@dataclass(frozen=True, slots=True)
class Share:
    """Work a gateway has dispatched to one instance and not yet seen finish: what one replica
    tells the others (with a shared state backend), so each one's view counts the whole fleet's."""

    requests: float = 0.0
    prefill_tokens: float = 0.0  # prompt tokens still to compute of requests without a first token yet
    decode_tokens: float = 0.0  # predicted answer tokens still to come

    def __add__(self, other: Share) -> Share:
        return Share(self.requests + other.requests, self.prefill_tokens + other.prefill_tokens,
                     self.decode_tokens + other.decode_tokens)


NO_SHARE = Share()


@dataclass(slots=True)
class InstanceState:
    """One instance: the last two scrapes, the requests the gateway has on it, and (with replicas)
    the other replicas' share and cooldown as last read."""

    last: EngineSnapshot | None = None
    last_at: float = 0.0
    decode_rate: float = 0.0  # generation tokens/s between the last two scrapes
    health: InstanceHealth = field(default_factory=InstanceHealth)
    in_flight: dict = field(default_factory=dict)
    others: Share = NO_SHARE
    others_cooldown_until: float = 0.0  # another replica saw it fail: not routable before then
    sent: PrefixIndex | None = None  # the prompt blocks this gateway sent it (made on first use)
    reported: ReportedBlocks | None = None  # the blocks its KV-cache events say it holds (made by the reader)
    events_ok: bool = False  # its event stream is healthy: `reported` is the index to read
    kv_blocks: int = 0  # its KV capacity in blocks, from its metrics (0: not known yet)
    prefill_fit: PrefillFit = field(default_factory=PrefillFit)  # its prefill rate as measured (core/prefill_rate.py)

    def routable(self, now: float) -> bool:
        return self.health.routable(now) and now >= self.others_cooldown_until

    @property
    def cooling_until(self) -> float:
        """When the cooldown ends, this gateway's or another replica's, whichever ends later."""
        return max(self.health.cooldown_until, self.others_cooldown_until)

    def scraped(self, snap: EngineSnapshot, now: float) -> None:
        if snap.num_gpu_blocks and snap.num_gpu_blocks != self.kv_blocks:
            self.kv_blocks = snap.num_gpu_blocks
            if self.sent is not None:
                self.sent.resize(min(self.sent.capacity, snap.num_gpu_blocks))
            if self.reported is not None:
                self.reported.resize(min(self.reported.index.capacity, REPORTED_SLACK * snap.num_gpu_blocks))
        if self.last is not None and now > self.last_at:
            self.decode_rate = max(0.0, (snap.generation_tokens - self.last.generation_tokens) / (now - self.last_at))
        if self.last is not None and snap.prefill_computed_tokens > 0:  # a page without the histogram: the prior
            self.prefill_fit.observe(snap.prefills - self.last.prefills,
                                     snap.prefill_computed_tokens - self.last.prefill_computed_tokens,
                                     snap.prefill_seconds - self.last.prefill_seconds)
        self.last, self.last_at = snap, now

    def dispatched(self, rid, prefill_tokens: float, output_tokens: float, now: float = 0.0,
                   streaming: bool = True) -> None:
        """A request went to it: `prefill_tokens` of its prompt to compute (what it holds cached is not prefill
        work, so a warm turn does not read as a long prefill ahead of the batch) and `output_tokens` predicted."""
        self.in_flight[rid] = InFlight(prefill_tokens, output_tokens, now, streaming=streaming)

    def streamed(self, rid, tokens: int) -> None:
        if rid in self.in_flight:
            self.in_flight[rid].streamed = tokens

    def done(self, rid) -> None:
        self.in_flight.pop(rid, None)

    def bound(self, max_blocks: int) -> int:
        """Blocks its prefix index may hold: its KV capacity where known, within the configured bound."""
        return min(max_blocks, self.kv_blocks) if self.kv_blocks else max_blocks

    def sent_prompt(self, prefix: Sequence[int], max_blocks: int) -> None:
        """The gateway sent it a prompt with these blocks: it will hold them (approximate index)."""
        if self.sent is None:
            self.sent = PrefixIndex(self.bound(max_blocks))
        self.sent.record(prefix)

    def cached_tokens(self, prefix: Sequence[int], prompt_tokens: int, scheduler: SchedulerSettings) -> int:
        """Prompt tokens it is believed to hold of a prompt with these blocks (the index the scheduler reads)."""
        index, block = self.prefix_index(scheduler.prefix_cache), scheduler.prefix_block_tokens
        return 0 if index is None else index.match(prefix[:cacheable_blocks(prompt_tokens, block)]) * block

    def prefix_index(self, mode: str) -> PrefixIndex | None:
        """The index the scheduler reads: the reported one while its events are healthy (mode "events"), else
        what the gateway sent."""
        if mode == "events" and self.events_ok and self.reported is not None:
            return self.reported.index
        return self.sent

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
        work = self.own_share(now, tpot_s) + self.others
        running = max(snap.running, min(work.requests, max_num_seqs))
        waiting = max(snap.waiting, work.requests - max_num_seqs)
        rate = self.decode_rate if snap is self.last else 0.0
        return [running, waiting, snap.kv_usage, rate, work.requests, work.prefill_tokens, work.decode_tokens]

    def own_share(self, now: float = 0.0, tpot_s: float = 0.0) -> Share:
        """This gateway's requests on the instance and their pending work, best known at `now`."""
        prefill = decode = 0.0
        for f in self.in_flight.values():
            done = f.streamed if f.streaming or tpot_s <= 0 else max(f.streamed, (now - f.started_at) / tpot_s)
            if done == 0:
                prefill += f.prefill_tokens
            decode += max(f.output_tokens - done, 0.0)
        return Share(len(self.in_flight), prefill, decode)

    def features(self, prompt_tokens: int, output_tokens: float, now: float = 0.0) -> list[float]:
        """A TPOT head's whole feature row for a request about to be dispatched (training traces)."""
        return [*self.state(now), prompt_tokens, output_tokens]


# Prompts sent and not yet told to the other replicas or workers (state/prefixes.py): the oldest are dropped
# beyond this, so a process without peers (or cut off from them) holds a bounded backlog.
OUTBOX_PROMPTS = 4096


class PoolState:
    """InstanceState per instance name, so the pool state survives config reloads."""

    def __init__(self) -> None:
        self.by_name: dict[str, InstanceState] = {}
        # (instance, prompt blocks) this process sent, for its peers' approximate indexes (state/prefixes.py)
        self.sent_outbox: deque[tuple[str, tuple[int, ...]]] = deque(maxlen=OUTBOX_PROMPTS)

    def sent_prompt(self, name: str, prefix: tuple[int, ...], max_blocks: int, by_peer: bool = False) -> None:
        """A prompt with these blocks went to instance `name`, from this process (told to its peers) or from a
        peer (`by_peer`)."""
        self.of(name).sent_prompt(prefix, max_blocks)
        if not by_peer:
            self.sent_outbox.append((name, prefix))

    def of(self, name: str) -> InstanceState:
        state = self.by_name.get(name)
        if state is None:
            state = self.by_name[name] = InstanceState()
        return state

    def routable(self, name: str, now: float) -> bool:
        return self.of(name).routable(now)

    def shares(self, instances: Sequence[InstanceSettings], now: float) -> dict[str, Share]:
        """This gateway's share of each instance's work (what a replica publishes)."""
        return {i.name: self.of(i.name).own_share(now, i.tpot_prior_ms / 1000) for i in instances}

    def others_read(self, shares: dict[str, Share], cooldowns: dict[str, float], now: float) -> None:
        """The other replicas' shares and cooldowns (seconds left) as just read: they replace the last read.
        An instance absent from a read has no work from the others and no cooldown of theirs."""
        for name in self.by_name.keys() | shares.keys() | cooldowns.keys():
            state = self.of(name)
            state.others = shares.get(name, NO_SHARE)
            state.others_cooldown_until = now + cooldowns[name] if name in cooldowns else 0.0

    def cooldowns(self, now: float) -> dict[str, float]:
        """Seconds each instance this gateway saw fail stays cooling down (what a replica publishes)."""
        return {name: s.health.cooldown_until - now for name, s in self.by_name.items() if s.health.cooling(now)}

    def unreachable(self, name: str, now: float, rules: HealthRules) -> None:
        """A scrape could not connect."""
        self.of(name).health.unreachable(None, now, rules)

    def waiting(self, instances: Sequence[InstanceSettings], now: float, stale_after_s: float) -> list[float]:
        """Requests waiting in each instance's own queue, from fresh scrapes (0 if unknown)."""
        out = []
        for inst in instances:
            s = self.of(inst.name)
            out.append(s.last.waiting if s.last is not None and s.fresh(now, stale_after_s) else 0.0)
        return out

    def snapshot(self, instances: Sequence[InstanceSettings], now: float, stale_after_s: float,
                 scheduler: SchedulerSettings | None = None) -> PoolView:
        states = [self.of(i.name) for i in instances]
        rows = [s.state(now, i.tpot_prior_ms / 1000, stale_after_s, i.max_num_seqs)
                for s, i in zip(states, instances, strict=True)]
        columns = np.array(rows, dtype=np.float64).reshape(len(instances), 7).T.copy()
        running, waiting, kv_usage, decode_rate, in_flight, pending_prefill, pending_decode = columns
        price_in, price_out = price_arrays(instances)
        return PoolView(
            instances=instances,
            available=np.array([s.routable(now) for s in states], dtype=bool),
            running=running, waiting=waiting, kv_usage=kv_usage, decode_rate=decode_rate, in_flight=in_flight,
            pending_prefill=pending_prefill, pending_decode=pending_decode,
            max_num_seqs=np.array([i.max_num_seqs for i in instances], dtype=np.float64),
            price_in=price_in,
            price_out=price_out,
            tpot_prior_s=np.array([i.tpot_prior_ms / 1000 for i in instances]),
            tiers=tuple(tier_key(i.model, i.gpu) for i in instances),
            now=now,
            **self._prefix_columns(instances, states, scheduler),
        )

    @staticmethod
    def _prefix_columns(instances: Sequence[InstanceSettings], states: list[InstanceState],
                        scheduler: SchedulerSettings | None) -> dict:
        if scheduler is None or scheduler.prefix_cache == "off":
            return {}
        empty = PrefixIndex(1)  # an instance nothing was sent to yet holds nothing the gateway knows of
        return {
            "prefixes": tuple((s.prefix_index(scheduler.prefix_cache) or empty) if i.prefix_caching else None
                              for s, i in zip(states, instances, strict=True)),
            "block_size": scheduler.prefix_block_tokens,
            "prefill_s": prefill_rates(instances, states),
        }


def prefill_rates(instances: Sequence[InstanceSettings], states: Sequence[InstanceState]) -> np.ndarray:
    """Each instance's tier's prefill rate: the profile's prior refined by the prefill times its tier-mates in the
    pool reported (pooled: they run one model on one kind of GPU)."""
    fits: dict[tuple[str, str, int], PrefillFit] = {}
    for inst, state in zip(instances, states, strict=True):
        tier = (inst.model, inst.gpu, inst.gpu_count)
        fits[tier] = fits[tier] + state.prefill_fit if tier in fits else state.prefill_fit
    return np.array([fits[(i.model, i.gpu, i.gpu_count)].rate(_prefill_prior(i.model, i.gpu, i.gpu_count),
                                                               i.tpot_prior_ms / 1000) for i in instances])


@functools.lru_cache(maxsize=256)
def _prefill_prior(model: str, gpu: str, gpu_count: int) -> float:
    return prefill_s_per_token(model, gpu, gpu_count)
