"""The scheduler's shell: queue requests, fire batches, run estimators and policies off the loop.

Handlers `await decide(...)` and `release` the request when it ends. One task forms batches (scheduling/batcher.py)
and hands each to a single worker thread, which embeds the whole batch once,
runs the policies over a snapshot of the pool and returns one Decision per
request. The event loop never waits on that work. Before the decisions are
handed back, each request is entered in the pool accounting on its chosen
instance, so the next batch's snapshot already counts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from gateway.api.errors import ApiError
from gateway.config import Config, ConfigStore
from gateway.metrics import GatewayMetrics
from gateway.scheduling.batcher import BatchQueue, batch_limit, busy_share
from gateway.scheduling.instance_view import PoolAccounting
from gateway.scheduling.policies import make_policy
from gateway.scheduling.policy import Decision, Estimates, RouteRequest

log = logging.getLogger("routebalance.scheduler")


@dataclass(eq=False, slots=True)
class Pending:
    """A request waiting for its decision; also its key in the pool accounting.

    `model` is what the client asked for, so the candidates can be found again
    if the config is reloaded while the request waits. `config` is the config
    whose instance indices the candidates (and, once decided, the decision)
    use; `accounted_on` the instance the request is entered under in the
    accounting.
    """

    request: RouteRequest
    model: str
    streaming: bool
    future: asyncio.Future = field(repr=False)
    config: Config = field(repr=False)
    accounted_on: str | None = None


@dataclass(slots=True)
class BatchTimings:
    estimate_s: float = 0.0
    score_s: float = 0.0


class Scheduler:
    def __init__(self, store: ConfigStore, accounting: PoolAccounting, metrics: GatewayMetrics, estimators,
                 candidates_for):
        self.store = store
        self.accounting = accounting
        self.metrics = metrics
        self.estimators = estimators  # estimators.bundle.Estimators, or None if not built
        self.candidates_for = candidates_for  # (config, model) -> instance indices; raises ApiError
        self.queue: BatchQueue[Pending] = BatchQueue(store.current.batching.max_queue)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="scheduler")
        self.wakeup = asyncio.Event()
        # Built on first use in the worker thread, for the config they were built from.
        self.policies: tuple[Config | None, dict[str, object]] = (None, {})
        self.task: asyncio.Task | None = None
        store.subscribe(self._on_config)

    def _on_config(self, cfg: Config) -> None:
        self.queue.max_queue = cfg.batching.max_queue

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self.task:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def decide(self, request: RouteRequest, model: str, streaming: bool, config: Config
                     ) -> tuple[Pending, Decision]:
        """Queue the request for the next batch and wait for its decision (429 if the queue is full).

        The caller must hand the returned Pending to `release` when the request ends."""
        loop = asyncio.get_running_loop()
        pending = Pending(request, model, streaming, loop.create_future(), config)
        if not self.queue.push(pending, loop.time()):
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(429, f"the gateway has {self.queue.max_queue} requests waiting to be scheduled; "
                                "retry shortly", code="rate_limit_exceeded", headers={"Retry-After": "1"})
        self.wakeup.set()
        try:
            return pending, await pending.future
        except asyncio.CancelledError:
            self.queue.remove(pending)
            self.release(pending)  # decided just before the client left: undo its dispatch accounting
            raise

    def release(self, pending: Pending) -> None:
        """The request is over: take it out of the accounting of the instance it was entered on."""
        if pending.accounted_on is not None:
            self.accounting.of(pending.accounted_on).done(pending)
            pending.accounted_on = None

    def move(self, pending: Pending, instance, tokens: float, now: float) -> None:
        """The request goes to another instance than planned (a retry): move its accounting there."""
        if pending.accounted_on != instance.name:
            self.release(pending)
            self.accounting.of(instance.name).dispatched(pending, pending.request.input_tokens, tokens, now,
                                                         pending.streaming)
            pending.accounted_on = instance.name

    # ---- the batch loop --------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.queue:
                await self.wakeup.wait()
                self.wakeup.clear()
                continue
            cfg = self.store.current
            now = loop.time()
            size = max(rule.size for rule in cfg.batching.rules)
            if cfg.batching.mode == "window":
                waiting = self.accounting.waiting(cfg.instances, now, cfg.telemetry.stale_after_s)
                limit = batch_limit(cfg.batching.rules, busy_share(waiting))
                if not self.queue.ready(limit, now):
                    await self._sleep_until(self.queue.closes_at(limit) - now)
                    continue
                size = limit.size
            items = self.queue.take(size)
            try:
                await self._fire(cfg, items)
            except Exception as e:  # a broken batch must fail its requests, never hang them or stop the loop
                log.exception("scheduling a batch failed")
                for _, p in items:
                    if not p.future.done():
                        p.future.set_exception(ApiError(500, f"scheduling failed: {e.__class__.__name__}"))

    async def _sleep_until(self, delay: float) -> None:
        self.wakeup.clear()
        try:
            await asyncio.wait_for(self.wakeup.wait(), max(delay, 0.0))
        except TimeoutError:
            pass

    def _current_candidates(self, cfg: Config, p: Pending) -> bool:
        """Re-resolve the candidates of a request parsed under another config; False if it failed."""
        if p.config is cfg:
            return True
        try:
            p.request = dataclasses.replace(p.request, candidates=self.candidates_for(cfg, p.model))
        except ApiError as e:  # its model left the pool with the reload
            p.future.set_exception(e)
            return False
        p.config = cfg
        return True

    async def _fire(self, cfg: Config, items) -> None:
        loop = asyncio.get_running_loop()
        items = [(t, p) for t, p in items if not p.future.done() and self._current_candidates(cfg, p)]
        if not items:
            return
        fired = loop.time()
        batch = [p.request for _, p in items]
        view = self.accounting.snapshot(cfg.instances, fired, cfg.telemetry.stale_after_s)
        outcomes, timings = await loop.run_in_executor(self.executor, self.decide_now, cfg, batch, view)
        m = self.metrics
        m.batch_size.observe(len(batch))
        m.estimate_seconds.observe(timings.estimate_s)
        m.score_seconds.observe(timings.score_s)
        now = loop.time()
        for (arrived, pending), outcome in zip(items, outcomes, strict=True):
            if isinstance(outcome, ApiError):
                if not pending.future.done():
                    pending.future.set_exception(outcome)
                continue
            m.batch_wait.observe(fired - arrived)
            m.decision_seconds.observe(now - arrived)
            if outcome.ranked:
                req, chosen = pending.request, cfg.instances[outcome.ranked[0]]
                _observe_decision(m, req.policy, chosen.model, outcome)
                if not pending.future.done():  # the client may have left while its batch was scored
                    self.accounting.of(chosen.name).dispatched(pending, req.input_tokens, outcome.tokens or 0.0,
                                                               now, pending.streaming)
                    pending.accounted_on = chosen.name
            if not pending.future.done():
                pending.future.set_result(outcome)

    # ---- in the worker thread ------------------------------------------------------
    def _policy(self, cfg: Config, name: str):
        built_for, policies = self.policies
        if built_for is not cfg:  # a reload may have changed the pool, the options or the knobs
            policies = {}
            self.policies = (cfg, policies)
        policy = policies.get(name)
        if policy is None:
            try:
                policy = policies[name] = make_policy(name, cfg, self.estimators)
            except ValueError as e:  # e.g. a router that needs the estimators when none are built
                raise ApiError(503, f"policy {name!r} is unavailable: {e}") from None
        return policy

    def decide_now(self, cfg: Config, batch: list[RouteRequest], view) -> tuple[list[Decision | ApiError], BatchTimings]:
        """One Decision per request, or the ApiError of a policy that cannot run (only its requests fail)."""
        timings = BatchTimings()
        groups: dict[str, list[int]] = {}
        for r, req in enumerate(batch):
            groups.setdefault(req.policy, []).append(r)
        outcomes: list[Decision | ApiError | None] = [None] * len(batch)
        policies = {}
        for name, rows in groups.items():
            try:
                policies[name] = self._policy(cfg, name)
                if policies[name].needs_estimates and self.estimators is None:
                    raise ApiError(503, f"policy {name!r} needs the estimators, which are not built: "
                                        "run `routebalance train`")
            except ApiError as e:
                policies.pop(name, None)
                for r in rows:
                    outcomes[r] = e
        estimates = None
        if any(p.needs_estimates for p in policies.values()):
            start = time.perf_counter()
            estimates = self.estimators.for_instances([r.prompt_text for r in batch], cfg.instances)
            timings.estimate_s = time.perf_counter() - start
        start = time.perf_counter()
        # Policies run one after another on the same view, so each sees what the others dispatched.
        for name, policy in policies.items():
            rows = groups[name]
            sub = _rows(estimates, rows) if estimates is not None else None
            for r, d in zip(rows, policy.assign([batch[r] for r in rows], sub, view), strict=True):
                outcomes[r] = d
        timings.score_s = time.perf_counter() - start
        return outcomes, timings  # type: ignore[return-value]


def _observe_decision(m: GatewayMetrics, policy: str, model: str, d: Decision) -> None:
    m.chosen.labels(policy, model).inc()
    if d.quality is not None:
        m.predicted_quality.observe(d.quality)
    if d.cost_usd is not None:
        m.predicted_cost.labels(model).inc(d.cost_usd)
    if d.latency_s is not None:
        m.predicted_latency.observe(d.latency_s)


def _rows(est: Estimates, rows: list[int]) -> Estimates:
    if len(rows) == len(est.quality):
        return est
    idx = np.array(rows)
    return Estimates(est.quality[idx], est.length[idx], None if est.embeddings is None else est.embeddings[idx])
