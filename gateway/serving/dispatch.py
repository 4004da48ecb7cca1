"""One dispatch path for every upstream call: a client's request, and each call of progressive mode.

A call is decided by the scheduling loop (batched, estimated once for the batch, ranked by its policy),
then attempted on its ranked instances, best first, until one answers:

    plan (the booked plan, or a new one with the budget left) -> reserve the attempt's worst case
    against the key -> open upstream -> relay (streamed to the client, or whole to the caller)
    -> settle: pay the attempt's real cost, tell the loop how the instance did (health, cooldowns)

Before the first byte a failed attempt goes on to the next-ranked instance; each attempt is paid for.
A policy may evict a call before its client saw a byte (Policy.evict): the attempt is aborted and the
call waits in the gateway to be released again. When the call ends, the loop hears it once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.api.responses import ResponsesRequest
from gateway.config.sections import Config
from gateway.core.request import Completion, Decision, Ticket
from gateway.serving.driver import Scheduler
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.prefixes import cache_salt
from gateway.serving.relay import (
    Costing,
    RelayResult,
    UpstreamFailed,
    asks_continuous_usage,
    client_error,
    client_trace,
    open_upstream,
    relay_full,
    relay_stream,
    upstream_payload,
    upstream_timeout,
)
from gateway.serving.responses_relay import ROUTE as RESPONSES_ROUTE
from gateway.serving.responses_relay import ResponsesFramer, relay_response_full, responses_payload
from gateway.tenancy.slo_check import SloCheck
from gateway.tenancy.spend.request import RequestSpend, worst_case_usd
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.serving.tracing import RequestTrace

log = logging.getLogger("routebalance.dispatch")
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions", "responses": RESPONSES_ROUTE}


@dataclass(slots=True)
class Attempt:
    """Where a call went and how it ended, for its metrics line."""

    instance: str = "none"
    index: int | None = None  # the instance's index in the decision's config
    status: int = 500
    result: RelayResult = field(default_factory=RelayResult)
    evicted: bool = False  # the scheduler is aborting this attempt to serve the call again later
    headers: dict[str, str] = field(default_factory=dict)  # the answer's own, beside the decision's (a fallback's)


@dataclass(slots=True)
class DecidedCall:
    """One decided call, from its decision to its answer: what every step of the dispatch reads."""

    ticket: Ticket
    req: CompletionRequest  # the body sent upstream (the model and max_tokens set per attempt)
    spend: RequestSpend  # the request's money: each attempt reserves and pays through it
    route: str = "chat"  # "chat", "completions" or "responses"
    client: web.Request | None = None  # the client a stream goes to; None: the answer comes back whole
    slo: SloCheck | None = None
    attempt: Attempt = field(default_factory=Attempt)
    trace: RequestTrace | None = None  # the client request's span, when the gateway traces (serving/tracing.py)

    @property
    def cfg(self) -> Config:
        return self.ticket.config  # the decision's instance indices are this config's


def decision_headers(d: Decision, clamped_max_tokens: int | None, estimated_by: int | None) -> dict[str, str]:
    """What the scheduler predicted for its choice, and with which estimators, for the client to see."""
    headers = {}
    if estimated_by is not None:
        headers["X-Route-Estimator"] = f"v{estimated_by}"
    if d.quality is not None:
        headers["X-Route-Predicted-Quality"] = f"{d.quality:.4f}"
    if d.cost_usd is not None:
        headers["X-Route-Predicted-Cost-USD"] = f"{d.cost_usd:.10f}"
    if d.latency_s is not None:
        headers["X-Route-Predicted-Latency-S"] = f"{d.latency_s:.3f}"
    if d.cached_tokens is not None:
        headers["X-Route-Cached-Tokens"] = str(int(d.cached_tokens))
    if clamped_max_tokens is not None:
        headers["X-Route-Max-Tokens"] = str(clamped_max_tokens)
    return headers


class CallDispatcher:
    def __init__(self, scheduler: Scheduler, metrics: GatewayMetrics, token_counter: TokenCounter,
                 session: Callable[[], aiohttp.ClientSession | None]):
        self.scheduler = scheduler
        self.metrics = metrics
        self.token_counter = token_counter
        self._session = session  # the gateway's pooled client session (opened with the app)

    async def serve(self, call: DecidedCall) -> web.StreamResponse:
        """The call's answer on its decision (ApiError when no attempt could give one); the loop hears how it
        ended, and the answer's cost is counted, whatever happens."""
        resp = None
        attempt = call.attempt
        try:
            resp = await self._evictable(call)
            return resp
        finally:
            ok = resp is not None and resp.status < 400 and not attempt.result.failed_status
            self.scheduler.complete(call.ticket, Completion(ok, attempt.index, attempt.result.completion_tokens))
            # Here, not after: a streaming client may hang up right after [DONE], which cancels
            # its handler (handler_cancellation) with the answer already costed.
            if attempt.result.cost_usd is not None:
                self.metrics.answered(call.cfg.instance(attempt.instance).model, attempt.result.cost_usd,
                                      attempt.result.prompt_tokens, attempt.result.completion_tokens)
                decision = call.ticket.decision
                if decision is not None and decision.ranked and attempt.index == decision.ranked[0]:
                    self.metrics.cached(attempt.instance, decision.cached_tokens, attempt.result.cached_tokens)

    async def _evictable(self, call: DecidedCall) -> web.StreamResponse:
        """Serve the call on its decision; if its policy evicts it before the client saw a byte
        (see Policy.evict), the attempt is aborted and the call waits in the gateway to go again."""
        loop = asyncio.get_running_loop()
        attempt = call.attempt
        while True:
            run = loop.create_task(self._attempts(call))

            def abort(run=run) -> bool:
                """The scheduler evicts the call: only while nothing of the answer went out."""
                if run.done() or attempt.result.first_byte_s is not None:
                    return False
                attempt.evicted = True
                run.cancel()
                return True

            self.scheduler.evictable(call.ticket, abort)
            try:
                return await run
            except asyncio.CancelledError:
                if not attempt.evicted or not run.cancelled() or asyncio.current_task().cancelling():
                    raise  # the client left (perhaps just as the attempt was evicted)
            finally:
                self.scheduler.evictable(call.ticket, None)
                run.cancel()  # the handler itself was cancelled: its attempt goes too
            attempt.evicted = False
            self.metrics.evictions.inc()
            await self.scheduler.redecided(call.ticket, call.cfg)

    async def _attempts(self, call: DecidedCall) -> web.StreamResponse:
        """Send the call to its instance; before the first byte, retry on the next-ranked ones.
        Each attempt is reserved against the key before it goes and paid for when it ends."""
        cfg, req, ticket, spend, attempt = call.cfg, call.req, call.ticket, call.spend, call.attempt
        sched, up = self.scheduler, cfg.upstream
        timeout = upstream_timeout(up, req.stream)
        routed, decision = ticket.request, ticket.decision
        assert decision is not None
        failure: UpstreamFailed | None = None
        attempts = failed = 0  # failed: attempts that reached an instance, bounded by `retries`
        passed = client_trace(call.client.headers) if call.trace is None and call.client is not None else None
        for i in decision.ranked:
            if failed > up.retries:
                break
            budget = spend.budget_left()
            plan = sched.plan(ticket, i, budget)
            if plan is None:
                continue
            instance = cfg.instances[plan.instance]
            slo = call.slo if call.slo is not None and call.slo.any else None
            costing = Costing.for_instance(instance, routed.input_tokens, self.token_counter.count,
                                           up.max_response_bytes, cfg.server.tokenize_inline_chars,
                                           slo.annotate if slo is not None else None)
            worst = worst_case_usd(instance, routed.input_tokens, plan.max_tokens, routed.n, req.has_media)
            held = await spend.hold(worst)  # 402 when the key cannot cover it
            if plan.clamped:
                self.metrics.budget_clamps.inc()
            sched.dispatched(ticket, plan)
            if attempts:
                self.metrics.retries.labels(instance.name).inc()
            attempts += 1
            attempt.instance, attempt.index = instance.name, plan.instance
            result = attempt.result = RelayResult()
            traced = call.trace.attempt(instance, attempts, plan.max_tokens) if call.trace is not None else None
            answered = False  # the instance has sent (part of) an answer: it is healthy

            def on_progress(tokens: int, plan=plan) -> None:
                nonlocal answered
                if not answered:
                    answered = True
                    sched.attempt_succeeded(ticket, plan)
                    sched.first_token(ticket)
                sched.progress(ticket, tokens)

            cost: float | None = None
            try:
                salt = cache_salt(spend.key, req.body)
                responses = names_stored = False
                if isinstance(req, ResponsesRequest):  # the Responses API: its own body and events
                    payload = responses_payload(req, instance, plan.max_tokens, salt)
                    responses, names_stored = True, req.previous_response_id is not None
                else:
                    payload = upstream_payload(req, instance, plan.max_tokens, continuous_usage=budget is not None,
                                               cache_salt=salt)
                upstream = await open_upstream(self._session(), instance, ROUTES[call.route], payload, timeout,
                                               req.stream, names_stored=names_stored,
                                               trace_headers=traced.headers if traced is not None else passed)
                if traced is not None:
                    traced.answered(upstream.status)
                if upstream.status >= 400:  # the instance is well; the request is not
                    sched.attempt_succeeded(ticket, plan)
                    cost = 0.0
                    raise await client_error(upstream)
                clamped = plan.max_tokens if plan.clamped else None
                headers = {**attempt.headers, **decision_headers(decision, clamped, ticket.estimated_by)}
                if req.stream:
                    assert call.client is not None  # only a client's own request streams
                    resp = await relay_stream(call.client, upstream, instance, req.include_usage, result, costing,
                                              budget_usd=budget, continuous_usage=asks_continuous_usage(req),
                                              headers=headers, on_progress=on_progress, n=routed.n,
                                              write_timeout_s=cfg.server.write_timeout_s,
                                              framer=ResponsesFramer(costing, result, instance, budget)
                                              if responses else None)
                else:
                    relay = relay_response_full if responses else relay_full
                    resp = await relay(upstream, instance, result, costing)
                    on_progress(result.completion_tokens)
                    resp.headers.update(headers)
                    if slo is not None:
                        resp.headers.update(slo.headers())
                if result.instance_failed:  # it broke off after the first byte
                    sched.attempt_failed(ticket, plan)
                cost = result.cost_usd
                return resp
            except UpstreamFailed as e:
                failure = e
                log.warning("attempt %d on %s failed: %s", attempts, instance.name, e)
                if traced is not None:
                    traced.failed(e)
                # No connection in time while the gateway does not fill its pool: it does not answer connects.
                busy = sched.in_flight(instance.name) > up.max_connections_per_instance
                if e.blame or (e.no_connection and not busy):
                    sched.attempt_failed(ticket, plan, e.unreachable)
                cost = e.cost(costing, routed.input_tokens, worst)
                if e.unreachable:  # the request never reached it: trying the next costs no retry
                    continue
                failed += 1
                if not e.retry:
                    break
            finally:
                if attempt.evicted:  # aborted by the gateway before any answer: its prompt was read
                    cost = costing.cost(routed.input_tokens, 0)
                elif cost is None:  # the client left (an SDK hangs up on [DONE], cancelling this handler)
                    cost = result.cost_when_left(worst)
                spend.pay_held(held, cost)
                if traced is not None:
                    traced.end(result, attempt.evicted)
        if failure is not None:
            raise ApiError(failure.status, str(failure))
        if any(sched.routable(cfg.instances[i].name) for i in decision.ranked):
            raise spend.refusal()
        raise self.scheduler.no_healthy_instance(cfg, decision.ranked, ticket.model)
