"""The live driver of the scheduling loop (core/loop.py): asyncio, real time, one worker thread.

Handlers `await decide(...)` and hand the ticket to `complete` when the
request ends. One task fires batches as the loop's batch rule allows and
hands each to a single worker thread, which estimates the whole batch once
and runs the policies over a snapshot of the pool. The event loop never
waits on that work. Before a request is handed back it is booked in the
pool state on its first dispatch plan, so the next batch's snapshot
already counts it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.api.errors import ApiError
from gateway.config.sections import Config, Instance
from gateway.config.store import ConfigStore
from gateway.core.loop import Decided, SchedulingLoop
from gateway.core.pool_state import InstanceState, PoolState
from gateway.core.request import Completion, Decision, DispatchPlan, Refusal, RouteRequest, Ticket
from gateway.core.view import PoolView
from gateway.policies import registry
from gateway.serving.explore import Explorer
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.workers import SINGLE, Worker

if TYPE_CHECKING:
    from gateway.serving.tracing import RequestTrace

log = logging.getLogger("routebalance.scheduler")


@dataclass(slots=True)
class BatchTimings:
    estimate_s: float = 0.0
    score_s: float = 0.0
    estimated_at_ns: int = 0  # wall clock (ns since the epoch) when the estimate began, for its trace span
    estimated: Sequence[Ticket] = ()  # the tickets the estimate was for


def refusal_error(refused: Refusal) -> ApiError:
    return ApiError(refused.status, refused.message, refused.param, refused.code, final=refused.final)


def candidates_for(cfg: Config, model: str) -> tuple[int, ...]:
    """Instances a request may use: all for a routing alias, else those serving the named model."""
    if model in cfg.server.aliases:
        return tuple(range(len(cfg.instances)))
    found = tuple(i for i, inst in enumerate(cfg.instances) if inst.model == model)
    if not found and model in cfg.embedding_models():
        raise ApiError(400, f"'{model}' is an embedding model: it serves POST /v1/embeddings only", "model",
                       "model_not_supported")
    if not found:
        known = ", ".join((*cfg.server.aliases, *cfg.models()))
        raise ApiError(404, f"The model '{model}' does not exist; available: {known}", "model", "model_not_found")
    return found


class Scheduler:
    def __init__(self, store: ConfigStore, pool_state: PoolState, metrics: GatewayMetrics, estimators,
                 worker: Worker = SINGLE):
        self.store = store
        self.metrics = metrics
        self.worker = worker  # exploration's daily spend cap is the host's: this process takes its part
        self.estimators = estimators  # estimators.bundle.Estimators, or None if not built
        self.explorer = Explorer()  # used by the worker thread only
        self.scheduling_loop = SchedulingLoop(registry, pool_state, store.current.batching.max_queue, candidates_for,
                                              estimators)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="scheduler")
        self.wakeup = asyncio.Event()
        self.task: asyncio.Task | None = None
        self._aborts: dict[Ticket, Callable[[], bool]] = {}  # dispatched tickets -> abort their attempt
        self._traced: dict[Ticket, RequestTrace] = {}  # traced tickets waiting for their decision
        store.subscribe(self._on_config)

    def _on_config(self, cfg: Config) -> None:
        self.scheduling_loop.queue.max_queue = cfg.batching.max_queue

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def decide(self, request: RouteRequest, model: str, streaming: bool, config: Config,
                     trace: RequestTrace | None = None) -> Ticket:
        """Queue the request for the next batch and wait for its decision (429 if the queue is full,
        503 if no decision came within `batching.max_wait_s`, the time a held request waits included).
        A traced request's span gets its batch's estimate as a child.

        The caller must hand the returned ticket to `complete` when the request ends,
        refused or served."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(request, model, streaming, config, handle=loop.create_future())
        if not self.scheduling_loop.submit(ticket, loop.time()):
            self.metrics.rejected.labels("queue_full").inc()
            waiting = self.scheduling_loop.queue.max_queue
            raise ApiError(429, f"the gateway has {waiting} requests waiting to be scheduled; "
                                "retry shortly", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.wakeup.set()
        if trace is None:
            await self._released(ticket, config, "")
            return ticket
        self._traced[ticket] = trace
        try:
            await self._released(ticket, config, "")
        finally:
            del self._traced[ticket]
        return ticket

    async def _released(self, ticket: Ticket, config: Config, again: str) -> None:
        """Wait for the ticket's (re)release, bounded in time as in count: under overload a request is
        shed (503), not left to its client's timeout. A client that leaves, or a batch that fails,
        undoes whatever was booked or held."""
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(config.batching.max_wait_s):  # not wait_for: it may swallow a cancellation
                await ticket.handle
        except TimeoutError:
            self.scheduling_loop.withdraw(ticket, loop.time())
            self.metrics.rejected.labels("overloaded").inc()
            raise ApiError(503, f"the gateway could not schedule the request{again} within "
                                f"{config.batching.max_wait_s:g} s; retry shortly",
                           code="overloaded", headers={"Retry-After": "1"}) from None
        except BaseException:
            self.scheduling_loop.withdraw(ticket, loop.time())
            raise

    def complete(self, ticket: Ticket, completion: Completion) -> None:
        """The request is over: out of the pool state; a held request may now go."""
        self.scheduling_loop.complete(ticket, completion, asyncio.get_running_loop().time())
        if self.scheduling_loop.held:
            self.wakeup.set()

    # ---- a decided call's attempts (gateway/serving/dispatch.py) ------------------------------------------
    def plan(self, ticket: Ticket, i: int, budget_usd: float | None) -> DispatchPlan | None:
        """The attempt on ranked instance `i` with `budget_usd` to spend (None: not routable, or unaffordable)."""
        return self.scheduling_loop.attempt_plan(ticket, i, asyncio.get_running_loop().time(), budget_usd)

    def dispatched(self, ticket: Ticket, plan: DispatchPlan) -> None:
        self.scheduling_loop.dispatched(ticket, plan, asyncio.get_running_loop().time())

    def attempt_succeeded(self, ticket: Ticket, plan: DispatchPlan) -> None:
        self.scheduling_loop.attempt_succeeded(ticket, plan)

    def attempt_failed(self, ticket: Ticket, plan: DispatchPlan, unreachable: bool = False) -> None:
        self.scheduling_loop.attempt_failed(ticket, plan, asyncio.get_running_loop().time(), unreachable)

    def first_token(self, ticket: Ticket) -> None:
        self.scheduling_loop.first_token(ticket, asyncio.get_running_loop().time())

    def progress(self, ticket: Ticket, tokens: int) -> None:
        self.scheduling_loop.progress(ticket, tokens, asyncio.get_running_loop().time())

    # ---- what the pool looks like to a handler -------------------------------------------------------------
    def routable(self, name: str) -> bool:
        """The instance is not cooling down after failures."""
        return self.scheduling_loop.pool_state.routable(name, asyncio.get_running_loop().time())

    def routable_instances(self, cfg: Config) -> list[Instance]:
        now = asyncio.get_running_loop().time()
        return [inst for inst in cfg.instances if self.scheduling_loop.pool_state.routable(inst.name, now)]

    def in_flight(self, name: str) -> int:
        """The gateway's requests on the instance now."""
        return len(self.scheduling_loop.pool_state.of(name).in_flight)

    def instance_states(self, cfg: Config) -> list[tuple[Instance, InstanceState]]:
        """Each instance of the config with what the gateway knows of it (read only)."""
        return [(inst, self.scheduling_loop.pool_state.of(inst.name)) for inst in cfg.instances]

    def no_healthy_instance(self, cfg: Config, ranked, model: str) -> ApiError:
        """503 for a request whose every ranked instance is cooling down, with when the first comes back."""
        now = asyncio.get_running_loop().time()
        pool = self.scheduling_loop.pool_state
        wait = min(pool.of(cfg.instances[i].name).cooling_until - now for i in ranked) if ranked else 1
        return ApiError(503, f"every instance that could serve {model!r} is cooling down after failures; retry shortly",
                        None, "no_healthy_instance", headers={"Retry-After": str(max(1, round(wait + 0.5)))})

    def evictable(self, ticket: Ticket, abort: Callable[[], bool] | None) -> None:
        """How to abort the ticket's running attempt (None: it has none): abort() is False when it
        is too late (the client has bytes of the answer)."""
        if abort is None:
            self._aborts.pop(ticket, None)
        else:
            self._aborts[ticket] = abort

    async def redecided(self, ticket: Ticket, config: Config) -> None:
        """Wait until an evicted request is released again (503 after `batching.max_wait_s`)."""
        await self._released(ticket, config, " again after evicting it")
        refused = ticket.decision.refused if ticket.decision else None
        if refused is not None:
            raise refusal_error(refused)

    def _evict(self, cfg: Config, now: float) -> None:
        """Abort the attempts the policies evict; each request waits in the gateway to go again."""
        for ticket in self.scheduling_loop.evictions(cfg, now):
            abort = self._aborts.pop(ticket, None)
            if abort is None:
                continue
            ticket.handle = asyncio.get_running_loop().create_future()  # before abort: its release may come first
            if abort():
                self.scheduling_loop.requeue(ticket, now)
            else:
                ticket.handle.set_result(None)  # too late: it goes on where it is

    def warm_up(self, request: RouteRequest) -> Refusal | None:
        """Build the serving policy and make one decision before serving, so the first requests
        do not pay for lazy loading. The decision runs on a scratch loop: the policies that serve
        keep no trace of it (a round robin's turn, say)."""
        cfg = self.store.current
        for name in _configured_policies(cfg):
            self.scheduling_loop.policies(cfg).get(name)
        scratch = SchedulingLoop(registry, PoolState(), 1, self.scheduling_loop.resolve, self.estimators)
        [(decision, _)], _ = self.decide_now(cfg, [Ticket(request, "", False, cfg)], scratch.view(cfg, 0.0), scratch)
        return decision.refused

    # ---- the batch loop --------------------------------------------------------
    async def _run(self) -> None:
        while True:
            try:
                await self._step()
            except Exception:  # the loop must outlive any failure: log it, pause a moment, go on
                log.exception("a scheduling step failed")
                await asyncio.sleep(0.01)

    async def _step(self) -> None:
        loop = asyncio.get_running_loop()
        cfg = self.store.current
        now = loop.time()
        if self._aborts:
            self._evict(cfg, now)
        for ticket in self.scheduling_loop.release_held(now):
            _wake(ticket)
        limit = self.scheduling_loop.limit(cfg, now)
        at = self.scheduling_loop.fire_at(limit, now)
        if at is None or at > now:
            # Held requests are asked again when a request completes or a scrape may have freed room.
            poll = cfg.telemetry.scrape_interval_s if self.scheduling_loop.held else None
            delays = [d for d in (poll, None if at is None else at - now) if d is not None]
            await self._sleep(min(delays) if delays else None)
            return
        policies = self.scheduling_loop.policies(cfg)
        for name in _configured_policies(cfg):
            if not policies.built(name):  # build it off the loop (clustering, loading)
                await loop.run_in_executor(self.executor, policies.get, name)
        batch, failed = self.scheduling_loop.take(cfg, limit, loop.time())
        for ticket, error in failed:
            _fail(ticket, error)
        try:
            await self._fire(cfg, batch)
        except Exception as e:  # a broken batch must fail its requests, never hang them
            log.exception("scheduling a batch failed")
            for ticket in batch:
                _fail(ticket, ApiError(500, f"scheduling failed: {e.__class__.__name__}"))

    async def _sleep(self, delay: float | None) -> None:
        """Until woken (an arrival, a completion) or `delay` seconds pass (None: no limit)."""
        self.wakeup.clear()
        try:
            async with asyncio.timeout(None if delay is None else max(delay, 0.0)):
                await self.wakeup.wait()
        except TimeoutError:
            pass

    async def _fire(self, cfg: Config, batch: list[Ticket]) -> None:
        loop = asyncio.get_running_loop()
        batch = [t for t in batch if not t.handle.done()]
        if not batch:
            return
        fired = loop.time()
        view = self.scheduling_loop.view(cfg, fired)
        decided, timings = await loop.run_in_executor(self.executor, self.decide_now, cfg, batch, view)
        m = self.metrics
        m.batch_size.observe(len(batch))
        m.estimate_seconds.observe(timings.estimate_s)
        if self.estimators is not None:
            m.count_embed_cache(*self.estimators.embedder.cache_counts())
        m.score_seconds.observe(timings.score_s)
        if self._traced and timings.estimated:
            self._trace_estimate(timings, len(batch))
        now = loop.time()
        # A client may have left while its batch was scored: its request is not booked.
        here = [(t, d) for t, d in zip(batch, decided, strict=True) if not t.handle.done()]
        for ticket, (_, policy) in zip(batch, decided, strict=True):
            if ticket.handle.done():
                self.scheduling_loop.abandoned(ticket, policy, now)
        for ticket, (d, _) in here:
            m.batch_wait.observe(fired - ticket.arrived)
            m.decision_seconds.observe(now - ticket.arrived)
            if d.ranked:
                _observe_decision(m, ticket.request.policy, cfg.instances[d.ranked[0]].model, d)
                if ticket.explored:
                    m.explored.labels(cfg.instances[d.ranked[0]].model).inc()
        for ticket in self.scheduling_loop.settle([t for t, _ in here], [d for _, d in here], now):
            _wake(ticket)

    def _trace_estimate(self, timings: BatchTimings, batch_size: int) -> None:
        """The batch's estimate, in the trace of each traced request it was for."""
        traces = [trace for trace in map(self._traced.get, timings.estimated) if trace is not None]
        if traces:
            end_ns = timings.estimated_at_ns + int(timings.estimate_s * 1e9)
            traces[0].tracing.batch_estimated(traces, timings.estimated_at_ns, end_ns, batch_size,
                                              timings.estimated[0].estimated_by)

    def decide_now(self, cfg: Config, batch: list[Ticket], view: PoolView,
                   scheduling: SchedulingLoop | None = None) -> tuple[list[Decided], BatchTimings]:
        """The scheduling loop's decisions for a batch, timed (in the worker thread)."""
        timings = BatchTimings()
        estimators = self.estimators  # one version estimates the whole batch, whatever a refresh swaps meanwhile

        def estimate(tickets: list[Ticket], blind: list[bool]):
            timings.estimated_at_ns, timings.estimated = time.time_ns(), tickets
            start = time.perf_counter()
            est = estimators.for_instances([t.request.prompt_text for t in tickets], cfg.instances, blind)
            unlabelled = estimators.unlabelled(cfg.instances)
            # a request may explore if its key learns and it has a choice between a model without labels and one
            # with (a request that names the unknown model goes there anyway: it spends no exploration budget)
            eligible = [bool(unlabelled) and t.request.explore
                        and len({cfg.instances[c].model in unlabelled for c in t.request.candidates}) == 2
                        for t in tickets]
            explored = self.explorer.apply(est, unlabelled, cfg.instances, eligible, cfg.learning.explore_share,
                                           self.worker.part(cfg.learning.explore_usd_per_day))
            for t, e in zip(tickets, explored, strict=True):
                t.estimated_by, t.explored = estimators.version, e
            timings.estimate_s = time.perf_counter() - start
            return est

        start = time.perf_counter()
        decided = (scheduling or self.scheduling_loop).decide(cfg, batch, view, estimate)
        for ticket, (d, _) in zip(batch, decided, strict=True):
            if ticket.explored and d.cost_usd is not None:
                self.explorer.spent(d.cost_usd)
        timings.score_s = time.perf_counter() - start - timings.estimate_s
        return decided, timings


def _configured_policies(cfg: Config) -> list[str]:
    """The policies the config serves with when a request names none: the default and the presets'."""
    return list(dict.fromkeys((cfg.scheduler.policy, *cfg.scheduler.preset_policies.values())))


def _wake(ticket: Ticket) -> None:
    """Hand a ticket back to its handler: decided (dispatch it, or answer its refusal)."""
    if not ticket.handle.done():
        ticket.handle.set_result(None)


def _fail(ticket: Ticket, error: Exception) -> None:
    if not ticket.handle.done():
        ticket.handle.set_exception(error)


def _observe_decision(m: GatewayMetrics, policy: str, model: str, d: Decision) -> None:
    m.chosen.labels(policy, model).inc()
    if d.quality is not None:
        m.predicted_quality.observe(d.quality)
    if d.cost_usd is not None:
        m.predicted_cost.labels(model).inc(d.cost_usd)
    if d.latency_s is not None:
        m.predicted_latency.observe(d.latency_s)
