"""The gateway's HTTP shell: OpenAI endpoints, dispatch through the policy, relay.

Handlers stay thin: parse (api/parse.py), choose (the policy, over a snapshot
of the pool), forward and relay (relay.py). The config is read once per
request from the store, so a reload takes effect for the next request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest, parse_completion
from gateway.config import Config, ConfigStore
from gateway.config_watch import watch_file
from gateway.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.metrics import GatewayMetrics
from gateway.relay import (
    RelayResult,
    StreamBudget,
    UpstreamFailed,
    asks_continuous_usage,
    client_error,
    open_upstream,
    relay_full,
    relay_stream,
    upstream_payload,
)
from gateway.scheduler import Scheduler, refusal_error
from gateway.scheduling.ledger import PoolLedger
from gateway.scheduling.policies import registry
from gateway.scheduling.request import Completion, Decision, RouteRequest, Ticket
from gateway.telemetry import scrape_forever
from gateway.tokens import TokenCounter

log = logging.getLogger("routebalance.gateway")
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


@dataclass(slots=True)
class Attempt:
    """Where a request went and how it ended, for its metrics line."""

    instance: str = "none"
    index: int | None = None  # the instance's index in the decision's config
    status: int = 500
    result: RelayResult = field(default_factory=RelayResult)


async def read_body(request: web.Request, limit: int) -> bytes:
    """The request body, refused with 413 past `limit` (read per request, so a reload applies)."""
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, f"request body too large (limit {limit} bytes)")
    chunks, size = [], 0
    while chunk := await request.content.read(65536):
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body too large (limit {limit} bytes)")
        chunks.append(chunk)
    return b"".join(chunks)


def decision_headers(d: Decision, clamped_max_tokens: int | None) -> dict[str, str]:
    """What the scheduler predicted for its choice, for the client to see."""
    headers = {}
    if d.quality is not None:
        headers["X-Route-Predicted-Quality"] = f"{d.quality:.4f}"
    if d.cost_usd is not None:
        headers["X-Route-Predicted-Cost-USD"] = f"{d.cost_usd:.10f}"
    if d.latency_s is not None:
        headers["X-Route-Predicted-Latency-S"] = f"{d.latency_s:.3f}"
    if clamped_max_tokens is not None:
        headers["X-Route-Max-Tokens"] = str(clamped_max_tokens)
    return headers


def candidates_for(cfg: Config, model: str) -> tuple[int, ...]:
    """Instances a request may use: all for a routing alias, else those serving the named model."""
    if model in cfg.server.aliases:
        return tuple(range(len(cfg.instances)))
    found = tuple(i for i, inst in enumerate(cfg.instances) if inst.model == model)
    if not found:
        known = ", ".join((*cfg.server.aliases, *cfg.models()))
        raise ApiError(404, f"The model '{model}' does not exist; available: {known}", "model", "model_not_found")
    return found


def resolve_weights(cfg: Config, routing) -> tuple[float, float, float]:
    """Per-request weights, else the request's preset, else the configured one (quality, latency, cost)."""
    if routing.weights is not None:
        return routing.weights
    w = cfg.weights(routing.preset or cfg.scheduler.preset)
    return (w.quality, w.latency, w.cost)


class Gateway:
    def __init__(self, store: ConfigStore, estimators=None):
        self.store = store
        self.ledger = PoolLedger()
        self.metrics = GatewayMetrics()
        self.scheduler = Scheduler(store, self.ledger, self.metrics, estimators, candidates_for)
        self.token_counter = TokenCounter()
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        store.subscribe(self._on_config)

    # ---- lifecycle -----------------------------------------------------------
    async def open(self) -> None:
        up = self.store.current.upstream
        connector = aiohttp.TCPConnector(limit=up.max_connections, limit_per_host=0, ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        self.scheduler.start()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(scrape_forever(self.session, self.store, self.ledger))]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.scheduler.stop()
        if self.session:
            await self.session.close()

    def warm_up(self) -> None:
        """Load the tokenizer and run one decision before the first request, so the
        first requests do not pay for lazy loading (about half a second)."""
        cfg = self.store.current
        text = "warm up"
        probe = RouteRequest(tuple(range(len(cfg.instances))), text, self.token_counter.count(text), 1, (1.0, 0.0, 0.0),
                             policy=cfg.scheduler.policy)
        refused = self.scheduler.warm_up(probe)
        if refused:  # e.g. the configured policy needs estimators that are not built
            log.warning("warm-up decision failed: %s", refused.message)

    def _on_config(self, cfg: Config) -> None:
        log.info("config reloaded: %d instances, policy %s", len(cfg.instances), cfg.scheduler.policy)

    def reload(self, reason: str) -> tuple[bool, str]:
        log.info("config reload requested (%s)", reason)
        ok, message = self.store.reload()  # the store logs the outcome
        self.count_reload(ok)
        return ok, message

    def count_reload(self, ok: bool) -> None:
        self.metrics.config_reloads.labels("ok" if ok else "error").inc()

    # ---- handlers --------------------------------------------------------------
    async def chat(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "chat")

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "completions")

    async def _complete(self, request: web.Request, route: str) -> web.StreamResponse:
        cfg = self.store.current
        loop = asyncio.get_running_loop()
        start = loop.time()
        attempt = Attempt()
        self.metrics.in_flight.inc()
        try:
            raw = await read_body(request, cfg.server.max_body_bytes)
            req = parse_completion(raw, request.headers, chat=route == "chat", presets=cfg.scheduler.presets,
                                   policies=registry.names())
            routed = RouteRequest(
                candidates=candidates_for(cfg, req.model),
                prompt_text=req.prompt_text,
                input_tokens=(self.token_counter.count_chat(req.body["messages"]) if req.chat
                              else self.token_counter.count(req.prompt_text)),
                max_tokens=req.max_tokens,
                weights=resolve_weights(cfg, req.routing),
                budget_usd=req.routing.budget_usd,
                policy=req.routing.policy or cfg.scheduler.policy,
            )
            ticket = await self.scheduler.decide(routed, req.model, req.stream, cfg)
            refused = ticket.decision.refused
            if refused:
                self.scheduler.complete(ticket, Completion(False, None))
                self.metrics.rejected.labels(refused.reason).inc()
                raise refusal_error(refused)
            cfg = ticket.config  # the decision's instance indices are this config's
            resp = None
            try:
                resp = await self._dispatch(request, cfg, req, ticket, route, attempt)
            finally:
                ok = resp is not None and resp.status < 400 and not attempt.result.failed_status
                self.scheduler.complete(ticket, Completion(ok, attempt.index, attempt.result.completion_tokens))
            result = attempt.result
            attempt.status = result.failed_status or resp.status
            self.metrics.e2e.labels(route).observe(loop.time() - start)
            if result.first_byte_s is not None:
                self.metrics.ttft.labels(route).observe(result.first_byte_s - start)
            if result.cost_usd is not None:
                model = cfg.instance(attempt.instance).model
                self.metrics.cost.labels(model).inc(result.cost_usd)
                self.metrics.tokens.labels(model, "prompt").inc(result.prompt_tokens)
                self.metrics.tokens.labels(model, "completion").inc(result.completion_tokens)
            if result.budget_exhausted:
                self.metrics.budget_stops.inc()
            return resp
        except ApiError as e:
            attempt.status = e.status
            raise
        except asyncio.CancelledError:
            attempt.status = 499  # the client went away
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, attempt.instance, str(attempt.status)).inc()

    async def _dispatch(self, request, cfg: Config, req: CompletionRequest, ticket: Ticket, route: str,
                        attempt: Attempt):
        """Send the request to its instance; before the first byte, retry on the next-ranked ones."""
        loop = asyncio.get_running_loop()
        core = self.scheduler.core
        up = cfg.upstream
        # A non-streamed answer sends nothing until it is complete, so only the
        # total timeout can bound it; a stream must keep bytes coming.
        timeout = aiohttp.ClientTimeout(total=up.total_timeout_s, sock_connect=up.connect_timeout_s,
                                        sock_read=up.read_timeout_s if req.stream else None)
        routed, decision = ticket.request, ticket.decision
        failure: UpstreamFailed | None = None
        attempts = failed = 0  # failed: attempts that reached an instance, bounded by `retries`
        started = False

        def on_progress(tokens: int) -> None:
            nonlocal started
            if not started:
                started = True
                core.first_token(ticket, loop.time())
            core.progress(ticket, tokens)

        for plan in core.plans(ticket, loop.time()):
            if failed > up.retries:
                break
            instance = cfg.instances[plan.instance]
            budget = None
            if routed.budget_usd is not None:
                budget = StreamBudget.for_instance(routed.budget_usd, instance, routed.input_tokens)
            if plan.clamped:
                self.metrics.budget_clamps.inc()
            core.dispatched(ticket, plan, loop.time())
            if attempts:
                self.metrics.retries.labels(instance.name).inc()
            attempts += 1
            attempt.instance, attempt.index = instance.name, plan.instance
            headers = decision_headers(decision, plan.max_tokens if plan.clamped else None)
            try:
                payload = upstream_payload(req, instance, plan.max_tokens, continuous_usage=budget is not None)
                upstream = await open_upstream(self.session, instance, ROUTES[route], payload, timeout)
                self.ledger.mark_up(instance.name)
                if upstream.status >= 400:
                    raise await client_error(upstream)
                if req.stream:
                    return await relay_stream(request, upstream, instance, req.include_usage, attempt.result,
                                              budget=budget, continuous_usage=asks_continuous_usage(req),
                                              headers=headers, on_progress=on_progress)
                resp = await relay_full(upstream, instance, attempt.result)
                on_progress(attempt.result.completion_tokens)
                resp.headers.update(headers)
                return resp
            except UpstreamFailed as e:
                failure = e
                log.warning("attempt %d on %s failed: %s", attempts, instance.name, e)
                if e.unreachable:  # the request never reached it: trying the next costs no retry
                    self.ledger.mark_down(instance.name, loop.time())
                    continue
                failed += 1
                if not e.retry:
                    break
        if failure is None:
            raise ApiError(402, "the budget cannot pay for this prompt on any remaining candidate",
                           "routing.budget_usd", "insufficient_budget")
        raise ApiError(failure.status, str(failure))

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.store.current
        created = int(time.time())
        data = [{"id": a, "object": "model", "created": created, "owned_by": "routebalance"}
                for a in cfg.server.aliases]
        data += [{"id": m, "object": "model", "created": created, "owned_by": "vllm"} for m in cfg.models()]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        return _json({"status": "ok", "instances": len(self.store.current.instances)})

    async def metrics_page(self, request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    async def admin_reload(self, request: web.Request) -> web.Response:
        token = self.store.current.server.admin_token
        if token and request.headers.get("Authorization") != f"Bearer {token}":
            raise ApiError(401, "admin endpoints need 'Authorization: Bearer <admin_token>'")
        ok, message = self.reload("admin endpoint")
        if not ok:
            raise ApiError(400, f"config rejected, running config kept: {message}", "config")
        return _json({"reloaded": True, "instances": len(self.store.current.instances)})


def _json(obj) -> web.Response:
    return web.Response(body=orjson.dumps(obj), content_type="application/json")


@web.middleware
async def openai_errors(request: web.Request, handler):
    """Every failure leaves as an OpenAI error object, never a stack trace."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return ApiError(e.status, e.reason or "request failed").response()
    except (asyncio.CancelledError, ConnectionResetError):
        raise
    except Exception:
        log.exception("unhandled error on %s %s", request.method, request.path)
        return ApiError(500, "internal error in the gateway").response()


def build_app(gateway: Gateway) -> web.Application:
    app = web.Application(middlewares=[openai_errors])  # body size: checked per request by read_body
    app.router.add_post("/v1/chat/completions", gateway.chat)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/metrics", gateway.metrics_page)
    app.router.add_post("/admin/reload", gateway.admin_reload)

    async def lifecycle(app: web.Application):
        await gateway.open()
        watcher = asyncio.create_task(watch_file(gateway.store, gateway.count_reload))
        yield
        watcher.cancel()
        await gateway.close()

    app.cleanup_ctx.append(lifecycle)
    return app
