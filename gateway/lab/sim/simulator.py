"""Discrete-event simulation of the gateway over the pool, in virtual time.

One cell replays an evaluation set at some arrival process through the
gateway's own scheduling loop (core/loop.py), the very object the live
server drives: batch forming (eager, or the paper's window rule), the
policies' hooks and assignment, the dispatch plans with their budget clamp,
and the pool state, fed here by scrapes of each engine every
`scrape_interval_s` and by the streamed progress of what was dispatched.
What this driver adds is virtual time and the instances: `engine.Engine`,
answering each prompt at its labelled length for the model that serves it
(instances sharing a `gpu_id` run as one `engine.shared_gpu.SharedGpu`,
which swaps their models in and out; a mixture-of-experts instance routes
each prompt's tokens to the experts of its kind and subdomain, engine/moe.py).
Estimates come from the evaluation set's cache (the estimators are
deterministic per prompt, so computing them once changes no decision).

The scheduler is one worker, as live: a batch's compute (ComputeCost, timed
from the real estimators) passes in virtual time before its requests reach
their instances, and the next batch cannot fire before that. Nothing reads a
clock and every random choice comes from the seed, so a cell repeats exactly.

A cell may run several gateway replicas (`CellSpec.replicas`) behind a
round-robin balancer: each is a `Replica` (its own loop, pool_state, policies,
scrapes and batches), all dispatch to the same engines, and they share their
in-flight accounting late through replicas.SharedState. One replica is the
R = 1 case of the same code: nothing is shared and no sync tick comes.

Engines cache prompt prefixes as vLLM does (engine/prefix_cache.py) and the
gateway indexes what it sent where (core/prefix.py): every prompt carries
the chained hashes of its token blocks, the held-out prompts' from their
real tokens through the chat template, a prefix-sharing cell's
(`CellSpec.prefixed`: the Mooncake trace or the synthetic multi-turn mix,
sim/prefixed_cells.py) from its segments. `CellSpec.prefix_cache` sets what
the gateway knows ([scheduler] prefix_cache); the engines cache either way.

In a progressive cell (`CellSpec.progressive`, PICE) a request the fallback
rule admits is a sketch on the largest tier; its expansions are requests of
their own, arriving when the sketch ends, and its outcome is folded from
theirs (sim/progressive.py).
"""

from __future__ import annotations

import dataclasses
import functools
import heapq
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from gateway.core.budget import per_token, predicted_cost, price_arrays
from gateway.core.engine.engine import Engine
from gateway.core.engine.moe import expert_domain
from gateway.core.engine.profiles import load_seconds
from gateway.core.engine.shared_gpu import SharedGpu, gpu_groups
from gateway.core.loop import SchedulingLoop
from gateway.core.policy import Policy
from gateway.core.pool_state import EngineSnapshot, PoolState
from gateway.core.prefix import REPORTED_SLACK, ReportedBlocks, block_hashes
from gateway.core.request import Completion, Estimates, Refusal, RouteRequest, Ticket
from gateway.core.slo import check_slo_mix, slo_class
from gateway.core.view import PoolView
from gateway.lab.emulator.settings import engine_for
from gateway.lab.sim.arrivals import ArrivalSpec, arrival_times
from gateway.lab.sim.evalset import EvalSet
from gateway.lab.sim.prefixed_cells import PrefixSource, prefixed_rows
from gateway.lab.sim.progressive import ProgressivePlans, fold, plan_all, row_lengths
from gateway.lab.sim.replicas import SharedState, replica_of
from gateway.policies import registry

DEFAULT_MAX_TOKENS = 1024  # what each simulated client asks for, like the paper's harness


@dataclass(frozen=True, slots=True)
class CellSpec:
    """What one cell runs: a policy and its knobs, an arrival process, budgets."""

    policy: str = "routebalance"
    weights: tuple[float, float, float] = (1 / 3, 1 / 3, 1 / 3)  # quality, latency, cost
    arrivals: ArrivalSpec = ArrivalSpec()
    requests: int = 3500
    seed: int = 0
    budget_share: float = 0.0  # share of requests that carry a budget
    budget_answer_tokens: int = 120  # a budget buys the prompt plus this many answer tokens at budget_price
    budget_price_per_mtok: float = 0.15  # USD per 1M tokens (the 14B tier's price)
    down: tuple[str, ...] = ()  # models whose instances are all down for the whole cell
    model: str | None = None  # a pool model: every request names it, as `model` does in the API
    # Or a mix of pool models, (model, share of requests) pairs drawn per request from the seed (the QLM
    # paper's multi-model W_A, on instances that share GPUs by `gpu_id`).
    models: tuple[tuple[str, float], ...] = ()
    host_slots: int = 2  # models a shared GPU's host memory keeps warm (QLM's warm start)
    max_tokens: int = DEFAULT_MAX_TOKENS  # what every simulated client asks for (held-out prompts)
    # Every request asks for at most this many answer tokens, whatever its prompts (a live load test's cap,
    # replayed); None: the held-out prompts' max_tokens, a prefix-sharing row's own answer.
    answer_cap: int | None = None
    # End-to-end SLO mix: (seconds, share of requests) pairs, drawn per request from the seed; the
    # remaining share carries no SLO (the QLM paper's classes: interactive ~20-30 s, batch minutes).
    slos: tuple[tuple[float, float], ...] = ()
    tpot_slo_s: float | None = None  # every request's time-per-output-token bound (the QoS paper's L)
    # The QLM paper's W_C: this share of requests are "mega prompts" of (prompt, answer) tokens,
    # whose KV fills much of an instance; the estimators see only their text.
    mega_share: float = 0.0
    mega_tokens: tuple[int, int] = (3000, 1000)
    # Requests whose SLO is at least this long do not stream (batch jobs read the whole answer), so a
    # policy may evict them until they finish; the rest stream, evictable until their first token.
    stream_below_s: float = math.inf
    # Gateway replicas behind a round-robin balancer (replicas.py), each publishing its share of the work
    # every `sync_interval_s` (0: the others' work is read as it is at every decision; inf: never shared),
    # what one publishes readable by the others `staleness_s` later.
    replicas: int = 1
    sync_interval_s: float = 0.25
    staleness_s: float = 0.0
    # Every request asks for progressive mode (PICE; sim/progressive.py), with the config's [progressive].
    progressive: bool = False
    # Prompts that share prefixes (sim/prefixed_cells.py) instead of the held-out prompts in order.
    prefixed: PrefixSource | None = None
    prefix_cache: str | None = None  # what the gateway knows of the engines' caches (None: the config's)

    def __post_init__(self):
        check_slo_mix(self.slos)
        if self.answer_cap is not None and self.answer_cap < 1:
            raise ValueError(f"answer_cap must be at least 1, got {self.answer_cap}")
        if self.prefix_cache not in (None, "approximate", "events", "off"):
            raise ValueError(f"unknown prefix_cache {self.prefix_cache!r} (known: approximate, events, off)")
        if self.prefixed is not None and (self.progressive or self.mega_share or self.models):
            raise ValueError("prefix-sharing cells carry no progressive mode, mega prompts or model mixes")
        if self.progressive and (self.budget_share or self.slos or self.mega_share or self.models
                                 or self.tpot_slo_s is not None):
            raise ValueError("progressive cells carry no budgets, SLOs, mega prompts or model mixes")
        SharedState(self.replicas, self.sync_interval_s, self.staleness_s)  # refuses what cannot be
        if self.models and (self.model is not None or abs(sum(w for _, w in self.models) - 1) > 1e-9
                            or any(w < 0 for _, w in self.models)):
            raise ValueError("models: shares >= 0 summing to 1, and no `model` beside them")


@dataclass(slots=True)
class Outcome:
    """One request's fate."""

    arrival: float
    instance: int = -1  # -1: refused (no candidate could pay for the prompt)
    dispatched: float = math.nan  # when it reached its instance
    first_token: float = math.nan
    finished: float = math.nan
    prompt_tokens: int = 0
    completion_tokens: int = 0
    quality: float = 0.0  # judged quality of what was served
    cost_usd: float = 0.0
    budget_usd: float | None = None
    budget_cut: bool = False  # the budget clamp ended the answer before the model would have
    slo_s: float | None = None  # its end-to-end SLO
    slo_class: str = "none"
    tpot_slo_s: float | None = None  # its bound on time per output token
    evictions: int = 0  # times its policy aborted it on an instance and held it again
    mode: str = "normal"  # progressive cells: "progressive", or why it was routed normally (the fallback rule)
    quality_oracle: float = math.nan  # progressive: the mean label of each point's best expansion (an oracle pick)
    cached_tokens: int = 0  # prompt tokens its instance found in its prefix cache


@dataclass(frozen=True, slots=True)
class CellResult:
    spec: CellSpec
    outcomes: tuple[Outcome, ...]
    models: tuple[str, ...]  # model of each instance, in config order
    batches: tuple[int, ...]  # size of each batch the scheduler fired
    ranked_down: tuple[int, ...] = ()  # requests whose decision put a down instance first
    swaps: float = math.nan  # model loads on GPUs shared by several models (NaN: no GPU is shared)
    swap_s: float = math.nan  # GPU seconds those loads took
    info_age_s: float = math.nan  # replicas: mean age of the others' work counted at a decision (NaN: none)
    # Mixture-of-experts instances: the expected distinct experts per layer a step loads, mean over their steps
    # (NaN: no MoE instance)
    experts_per_step: float = math.nan


def budgets(spec: CellSpec, prompt_tokens: np.ndarray) -> list[float | None]:
    """Which requests carry a budget (a seeded choice of `budget_share` of them) and how much."""
    rng = np.random.default_rng(spec.seed + 7919)
    chosen = rng.random(len(prompt_tokens)) < spec.budget_share
    price = per_token(spec.budget_price_per_mtok)
    return [float((p + spec.budget_answer_tokens) * price) if c else None
            for p, c in zip(prompt_tokens, chosen, strict=True)]


def slos(spec: CellSpec, n: int) -> list[float | None]:
    """Each request's end-to-end SLO: a seeded draw from the spec's mix."""
    if not spec.slos:
        return [None] * n
    rng = np.random.default_rng(spec.seed + 104729)
    bounds = np.cumsum([share for _, share in spec.slos])
    picks = np.searchsorted(bounds, rng.random(n), side="right")
    return [spec.slos[k][0] if k < len(spec.slos) else None for k in picks]


def named_models(spec: CellSpec, n: int) -> list[str | None]:
    """The model each request names: the spec's one model, or a seeded draw from its mix."""
    if not spec.models:
        return [spec.model] * n
    rng = np.random.default_rng(spec.seed + 32452843)
    picks = np.searchsorted(np.cumsum([w for _, w in spec.models]), rng.random(n), side="right")
    return [spec.models[min(k, len(spec.models) - 1)][0] for k in picks]


def shared_gpus(cfg, spec: CellSpec) -> list[SharedGpu]:
    """Every instance's engine (in the config's world), on a GPU of its own or time-sharing one with those of
    its `gpu_id`."""
    instances = cfg.instances
    events = cfg.scheduler.prefix_cache == "events"  # the engines publish what they cache and evict
    return [SharedGpu({k: Engine(engine_for(cfg, instances[k]), record_events=events) for k in group},
                      {k: load_seconds(instances[k].model, instances[k].gpu_count) for k in group}, spec.host_slots)
            for group in gpu_groups(instances)]


def megas(spec: CellSpec, n: int) -> np.ndarray:
    """Which requests are mega prompts (a seeded choice of `mega_share` of them)."""
    return np.random.default_rng(spec.seed + 15485863).random(n) < spec.mega_share


def run_cell(cfg, evalset: EvalSet, spec: CellSpec, estimators=None) -> CellResult:
    """Simulate one cell. `estimators` (the loaded bundle: KNN index for
    Avengers-style routing, TPOT heads for RouteBalance) may be None for
    policies that need neither."""
    return Simulation(cfg, evalset, spec, estimators).run()


class Replica:
    """One gateway process: its scheduling loop with its pool state and policies, the requests it has on the
    instances, its scrape clock, and the batch it is deciding. A cell runs `spec.replicas` of them."""

    def __init__(self, index: int, scheduling: SchedulingLoop, policy: Policy, first_scrape: float):
        self.index, self.scheduling_loop, self.policy = index, scheduling, policy
        self.in_flight: dict[int, tuple[int, object]] = {}  # rid -> (instance, engine sequence), until seen finished
        self.first_heard: set[int] = set()
        self.next_scrape = first_scrape
        self.busy_until = 0.0  # its scheduler's worker is computing a batch until then
        self.pending: tuple[float, list[Ticket], list] | None = None  # a decided batch: (when it is dispatched, ...)
        self.window = None
        # prompts the others sent, (readable from, instance, blocks), in time order (share_prefixes)
        self.mail: deque[tuple[float, str, tuple[int, ...]]] = deque()

    @property
    def pool_state(self) -> PoolState:
        return self.scheduling_loop.pool_state


class Simulation:
    """One cell: the engines and the requests' fates, shared by the gateway replicas that dispatch to them
    (one unless `spec.replicas` says otherwise; replicas.py for how several share their accounting)."""

    def __init__(self, cfg, evalset: EvalSet, spec: CellSpec, estimators=None):
        self.spec = spec
        # The cell's policy is the default one, so its `order` hook orders the queue as it would live.
        scheduler = dataclasses.replace(cfg.scheduler, policy=spec.policy)
        if spec.prefix_cache is not None:
            scheduler = dataclasses.replace(scheduler, prefix_cache=spec.prefix_cache)
        cfg = self.cfg = dataclasses.replace(cfg, scheduler=scheduler)
        instances = self.instances = cfg.instances
        ev, times, max_tokens, self.prefix, session = _prompts(cfg, evalset, spec)
        self.ev = ev
        named = named_models(spec, len(ev))
        serving = {m: tuple(k for k, inst in enumerate(instances) if m in (None, inst.model)) for m in set(named)}
        if not all(serving.values()):
            raise ValueError(f"no instance serves {[m for m, c in serving.items() if not c]}")
        self.gpus = shared_gpus(cfg, spec)
        if spec.progressive and any(gpu.shared for gpu in self.gpus):
            raise ValueError("progressive cells need a GPU per instance (a shared GPU's step ends are not known "
                             "ahead while its models swap)")
        self.engines = [e for _, e in sorted((k, e) for gpu in self.gpus for k, e in gpu.engines.items())]
        self.down = {k for k, inst in enumerate(instances) if inst.model in spec.down}
        self.scrape_every = cfg.telemetry.scrape_interval_s
        self.shared = SharedState(spec.replicas, spec.sync_interval_s, spec.staleness_s)
        self.replicas = []
        for k in range(spec.replicas):
            # The 429 bound is the live server's concern; each simulated request names its model's instances.
            scheduling = SchedulingLoop(registry, PoolState(), max_queue=1 << 30,
                                  resolve=lambda _cfg, model: serving[model or None], estimators=estimators)
            policy = scheduling.policies(cfg).get(spec.policy)
            if isinstance(policy, Refusal):
                raise ValueError(policy.message)
            # Replicas start at unrelated times: their scrapes are spread over the interval.
            self.replicas.append(Replica(k, scheduling, policy, k * self.scrape_every / spec.replicas))
        policy = self.replicas[0].policy
        self.times = arrival_times(spec.arrivals, len(ev), spec.seed) if times is None else times
        mega = megas(spec, len(ev))
        prompt_tokens = np.where(mega, spec.mega_tokens[0], ev.prompt_tokens)
        self.label_length = np.where(mega[:, None], spec.mega_tokens[1], ev.label_length)
        # Per row: the client requests, then (progressive cells) the expansions of their sketches.
        self.plans = (plan_all(ev.prompts, prompt_tokens, self.label_length, ev.length, instances,
                               cfg.progressive.limits(), cfg.progressive.rule()) if spec.progressive else None)
        self.parent = self.plans.parent if self.plans else np.arange(len(ev))
        self.predicted, self.judged = ev.length, ev.label_score
        self.priors: tuple[np.ndarray, np.ndarray] | None = None  # per instance, for prompts not looked at
        self.embedded = 0  # client prompts embedded for the batch being decided
        if self.plans:
            self.label_length, self.predicted = row_lengths(self.plans, self.label_length, ev.length, instances)
            self.judged = ev.label_score[self.parent]
        budget_of = budgets(spec, prompt_tokens)
        slo_of = slos(spec, len(ev))
        class_of = [slo_class(s, cfg.slo.classes) for s in slo_of]
        self.outcomes = [Outcome(float(t), prompt_tokens=int(prompt_tokens[r]), budget_usd=budget_of[r],
                                 slo_s=slo_of[r], slo_class=class_of[r], tpot_slo_s=spec.tpot_slo_s)
                         for r, t in enumerate(self.times)]
        # As live, a request carries its prompt's blocks to the scheduler only where its policy reads the prefix
        # index; the engines cache by them either way.
        reads = registry.hashes_prompts(spec.policy, cfg.scheduler.prefix_cache)
        self.tickets = [Ticket(RouteRequest(serving[named[r]], ev.prompts[r], int(prompt_tokens[r]), int(max_tokens[r]),
                                            spec.weights, budget_of[r], spec.policy, slo_s=slo_of[r],
                                            tpot_slo_s=spec.tpot_slo_s, slo_class=class_of[r],
                                            prefix=self.prefix[r] if reads else (),
                                            session=session[r]),
                               named[r] or "", streaming=slo_of[r] is None or slo_of[r] < spec.stream_below_s,
                               config=cfg, handle=r) for r in range(len(ev))]
        if self.plans:
            self._progressive_rows(self.plans, serving)
        self.spawned: list[tuple[float, int]] = []  # expansions whose sketch has ended: (arrival, row), a heap
        self.sketching: set[int] = set()  # sketch rows on an instance, not yet seen ending
        self.sequences: dict[int, tuple[int, object]] = {}  # rid -> (instance, engine sequence), every one dispatched
        self.parked: dict[int, int] = {}  # evicted requests whose KV cache waits in an instance's host memory
        self.batches: list[int] = []
        self.ranked_down: list[int] = []
        self.ages: list[float] = []  # per decision with replicas: how old the others' work it counted was
        self.prices_in, self.prices_out = price_arrays(instances)
        self.generated = np.zeros(len(instances))  # cumulative counters, as vLLM exports them
        self.prefilled = np.zeros(len(instances))
        # finished requests' prefill histograms' _count and _sum, and their computed tokens' _sum (core/prefill_rate.py)
        self.prefill_hist = np.zeros((len(instances), 3))
        self.moe = [e.experts is not None for e in self.engines]
        self.experts, self.moe_steps = 0.0, 0  # MoE instances: experts loaded, summed over their steps
        self.warming = policy.overrides("warm") and any(gpu.shared for gpu in self.gpus)
        self.evicting = policy.overrides("evict")

    def _progressive_rows(self, plans: ProgressivePlans, serving: dict) -> None:
        """Progressive requests' sketch tickets (in place of their own) and their expansions' tickets and outcomes
        (arriving when their sketch ends)."""
        cfg, spec, limits = self.cfg, self.spec, plans.limits

        def named(model: str) -> tuple[int, ...]:
            return serving.get(model) or tuple(k for k, inst in enumerate(self.instances) if inst.model == model)

        def ticket(row: int, model: str, prompt_tokens: int, max_tokens: int) -> Ticket:
            request = RouteRequest(named(model), self.ev.prompts[self.parent[row]], prompt_tokens, max_tokens,
                                   spec.weights, None, spec.policy)
            return Ticket(request, model, streaming=False, config=cfg, handle=row)

        for r, plan in plans.plans.items():
            self.outcomes[r].prompt_tokens = plan.sketch_prompt_tokens
            self.tickets[r] = ticket(r, plans.large, plan.sketch_prompt_tokens, limits.sketch_max_tokens)
            for e in plan.expansions:
                self.outcomes.append(Outcome(math.nan, prompt_tokens=plan.expand_prompt_tokens))
                self.tickets.append(ticket(e.row, e.model, plan.expand_prompt_tokens, limits.expansion_max_tokens))

    # ---- the engines --------------------------------------------------------------------------
    def estimate(self, batch: list[Ticket], blind: list[bool]) -> Estimates:
        """The cached estimates of the batch's prompts; a prompt its policy need not look at (`blind`) gets each
        instance's mean over the evaluation set instead, as live it gets the model's priors. Counts the client
        prompts embedded (progressive expansions reuse their question's estimates), for the compute charge."""
        rows = [t.handle for t in batch]
        own = self.parent[rows]
        est = Estimates(self.ev.quality[own], self.predicted[rows], self.ev.embeddings[own])
        self.embedded = sum(1 for t, b in zip(batch, blind, strict=True) if not b and t.handle < len(self.ev))
        if any(blind):
            if self.priors is None:
                self.priors = self.ev.quality.mean(axis=0), self.predicted[:len(self.ev)].mean(axis=0)
            est.quality[blind], est.length[blind] = self.priors
        return est

    def expert_domain(self, rid: int) -> str | None:
        """What an MoE instance routes the request's tokens by: its prompt's kind and text (engine/moe.py)."""
        row = int(self.parent[rid])
        return expert_domain(self.ev.kind(row), self.ev.prompts[row])

    def advance(self, t: float) -> None:
        for gpu in self.gpus:
            for k, report in gpu.advance(t).items():
                self.generated[k] += report.generation_tokens
                self.prefilled[k] += report.prompt_tokens
                for seq in report.finished:
                    if seq.first_token_time is not None and seq.first_scheduled is not None:
                        self.prefill_hist[k] += (1, seq.first_token_time - seq.first_scheduled,
                                                 seq.prompt_tokens - (seq.cached_tokens or 0))
                if self.moe[k]:
                    self.experts += report.experts
                    self.moe_steps += report.steps
        if self.cfg.scheduler.prefix_cache == "events":
            self.publish_cache_events()
        if self.sketching:
            self.sketched(t)

    def publish_cache_events(self) -> None:
        """Every replica reads the engines' KV-cache events as they happen (exact, without delay). The engines'
        hashes are the gateway's own here (one function, one block size), so no re-hashing is needed."""
        for inst, e in zip(self.instances, self.engines, strict=True):
            stored, removed = e.take_cache_events()
            if not (stored or removed):
                continue
            for rep in self.replicas:
                state = rep.pool_state.of(inst.name)
                if state.reported is None:
                    state.reported = ReportedBlocks(REPORTED_SLACK * e.spec.num_gpu_blocks, e.spec.block_size)
                    state.events_ok = True
                # The two lists lose how stores and evictions interleaved: what the cache holds now decides.
                state.reported.index.remove([h for h in removed if h not in e.cache])
                state.reported.index.record([h for h in stored if h in e.cache])

    def warm(self, rep: Replica, t: float) -> None:
        """The policy's warm start: the models it wants in host memory next."""
        wanted = rep.policy.warm()
        for gpu in self.gpus:
            if gpu.shared:
                gpu.warm([k for k in wanted if k in gpu.engines], t)

    # ---- what a replica hears ---------------------------------------------------------------------
    def sync(self, rep: Replica, t: float) -> None:
        """The replica hears first tokens, progress and completions (of a request that does not stream, the
        gateway hears as its relay reads)."""
        scheduling = rep.scheduling_loop
        for rid, (i, seq) in list(rep.in_flight.items()):
            if rid not in rep.first_heard and seq.first_token_time is not None:
                rep.first_heard.add(rid)
                scheduling.first_token(self.tickets[rid], seq.first_token_time)
            if seq.finished:
                scheduling.complete(self.tickets[rid], Completion(True, i, seq.generated), seq.finish_time)
                del rep.in_flight[rid]
            else:
                scheduling.progress(self.tickets[rid], seq.generated, t)

    def scrape(self, rep: Replica, t: float) -> None:
        for k, (inst, e) in enumerate(zip(self.instances, self.engines, strict=True)):
            if k in self.down:
                rep.pool_state.unreachable(inst.name, t, self.cfg.health)  # a scrape that cannot connect is a failure
                continue
            rep.pool_state.of(inst.name).scraped(
                EngineSnapshot(e.num_running, e.num_waiting, e.kv_usage(), self.generated[k], self.prefilled[k],
                               e.spec.num_gpu_blocks, prefills=self.prefill_hist[k, 0],
                               prefill_seconds=self.prefill_hist[k, 1],
                               prefill_computed_tokens=self.prefill_hist[k, 2]), t)

    def tick(self, rep: Replica, t: float) -> None:
        """The replica's sync tick: it publishes its share of the work (as of what it has heard) and reads
        the others'."""
        self.sync(rep, t)
        self.shared.publish(rep.index, rep.pool_state, self.instances, t)
        self.shared.read(rep.index, rep.pool_state, t)
        self.shared.ticked(rep.index)
        self.share_prefixes(rep, t)

    def share_prefixes(self, rep: Replica, t: float) -> None:
        """The prompts the replica sent since its last tick are published, readable by the others `delay_s`
        later, and it reads what the others published that it can see by now, into its approximate index (live:
        state/prefixes.py's Redis stream, written and read at each sync)."""
        outbox = rep.pool_state.sent_outbox
        while outbox:
            name, prefix = outbox.popleft()
            for other in self.replicas:
                if other is not rep:
                    other.mail.append((t + self.shared.delay_s, name, prefix))
        bound = self.cfg.scheduler.prefix_index_max_blocks
        while rep.mail and rep.mail[0][0] <= t:
            _, name, prefix = rep.mail.popleft()
            rep.pool_state.sent_prompt(name, prefix, bound, by_peer=True)

    def look(self, rep: Replica, t: float) -> None:
        """Before a decision: with instant sharing, the replica reads every other one's work as it is now."""
        if not self.shared.instant:
            return
        for other in self.replicas:
            if other is not rep:
                self.sync(other, t)
                self.shared.publish(other.index, other.pool_state, self.instances, t)
                self.share_prefixes(other, t)
        self.share_prefixes(rep, t)
        self.shared.read(rep.index, rep.pool_state, t)

    # ---- what a replica does -------------------------------------------------------------------------
    def view(self, rep: Replica, t: float) -> PoolView:
        """The pool as the replica sees it when it decides a batch."""
        return rep.scheduling_loop.view(self.cfg, t)

    def fire(self, rep: Replica, t: float, window) -> tuple[float, list[Ticket], list]:
        scheduling, cfg = rep.scheduling_loop, self.cfg
        batch, _ = scheduling.take(cfg, window, t)
        self.batches.append(len(batch))
        if self.shared.mode != "single":
            self.ages.append(self.shared.age(rep.index, t))
        self.embedded = 0
        decided = scheduling.decide(cfg, batch, self.view(rep, t), self.estimate)
        for ticket, (d, _) in zip(batch, decided, strict=True):
            if d.ranked and d.ranked[0] in self.down:
                self.ranked_down.append(ticket.handle)  # the policy put a known-down instance first
        compute = self.ev.cost.estimate_s(self.embedded) if self.embedded else 0.0
        compute += rep.policy.compute_s(len(batch), self.ev.cost)
        return t + compute, batch, decided

    def pay_prompt(self, rid: int, i: int) -> None:
        """Instance i read the request's prompt for an attempt that gave no answer: paid, as live."""
        out = self.outcomes[rid]
        out.cost_usd += float(predicted_cost(out.prompt_tokens, 0, self.prices_in[i], self.prices_out[i]))

    def unpark(self, rid: int, i: int) -> None:
        """An evicted request's kept KV cache is dropped: its prompt was read for nothing."""
        self.engines[i].drop_swapped(rid)
        self.pay_prompt(rid, i)

    def dispatch(self, rep: Replica, t: float, decided: list[Ticket]) -> None:
        """Send decided requests to their engines; a refused one is answered at once."""
        scheduling, engines = rep.scheduling_loop, self.engines
        for ticket in decided:
            rid, out = ticket.handle, self.outcomes[ticket.handle]
            # A down instance refuses the connection: the next plan is tried, as live.
            refused = ticket.decision is None or ticket.decision.refused is not None
            plan = None
            for p in () if refused else scheduling.plans(ticket, t):
                if p.instance not in self.down:
                    plan = p
                    break
                scheduling.attempt_failed(ticket, p, t, unreachable=True)
            if plan is None:
                out.finished = t  # refused: answered at once with an error
                scheduling.complete(ticket, Completion(False, None), t)
                continue
            scheduling.dispatched(ticket, plan, t)
            i = plan.instance
            label = int(self.label_length[rid, i])
            out.instance, out.dispatched = i, t
            out.quality = float(self.judged[rid, i])
            asked = self.tickets[rid].request.max_tokens or label
            out.budget_cut = out.budget_usd is not None and plan.max_tokens < min(label, asked)
            held_on = self.parked.pop(rid, None)
            if held_on == i:  # its KV cache waits in i's host memory: it resumes
                seq = engines[i].swap_in(rid, t)
            else:
                if held_on is not None:
                    self.unpark(rid, held_on)
                seq = engines[i].add(rid, prompt_tokens=out.prompt_tokens, max_tokens=plan.max_tokens,
                                     output_tokens=label, now=t, domain=self.expert_domain(rid),
                                     prefix=self.prefix[rid] if rid < len(self.prefix) else ())
            rep.in_flight[rid] = self.sequences[rid] = (i, seq)
            if self.plans and rid in self.plans.plans:
                self.sketching.add(rid)

    def evict(self, rep: Replica, t: float) -> None:
        """Requests the policy evicts: aborted on their engine (the work is lost), or swapped out to its host
        memory when the policy keeps their state; either way held again."""
        for ticket in rep.scheduling_loop.evictions(self.cfg, t):
            rid = ticket.handle
            i, seq = rep.in_flight.pop(rid)
            del self.sequences[rid]
            self.sketching.discard(rid)
            rep.first_heard.discard(rid)
            out = self.outcomes[rid]
            out.instance, out.evictions = -1, out.evictions + 1
            if rep.policy.keeps_state(ticket, i) and self.engines[i].swap_out(rid, t) is not None:
                self.parked[rid] = i
            else:
                self.engines[i].abort(rid, t)
                self.pay_prompt(rid, i)
            rep.scheduling_loop.requeue(ticket, t)

    # ---- the event loop ------------------------------------------------------------------------------
    def run(self) -> CellResult:
        """Every event in time order, one at a time. Each replica's live loop re-reads the window rule when a
        request arrives, when a batch has been dispatched, and when the window it sleeps on ends; not on
        scrapes. Held requests are asked again after every event (live: every completion and scrape). At
        one instant: scrapes, then sync ticks, dispatches, the arrival, and batches firing; replicas in
        order."""
        cfg, replicas, times = self.cfg, self.replicas, self.times
        next_arrival = 0
        clock = 0.0
        for rep in replicas:
            rep.window = rep.scheduling_loop.limit(cfg, 0.0)
        while True:
            for rep in replicas:
                if rep.scheduling_loop.held or self.evicting:
                    self.advance(clock)
                    self.sync(rep, clock)
                    self.look(rep, clock)
                    if self.evicting:
                        self.evict(rep, clock)
                    self.dispatch(rep, clock, rep.scheduling_loop.release_held(clock))
                    if self.warming:
                        self.warm(rep, clock)
            t_arrival, row = times[next_arrival] if next_arrival < len(times) else math.inf, next_arrival
            if self.spawned and self.spawned[0] < (t_arrival, row):
                t_arrival, row = self.spawned[0]  # an expansion: to its request's replica
            work = [(t_arrival, _ARRIVAL, replica_of(int(self.parent[row]) if row < len(self.parent) else row,
                                                     len(replicas)))]
            if self.sketching:
                work.append((self.sketch_end(), _SKETCHED, 0))
            for rep in replicas:
                at = rep.scheduling_loop.fire_at(rep.window, clock) if rep.pending is None else None
                work += [(rep.pending[0] if rep.pending is not None else math.inf, _DISPATCH, rep.index),
                         (math.inf if at is None else max(rep.busy_until, at), _FIRE, rep.index)]
            t_next, kind, k = min(work)
            if math.isinf(t_next) and not self._waiting_for_room():
                break  # everything is on an instance (or held with nothing left to free room): the rest is decoding
            clocks = [(r.next_scrape, _SCRAPE, r.index) for r in replicas]
            clocks += [(at, _TICK, j) for j, at in enumerate(self.shared.next_tick)]
            when, what, j = min(clocks)
            if when <= t_next:
                clock, rep = when, replicas[j]
                self.advance(clock)
                if what == _SCRAPE:
                    self.scrape(rep, clock)
                    rep.next_scrape += self.scrape_every
                else:
                    self.tick(rep, clock)
                continue
            clock, rep = t_next, replicas[k]
            if kind == _DISPATCH:
                self.advance(clock)
                if rep.policy.overrides("hold"):
                    self.sync(rep, clock)  # `hold` judges the pool as it is now
                self.look(rep, clock)
                _, batch, decided = rep.pending
                self.dispatch(rep, clock, rep.scheduling_loop.settle(batch, decided, clock))
                rep.pending = None
                rep.window = rep.scheduling_loop.limit(cfg, clock)
            elif kind == _ARRIVAL:
                if row < len(self.ev):  # a client request (rows past them are expansions)
                    next_arrival += 1
                else:
                    heapq.heappop(self.spawned)
                rep.scheduling_loop.submit(self.tickets[row], clock)
                rep.window = rep.scheduling_loop.limit(cfg, clock)
            elif kind == _SKETCHED:
                self.advance(clock)  # which sends the expansions of the sketches that ended
            else:
                if rep.window is not None:
                    rep.window = rep.scheduling_loop.limit(cfg, clock)
                    if not rep.scheduling_loop.queue.ready(rep.window, clock):
                        continue  # the rule now asks for a longer window: sleep on
                self.advance(clock)
                self.sync(rep, clock)
                self.look(rep, clock)
                rep.busy_until, batch, decided = self.fire(rep, clock, rep.window)
                rep.pending = (rep.busy_until, batch, decided)
        for rep in replicas:
            for ticket in list(rep.scheduling_loop.held):  # held when nothing was left to free room: refused
                self.outcomes[ticket.handle].finished = clock
                rep.scheduling_loop.withdraw(ticket, clock)
                if ticket.handle in self.parked:
                    self.unpark(ticket.handle, self.parked.pop(ticket.handle))
        self.advance(math.inf)
        for rid, (_, seq) in self.sequences.items():
            _record(self.outcomes[rid], seq)
        ages = [a for a in self.ages if not math.isnan(a)]
        outcomes = _costed(self.outcomes, self.prices_in, self.prices_out)
        if self.plans:
            outcomes = fold(self.plans, outcomes)
        return CellResult(self.spec, tuple(outcomes),
                          tuple(i.model for i in self.instances), tuple(self.batches), tuple(self.ranked_down),
                          *_swaps(self.gpus), info_age_s=sum(ages) / len(ages) if ages else math.nan,
                          experts_per_step=self.experts / self.moe_steps if self.moe_steps else math.nan)

    # ---- progressive requests (sim/progressive.py) ---------------------------------------------------
    def sketch_end(self) -> float:
        """The next step end of an instance running a sketch: when one may end."""
        ends = [self.engines[i].next_step_end() for i in {self.sequences[r][0] for r in self.sketching}]
        return min((e for e in ends if e is not None), default=math.inf)

    def sketched(self, t: float) -> None:
        """Sketches that have ended by `t` send their expansions, arriving as they ended (never before `t`, the
        time the driver has reached: a step-end event sees them end at once; an end that another event's
        advance ran past is sent then)."""
        assert self.plans is not None
        for r in list(self.sketching):  # the heap orders what they send by (arrival, row)
            _, seq = self.sequences[r]
            if seq.finished:
                self.sketching.discard(r)
                at = seq.finish_time if math.isinf(t) else max(seq.finish_time, t)
                for e in self.plans.plans[r].expansions:
                    self.outcomes[e.row].arrival = at
                    heapq.heappush(self.spawned, (at, e.row))

    def _waiting_for_room(self) -> bool:
        """Requests are held in a replica while some are still running on the instances (whose end may free
        the room they wait for)."""
        return (any(rep.scheduling_loop.held for rep in self.replicas)
                and any(not seq.finished for rep in self.replicas for _, seq in rep.in_flight.values()))


# Which event goes first at one instant (the lower); scrapes and sync ticks before the rest.
_SCRAPE, _TICK, _DISPATCH, _SKETCHED, _ARRIVAL, _FIRE = range(6)


def _swaps(gpus: list[SharedGpu]) -> tuple[float, float]:
    shared = [g for g in gpus if g.shared]
    if not shared:
        return math.nan, math.nan
    return float(sum(g.swaps for g in shared)), sum(g.swap_s for g in shared)


def _prompts(cfg, evalset: EvalSet, spec: CellSpec) -> tuple[EvalSet, np.ndarray | None, np.ndarray, tuple, tuple]:
    """The cell's prompts: (their evaluation rows, arrival times or None for the spec's process, each one's
    max_tokens, each one's chained block hashes, each one's session or None)."""
    block = cfg.scheduler.prefix_block_tokens
    if any(engine_for(cfg, inst).block_size != block for inst in cfg.instances):
        raise ValueError(f"[scheduler] prefix_block_tokens ({block}) must be the engines' block size to simulate")
    cap = spec.answer_cap if spec.answer_cap is not None else np.iinfo(np.int64).max
    if spec.prefixed is None:
        ev = evalset.take(spec.requests)
        return (ev, None, np.full(len(ev), min(spec.max_tokens, cap)), _prompt_blocks(ev.prompts, block),
                (None,) * len(ev))
    window = min(inst.max_model_len for inst in cfg.instances)
    rows = prefixed_rows(spec.prefixed, spec.requests, spec.arrivals.rate, spec.seed, block, window)
    ev = evalset.rows(rows.borrowed % len(evalset))
    own = rows.output_tokens >= 0  # the trace's own answer length, on every model
    max_tokens = np.minimum(rows.max_tokens, cap)
    lengths = np.where(own[:, None], np.minimum(rows.output_tokens, max_tokens)[:, None], ev.label_length)
    ev = dataclasses.replace(ev, prompt_tokens=rows.prompt_tokens, label_length=lengths)
    return ev, rows.times, max_tokens, rows.prefix, rows.session


@functools.lru_cache(maxsize=4)  # the held-out prompts are the same in every cell of a sweep
def _prompt_blocks(prompts: tuple[str, ...], block: int) -> tuple[tuple[int, ...], ...]:
    """Each held-out prompt's blocks, from its real tokens as one user turn through the chat template (what
    the gateway hashes live): only the template's default system turn is shared, so little hits."""
    from gateway.tokens import TokenCounter

    counter = TokenCounter()
    ids = [counter.chat_ids([{"role": "user", "content": p}]) for p in prompts]
    return tuple(block_hashes(x, block) if x is not None else () for x in ids)


def _record(out: Outcome, seq) -> None:
    out.cached_tokens = seq.cached_tokens or 0
    out.first_token = seq.first_token_time if seq.first_token_time is not None else math.nan
    out.finished = seq.finish_time
    out.completion_tokens = seq.generated
    if out.budget_cut:
        # An answer the budget cut short is an exhausted request: it scores nothing (no partial
        # credit for the part that arrived), like a refused one.
        out.quality = 0.0


def _costed(outcomes: list[Outcome], prices_in, prices_out) -> list[Outcome]:
    for out in outcomes:
        if out.instance >= 0:  # on top of what its evicted attempts cost
            out.cost_usd += float(predicted_cost(out.prompt_tokens, out.completion_tokens, prices_in[out.instance],
                                                prices_out[out.instance]))
    return outcomes


def with_batching(cfg, **changes):
    """The config with [batching] fields changed (for the batching ablations)."""
    return dataclasses.replace(cfg, batching=dataclasses.replace(cfg.batching, **changes))
