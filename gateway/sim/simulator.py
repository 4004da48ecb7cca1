"""Discrete-event simulation of the gateway over the pool, in virtual time.

One cell replays an evaluation set at some arrival process through the
gateway's own scheduling core, on the engine model the emulator serves from:

- batching: `scheduling.batcher` (eager or the paper's window rule, the
  config's [batching]);
- the view of the pool: `scheduling.instance_view.PoolAccounting`, fed by
  scrapes of each engine every `scrape_interval_s` and by the requests the
  scheduler dispatched, their streamed progress included;
- decisions: the policy objects the live server builds (`make_policy`), on
  the cached estimates of the batch's prompts (the estimators are
  deterministic per prompt, so computing them once changes no decision);
- dispatch: the budget clamp of `scheduling.budget`, down the ranked list;
- instances: `engine.Engine`, answering each prompt at its labelled length for
  the model that serves it.

The scheduler is one worker, as live: a batch's compute (ComputeCost, timed
from the real estimators) passes in virtual time before its requests reach
their instances, and the next batch cannot fire before that. Nothing reads a
clock and every random choice comes from the seed, so a cell repeats exactly.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from gateway.engine.engine import Engine
from gateway.engine.profiles import spec_for_instance
from gateway.scheduling.batcher import BatchQueue, batch_limit, busy_share
from gateway.scheduling.budget import clamp_max_tokens, per_token
from gateway.scheduling.instance_view import PoolAccounting
from gateway.scheduling.policies import make_policy, score_options
from gateway.scheduling.policy import Estimates, RouteRequest
from gateway.sim.arrivals import ArrivalSpec, arrival_times
from gateway.sim.evalset import EvalSet
from gateway.telemetry import EngineSnapshot

PIPELINE_SCORE_S = 0.0002  # a pipeline router's choice per batch: a centroid search or an argmax
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
    label_tokens: int = 0  # the whole answer the model would give
    quality: float = 0.0  # judged quality of what was served
    cost_usd: float = 0.0
    budget_usd: float | None = None
    budget_cut: bool = False  # the budget clamp ended the answer before the model would have


@dataclass(frozen=True, slots=True)
class CellResult:
    spec: CellSpec
    outcomes: tuple[Outcome, ...]
    models: tuple[str, ...]  # model of each instance, in config order
    batches: tuple[int, ...]  # size of each batch the scheduler fired
    ranked_down: tuple[int, ...] = ()  # requests whose decision put a down instance first


def budgets(spec: CellSpec, prompt_tokens: np.ndarray) -> list[float | None]:
    """Which requests carry a budget (a seeded choice of `budget_share` of them) and how much."""
    rng = np.random.default_rng(spec.seed + 7919)
    chosen = rng.random(len(prompt_tokens)) < spec.budget_share
    price = per_token(spec.budget_price_per_mtok)
    return [float((p + spec.budget_answer_tokens) * price) if c else None for p, c in zip(prompt_tokens, chosen)]


def run_cell(cfg, evalset: EvalSet, spec: CellSpec, estimators=None) -> CellResult:
    """Simulate one cell. `estimators` (the loaded bundle: KNN index for
    Avengers-style routing, TPOT heads for RouteBalance) may be None for
    policies that need neither."""
    ev = evalset.take(spec.requests)
    instances = cfg.instances
    n_inst = len(instances)
    policy = make_policy(spec.policy, cfg, estimators)  # the live server's own policy object
    engines = [Engine(spec_for_instance(i)) for i in instances]
    down = {k for k, inst in enumerate(instances) if inst.model in spec.down}
    accounting = PoolAccounting()
    stale = cfg.telemetry.stale_after_s
    queue: BatchQueue[int] = BatchQueue(max_queue=1 << 30)  # the 429 bound is the live server's concern
    times = arrival_times(spec.arrivals, len(ev), spec.seed)
    budget_of = budgets(spec, ev.prompt_tokens)
    outcomes = [Outcome(float(t), prompt_tokens=int(ev.prompt_tokens[r]), budget_usd=budget_of[r])
                for r, t in enumerate(times)]
    everyone = tuple(k for k, inst in enumerate(instances) if spec.model in (None, inst.model))
    if not everyone:
        raise ValueError(f"no instance serves {spec.model!r}")
    in_flight: dict[int, tuple[int, object]] = {}  # rid -> (instance, engine sequence), until seen finished
    batches: list[int] = []
    ranked_down: list[int] = []
    heads = score_options(cfg).uses_heads  # scoring with the heads costs more compute

    prices_in = np.array([per_token(i.price_input_per_mtok) for i in instances])
    prices_out = np.array([per_token(i.price_output_per_mtok) for i in instances])
    scrape_every = cfg.telemetry.scrape_interval_s
    rules, mode = cfg.batching.rules, cfg.batching.mode
    largest = max(rule.size for rule in rules)

    next_arrival = 0
    next_scrape = 0.0
    busy_until = 0.0  # the scheduler's worker is computing a batch until then
    pending: tuple[float, list[tuple[int, int, int]]] | None = None  # (when, [(rid, instance, max_tokens)])
    clock = 0.0
    generated = np.zeros(n_inst)  # cumulative counters, as vLLM exports them
    prefilled = np.zeros(n_inst)

    def advance(t: float) -> None:
        for k, e in enumerate(engines):
            report = e.advance(t)
            generated[k] += report.generation_tokens
            prefilled[k] += report.prompt_tokens

    def sync() -> None:
        """The gateway's accounting hears streamed progress and completions (every request streams)."""
        for rid, (i, seq) in list(in_flight.items()):
            state = accounting.of(instances[i].name)
            if seq.finished:
                state.done(rid)
                del in_flight[rid]
            else:
                state.streamed(rid, seq.generated)

    def scrape(t: float) -> None:
        for k, (inst, e) in enumerate(zip(instances, engines)):
            if k in down:
                accounting.mark_down(inst.name, t)  # a scrape that cannot connect marks the instance down
                continue
            accounting.of(inst.name).scraped(
                EngineSnapshot(e.num_running, e.num_waiting, e.kv_usage(), generated[k], prefilled[k]), t)

    def current_limit(t: float):
        return batch_limit(rules, busy_share(accounting.waiting(instances, t, stale)))

    def fire_time() -> float:
        """When the scheduler fires its next batch, given what is queued now (inf: not yet)."""
        if not queue or pending is not None:
            return math.inf
        if mode == "eager":
            return max(busy_until, clock)
        # A window that closed while the worker was busy fires now, not in the past.
        return max(busy_until, clock, clock if len(queue) >= window.size else queue.closes_at(window))

    def fire(t: float) -> tuple[float, list[tuple[int, int, int]]]:
        rids = [rid for _, rid in queue.take(largest if mode == "eager" else window.size)]
        batches.append(len(rids))
        view = accounting.snapshot(instances, t, stale)
        requests = [RouteRequest(everyone, ev.prompts[r], int(ev.prompt_tokens[r]), DEFAULT_MAX_TOKENS,
                                 spec.weights, budget_of[r], spec.policy) for r in rids]
        est = Estimates(ev.quality[rids], ev.length[rids], ev.embeddings[rids]) if policy.needs_estimates else None
        decisions = policy.assign(requests, est, view)
        compute = ev.cost.estimate_s(len(rids)) if policy.needs_estimates else 0.0
        compute += ev.cost.score_s(len(rids), heads) if spec.policy == "routebalance" else PIPELINE_SCORE_S
        done_at = t + compute
        placed = []
        for rid, req, d in zip(rids, requests, decisions, strict=True):
            if d.ranked and d.ranked[0] in down:
                ranked_down.append(rid)  # the policy put a known-down instance first
            target = _dispatch_target(d.ranked, req, prices_in, prices_out, down)
            if target is None:
                outcomes[rid].finished = done_at  # refused: answered at once with an error
                continue
            i, max_tokens = target
            accounting.of(instances[i].name).dispatched(rid, req.input_tokens, d.tokens or 0.0, done_at, True)
            placed.append((rid, i, max_tokens))
        return done_at, placed

    def dispatch(t: float, placed) -> None:
        for rid, i, max_tokens in placed:
            out = outcomes[rid]
            label = int(ev.label_length[rid, i])
            out.instance, out.dispatched, out.label_tokens = i, t, label
            out.quality = float(ev.label_score[rid, i])
            out.budget_cut = out.budget_usd is not None and max_tokens < min(label, DEFAULT_MAX_TOKENS)
            seq = engines[i].add(rid, prompt_tokens=out.prompt_tokens, max_tokens=max_tokens,
                                 output_tokens=label, now=t)
            in_flight[rid] = sequences[rid] = (i, seq)

    # The live loop re-reads the window rule when a request arrives, when a batch
    # has been dispatched, and when the window it sleeps on ends; not on scrapes.
    window = current_limit(0.0)
    sequences: dict[int, tuple[int, object]] = {}
    while True:
        t_arrival = times[next_arrival] if next_arrival < len(times) else math.inf
        t_dispatch = pending[0] if pending is not None else math.inf
        t_next = min(t_arrival, t_dispatch, fire_time())
        if math.isinf(t_next):
            break  # everything is on an instance: the rest is decoding
        if next_scrape <= t_next:
            clock = next_scrape
            advance(clock)
            scrape(clock)
            next_scrape += scrape_every
            continue
        clock = t_next
        if clock == t_dispatch:
            advance(clock)
            dispatch(clock, pending[1])
            pending = None
            window = current_limit(clock)
        elif clock == t_arrival:
            queue.push(next_arrival, clock)
            next_arrival += 1
            window = current_limit(clock)
        else:
            if mode == "window":
                window = current_limit(clock)
                if not queue.ready(window, clock):
                    continue  # the rule now asks for a longer window: sleep on
            advance(clock)
            sync()
            busy_until, placed = fire(clock)
            pending = (busy_until, placed)
    for e in engines:
        e.advance(math.inf)
    for rid, (_, seq) in sequences.items():
        _record(outcomes[rid], seq)
    return CellResult(spec, tuple(_costed(outcomes, prices_in, prices_out)), tuple(i.model for i in instances),
                      tuple(batches), tuple(ranked_down))


def _dispatch_target(ranked, req: RouteRequest, prices_in, prices_out, down: set[int]):
    """(instance, max_tokens) as the live shell picks it: the first ranked instance
    that is up and whose prices leave the budget at least one answer token."""
    for i in ranked:
        if i in down:
            continue
        max_tokens = req.max_tokens
        if req.budget_usd is not None:
            max_tokens = clamp_max_tokens(req.budget_usd, req.input_tokens, prices_in[i], prices_out[i], req.max_tokens)
            if max_tokens is None:
                continue
        return i, max_tokens
    return None


def _record(out: Outcome, seq) -> None:
    out.first_token = seq.first_token_time if seq.first_token_time is not None else math.nan
    out.finished = seq.finish_time
    out.completion_tokens = seq.generated
    if out.budget_cut and out.label_tokens:
        # A truncated answer is judged on what it says: in proportion to how much of it arrived.
        out.quality *= min(1.0, seq.generated / out.label_tokens)


def _costed(outcomes: list[Outcome], prices_in, prices_out) -> list[Outcome]:
    for out in outcomes:
        if out.instance >= 0:
            out.cost_usd = float(out.prompt_tokens * prices_in[out.instance]
                                 + out.completion_tokens * prices_out[out.instance])
    return outcomes


def with_batching(cfg, **changes):
    """The config with [batching] fields changed (for the batching ablations)."""
    return dataclasses.replace(cfg, batching=dataclasses.replace(cfg.batching, **changes))


def with_scheduler(cfg, **changes):
    """The config with [scheduler] fields changed (isolation arms, LPT off, filter off)."""
    return dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, **changes))


def with_pipeline(cfg, **changes):
    """The config with [scheduler.pipeline] knobs changed (Avengers' weight, BEST-Route's threshold)."""
    return with_scheduler(cfg, pipeline=dataclasses.replace(cfg.scheduler.pipeline, **changes))
