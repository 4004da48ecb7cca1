"""The gateway's HTTP shell: OpenAI endpoints, dispatch through the policy, relay.

Handlers stay thin: parse (api/parse.py), choose (the policy, over a snapshot
of the pool), forward and relay (relay.py). The config is read once per
request from the store, so a reload takes effect for the next request.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import ssl
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest, parse_completion
from gateway.api.responses import ResponsesRequest, parse_responses
from gateway.config.sections import ApiKey, Config, TracingConfig
from gateway.config.store import ConfigStore
from gateway.config.watch import watch_file
from gateway.core.pool_state import PoolState, prefill_rates
from gateway.core.request import Completion, RouteRequest
from gateway.policies import registry
from gateway.serving.body import read_body
from gateway.serving.dispatch import Attempt, CallDispatcher, DecidedCall
from gateway.serving.driver import Scheduler, candidates_for, refusal_error
from gateway.serving.embeddings import EmbeddingsHandler
from gateway.serving.feedback import FeedbackHandler
from gateway.serving.kv_events import KvEventReader
from gateway.serving.learner import TrafficLearner
from gateway.serving.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.prefixes import cache_salt, measure_prompt
from gateway.serving.progressive import PROGRESSIVE, FellBack, Progressive
from gateway.serving.refresh import EstimatorRefresh
from gateway.serving.shadow import ShadowAnswers
from gateway.serving.stored_responses import stored_at
from gateway.serving.telemetry import scrape_forever
from gateway.serving.workers import SINGLE, Worker
from gateway.state.link import RedisLink
from gateway.state.prefixes import PrefixSync
from gateway.state.sync import ReplicaSync
from gateway.tenancy.access import Access, check_admin, json_posts_only, may_name, request_preset
from gateway.tenancy.keys import anonymous_allowed
from gateway.tenancy.slo_check import SloCheck, resolve_slo
from gateway.tenancy.spend.host import HostSpendLedger
from gateway.tenancy.spend.redis import RedisSpendLedger
from gateway.tenancy.spend.request import KeyLedger, RequestSpend
from gateway.tenancy.spend.sqlite import MemorySpendStore, SpendLedger, SpendStoreError, SqliteSpendStore
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.serving.tracing import Tracing

log = logging.getLogger("routebalance.gateway")


def resolve_weights(cfg: Config, routing, key: ApiKey | None = None) -> tuple[float, float, float]:
    """Per-request weights, else the request's preset, else the configured one (or one its key allows)."""
    if routing.weights is not None:
        return routing.weights
    w = cfg.weights(request_preset(cfg, routing, key))
    return (w.quality, w.latency, w.cost)


def resolve_policy(cfg: Config, routing, key: ApiKey | None = None) -> str:
    """The request's own policy, else its preset's (`[scheduler.preset_policies]`), else the configured one."""
    return routing.policy or cfg.scheduler.policy_for(request_preset(cfg, routing, key))


def open_tracing(cfg: TracingConfig) -> Tracing | None:
    """The tracer when `[tracing] enabled`, else None: OpenTelemetry is imported only then (ConfigError, naming
    the extra to install, when it is missing)."""
    if not cfg.enabled:
        return None
    from gateway.serving.tracing import Tracing

    return Tracing(cfg)


def hold_ttl_s(cfg: Config) -> float:
    """How long a reservation outlives a process that dies holding it: longer than a request may live."""
    return cfg.upstream.total_timeout_s + cfg.batching.max_wait_s + 60


def open_spend_ledger(cfg: Config, worker: Worker = SINGLE) -> KeyLedger:
    """The embedded ledger; with `serve --workers`, the one whose holds live in the SQLite file they share."""
    if cfg.state.backend == "sqlite" and worker.shared:
        return HostSpendLedger(Path(cfg.state.path), hold_ttl_s(cfg))
    store = SqliteSpendStore(Path(cfg.state.path)) if cfg.state.backend == "sqlite" else MemorySpendStore()
    return SpendLedger(store)


# Shutdown writes the spend not yet written for at most this long, closes the Redis link within this long,
# and gives the background tasks this long to end once cancelled.
_CLOSE_FLUSH_S = 2.0
_CLOSE_LINK_S = 2.0
_CLOSE_TASKS_S = 2.0
GAUGES_EVERY_S = 1.0


async def _within(what: str, timeout_s: float, *aws) -> None:
    """Await `aws` together for at most `timeout_s`, without waiting on a task that ignores its cancellation
    (asyncio.wait_for would); what is still running then is cancelled and left, and said so."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    if not tasks:
        return
    done, pending = await asyncio.wait(tasks, timeout=timeout_s)
    for task in pending:
        task.cancel()
    if pending:
        log.warning("shutdown: %s did not end within %g s; left to the process's end", what, timeout_s)
    for task in done:
        if not task.cancelled() and task.exception() is not None:
            log.warning("shutdown: %s failed: %r", what, task.exception())


class Gateway:
    def __init__(self, store: ConfigStore, estimators=None, host: str | None = None, worker: Worker = SINGLE):
        self.store = store
        self.worker = worker  # its place among `serve --workers` (gateway/serving/workers.py)
        self.host = host or store.current.server.host  # where it listens: anonymous access depends on it
        self.pool_state = PoolState()
        self.metrics = GatewayMetrics()
        self.tracing = open_tracing(store.current.tracing)  # read at start: a reload does not change it
        self.scheduler = Scheduler(store, self.pool_state, self.metrics, estimators, worker)
        self.token_counter = TokenCounter()
        self.dispatcher = CallDispatcher(self.scheduler, self.metrics, self.token_counter, lambda: self.session)
        self.progressive = Progressive(self.scheduler, self.dispatcher, self.metrics, self.token_counter)
        self.access = Access(store.current)
        self.learner = TrafficLearner(store, self.metrics, worker)
        self.feedback_handler = FeedbackHandler(self.learner, self.access, self.metrics)
        self.embeddings_handler = EmbeddingsHandler(self.access, self.metrics, self.token_counter,
                                                    lambda: self.session, lambda: self.spend, self.tracing)
        self.refresher = EstimatorRefresh(self.scheduler, self.learner, store, self.metrics, worker)
        self.shadow = ShadowAnswers(store, self.learner, self.scheduler, self.metrics, lambda: self.session, worker)
        self.kv_events = KvEventReader(store, self.pool_state,
                                       lambda name, lag: self.metrics.kv_events_lag.labels(name).set(lag))
        if estimators is not None:
            self.metrics.estimator_version.set(estimators.version)
        self.spend: KeyLedger | None = None  # opened when the config first has keys (at start with Redis)
        self.link: RedisLink | None = None  # [state] backend = "redis": shared with the other replicas
        self.session: aiohttp.ClientSession | None = None
        self._tasks: list[asyncio.Task] = []
        store.subscribe(self._on_config)

    # ---- lifecycle -----------------------------------------------------------
    async def open(self) -> None:
        up = self.store.current.upstream
        # Per instance (each is its own host:port), so one stalled instance cannot take every connection.
        connector = aiohttp.TCPConnector(limit=up.max_connections, limit_per_host=up.max_connections_per_instance,
                                         ttl_dns_cache=300)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(scrape_forever(self.session, self.store, self.pool_state)),
                       loop.create_task(self.kv_events.run())]
        cfg = self.store.current
        if cfg.state.backend == "redis":  # read at start only: a reload does not move the state
            self.link = RedisLink(cfg.state.url, cfg.state.prefix, cfg.state.timeout_s)
            spend = RedisSpendLedger(self.link, cfg.state.on_unavailable, hold_ttl_s=hold_ttl_s(cfg))
            self.spend = spend
            self._tasks += [loop.create_task(spend.run(cfg.state.sync_interval_s)),
                            loop.create_task(ReplicaSync(self.link, self.pool_state, self.store).run()),
                            loop.create_task(PrefixSync(self.link, self.pool_state, self.store).run())]
        self._open_spend(cfg)
        await self.learner.open()
        if self.link is not None or self.worker.shared:  # a feedback may reach another process than its answer
            self.learner.share(self.link)
        await self.shadow.open()
        if self.worker.index == 0:  # one scheduled refresh per host; the other workers follow its version
            self._tasks.append(loop.create_task(self.refresher.run_every()))
        if self.worker.shared:
            self._tasks += [loop.create_task(self.refresher.follow_every()), loop.create_task(self._set_gauges_every())]
        self.scheduler.start()

    async def close(self) -> None:
        """Stop the background work and close the links, each step in bounded time: a step that does not end
        in time (a Redis client that does not answer its cancellation, say) is left to the process's end."""
        for task in self._tasks:
            task.cancel()
        await _within("stopping the background tasks", _CLOSE_TASKS_S, *self._tasks)
        await _within("stopping the scheduler", _CLOSE_TASKS_S, self.scheduler.stop())
        await _within("stopping the shadow answers", _CLOSE_TASKS_S, self.shadow.close())
        if self.session:
            await _within("closing the upstream connections", _CLOSE_TASKS_S, self.session.close())
        if self.spend is not None:
            await _within("writing the spend", _CLOSE_FLUSH_S + 0.5, self.spend.aclose(_CLOSE_FLUSH_S))
        await _within("writing the labels", _CLOSE_FLUSH_S + 0.5, self.learner.close(_CLOSE_FLUSH_S))
        if self.link is not None:
            await _within("closing the redis link", _CLOSE_LINK_S, self.link.close())
        if self.tracing is not None:
            await _within("exporting the traces", self.store.current.tracing.export_timeout_s + 0.5,
                          asyncio.get_running_loop().run_in_executor(None, self.tracing.close))

    def _open_spend(self, cfg: Config) -> None:
        if self.spend is None and cfg.auth.keys:
            self.spend = open_spend_ledger(cfg, self.worker)

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
        log.info("config reloaded: %d instances, policy %s, %d keys", len(cfg.instances), cfg.scheduler.policy,
                 len(cfg.auth.keys))
        try:
            self._open_spend(cfg)
        except SpendStoreError as e:  # keyed requests are refused (503) until a reload opens it
            log.error("cannot open the spend ledger: %s", e)
        self.access.reconfigure(cfg)
        self.learner.reconfigure(cfg)
        if not cfg.auth.keys and not anonymous_allowed(cfg.auth, self.host):
            log.warning("the config has no API keys and the gateway listens on %s: every request is refused "
                        "(401) until keys are added or [auth] allow_anonymous is set", self.host)

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

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._complete(request, "responses")

    async def _complete(self, request: web.Request, route: str) -> web.StreamResponse:
        cfg = self.store.current
        loop = asyncio.get_running_loop()
        start = loop.time()
        attempt = Attempt()
        slo: SloCheck | None = None
        spend: RequestSpend | None = None
        key: ApiKey | None = None
        call: DecidedCall | None = None  # a dispatched call: what its answer teaches is learned at the end
        policy = cfg.scheduler.policy
        trace = self.tracing.request(request.headers, route, request.path) if self.tracing is not None else None
        self.metrics.in_flight.inc()
        try:
            key = self.access.authorize(request, cfg, self.host)
            raw = await read_body(request, cfg.server.max_body_bytes, cfg.server.body_timeout_s)
            if route == "responses":
                req = parse_responses(raw, request.headers, presets=cfg.scheduler.presets, policies=registry.names(),
                                      max_slo_s=cfg.slo.max_s)
            else:
                req = parse_completion(raw, request.headers, chat=route == "chat", presets=cfg.scheduler.presets,
                                       policies=registry.names(), max_slo_s=cfg.slo.max_s)
            self.access.permit(key, req, loop.time())
            policy = resolve_policy(cfg, req.routing, key)
            slo = SloCheck(*resolve_slo(cfg, req.routing, key), start, loop.time, cfg.slo.classes)
            candidates = candidates_for(cfg, req.model)
            if isinstance(req, ResponsesRequest) and req.previous_response_id is not None:
                # a follow-up goes where the response it continues is stored (serving/stored_responses.py)
                candidates = (stored_at(cfg, req.previous_response_id, candidates, self.scheduler.routable),)
            if key is not None and self.spend is None:  # keys without their ledger: fail closed
                raise ApiError(503, "the spend ledger is unavailable; requests of keys are refused until it is back",
                               None, "ledger_unavailable", headers={"Retry-After": "5"})
            spend = RequestSpend(req.routing.budget_usd, key, self.spend, time.time)
            await spend.load()
            budget = spend.budget_left()
            if budget is not None and budget <= 0 and spend.limited_by_key():  # reads the ledger only when spent
                raise spend.refusal()
            salt = cache_salt(key, req.body)
            input_tokens, prefix = await self._count_prompt(req, cfg, len(raw), policy, salt)
            routed = RouteRequest(
                candidates=candidates,
                prompt_text=req.prompt_text,
                input_tokens=input_tokens,
                max_tokens=req.max_tokens,
                weights=resolve_weights(cfg, req.routing, key),
                budget_usd=budget,
                policy=policy,
                n=req.n,
                slo_s=slo.slo_s,
                tpot_slo_s=slo.tpot_slo_s,
                slo_class=slo.slo_class,
                to_max_tokens=req.runs_to_max_tokens,
                explore=key is None or key.learn,
                prefix=prefix,
                session=req.body.get("user") if isinstance(req.body.get("user"), str) else None,
            )
            if trace is not None:
                preset = None if req.routing.weights is not None else request_preset(cfg, req.routing, key)
                trace.routed(cfg, routed, req.model, preset, req.stream)
            if req.routing.mode == "progressive":
                served = await self.progressive.serve(request, cfg, req, spend, routed, trace)
                if not isinstance(served, FellBack):
                    attempt.instance, attempt.status = PROGRESSIVE, served.status
                    self.metrics.e2e.labels(route).observe(loop.time() - start)
                    return served
                attempt.headers = served.headers()
                routed = dataclasses.replace(routed, budget_usd=spend.budget_left())  # a failed sketch was paid for
            ticket = await self.scheduler.decide(routed, req.model, req.stream, cfg, trace)
            if trace is not None:
                trace.decided(ticket)
            refused = ticket.decision.refused
            if refused:
                self.scheduler.complete(ticket, Completion(False, None))
                self.metrics.rejected.labels(refused.reason).inc()
                if refused.code == "insufficient_budget" and spend.limited_by_key():
                    raise spend.refusal()
                raise refusal_error(refused)
            call = DecidedCall(ticket, req, spend, route, request, slo, attempt, trace)
            try:
                resp = await self.dispatcher.serve(call)
            except ApiError as e:
                if e.code == "no_healthy_instance" and isinstance(req, ResponsesRequest) and req.previous_response_id:
                    # the instance holding the response went down after the check above (a scrape saw it first):
                    # say so as the check does
                    stored_at(cfg, req.previous_response_id, candidates, self.scheduler.routable)
                raise
            result = attempt.result
            attempt.status = result.failed_status or resp.status
            self.metrics.e2e.labels(route).observe(loop.time() - start)
            if result.first_byte_s is not None:
                self.metrics.ttft.labels(route).observe(result.first_byte_s - start)
            if result.budget_exhausted:
                self.metrics.budget_stops.inc()
            return resp
        except ApiError as e:
            attempt.status = e.status
            if trace is not None:
                trace.failed(e)
            raise
        except asyncio.CancelledError:
            # The client went away: before its answer was whole (499), or once it was (an SDK hangs up
            # on [DONE]), which is a served request.
            attempt.status = 200 if attempt.result.final and not attempt.result.failed_status else 499
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels(route, attempt.instance, str(attempt.status)).inc()
            # Whatever the request paid, on any path (a progressive request's calls, a sketch before a fallback).
            if spend is not None and spend.key is not None and spend.paid_usd:
                self.metrics.key_spend.labels(spend.key.name).inc(spend.paid_usd)
            if slo is not None and slo.any and attempt.instance != PROGRESSIVE:  # its calls carry no SLO
                self._count_slo(slo, policy, attempt)
            if call is not None:
                self._learn(cfg, key, request, call, attempt)
            if trace is not None:
                trace.end(attempt.status, attempt.instance, attempt.result)

    def _learn(self, cfg: Config, key: ApiKey | None, request: web.Request, call: DecidedCall,
               attempt: Attempt) -> None:
        """Learning never costs a client its answer: a failure here is logged, not raised."""
        try:
            self.learner.observe(cfg, key, request.remote, call, attempt)
            self.shadow.offer(cfg, key, call, attempt)
        except Exception:
            log.exception("could not learn from the answer of %s", attempt.instance)

    def _count_slo(self, slo: SloCheck, policy: str, attempt: Attempt) -> None:
        """Attainment per policy and SLO class: met, missed (served late, or failed), refused (never served)."""
        served = attempt.index is not None and attempt.status < 400
        if served and slo.met is None and slo.tpot_met is None:
            slo.judge(attempt.result.completion_tokens)  # its usage never went out (e.g. the client asked none)

        def result(met: bool | None) -> str:
            if attempt.index is None:
                return "refused"
            return "met" if served and met else "missed"

        if slo.slo_s is not None:
            self.metrics.slo.labels(policy, slo.slo_class, result(slo.met)).inc()
        if slo.tpot_slo_s is not None:
            self.metrics.tpot_slo.labels(policy, result(slo.tpot_met)).inc()

    async def _count_prompt(self, req: CompletionRequest, cfg: Config, body_bytes: int, policy: str,
                            salt: str | None) -> tuple[int, tuple[int, ...]]:
        """Prompt tokens as the instance will count them (function signatures included), and its prefix blocks
        where its policy reads the prefix index (serving/prefixes.py); a large request (judged by its body) is
        measured in a worker thread so the event loop keeps serving."""
        scheduler = cfg.scheduler
        block = scheduler.prefix_block_tokens if registry.hashes_prompts(policy, scheduler.prefix_cache) else None
        if body_bytes <= cfg.server.tokenize_inline_chars:
            return measure_prompt(self.token_counter, req, block, salt)
        return await asyncio.get_running_loop().run_in_executor(None, measure_prompt, self.token_counter, req,
                                                                block, salt)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.store.current
        key = self.access.authorize(request, cfg, self.host)  # as OpenAI's: the pool's names are not public
        created = int(time.time())
        data = [{"id": a, "object": "model", "created": created, "owned_by": "routebalance"}
                for a in cfg.server.aliases if may_name(key, a)]
        data += [{"id": m, "object": "model", "created": created, "owned_by": "vllm"}
                 for m in (*cfg.models(), *cfg.embedding_models()) if may_name(key, m)]
        return _json({"object": "list", "data": data})

    async def health(self, request: web.Request) -> web.Response:
        """Liveness: the process answers (with `serve --workers`, which worker: the port is theirs together)."""
        body: dict = {"status": "ok", "instances": len(self.store.current.instances)}
        if self.kv_events.status:  # each event stream's state: "ok", or why the approximate index stands in
            body["kv_events"] = self.kv_events.health()
        if self.worker.shared:
            body["worker"] = {"index": self.worker.index, "of": self.worker.count}
        return _json(body)

    async def ready(self, request: web.Request) -> web.Response:
        """Readiness: 503 while no instance is routable (all cooling down after failures). A replica that
        lost its shared state stays ready (it routes on its own view) and says so."""
        cfg = self.store.current
        routable = [i.name for i in self.scheduler.routable_instances(cfg)]
        body = {"status": "ready" if routable else "unavailable", "routable": len(routable),
                "instances": len(cfg.instances),
                "cooling_down": [i.name for i in cfg.instances if i.name not in routable],
                "state": self._state_status(cfg)}
        return web.Response(status=200 if routable else 503, body=orjson.dumps(body), content_type="application/json")

    def _state_status(self, cfg: Config) -> dict:
        if self.link is None:
            return {"backend": cfg.state.backend, "reachable": True}
        status = {"backend": "redis", "reachable": self.link.reachable, "replica": self.link.replica}
        if not self.link.reachable:
            status["spend_limits"] = ("refused until redis is back" if cfg.state.on_unavailable == "refuse"
                                      else "checked on this replica's last view")
        return status

    async def metrics_page(self, request: web.Request) -> web.Response:
        self._set_gauges()
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def _set_gauges(self) -> None:
        """The gauges read off the pool state and the state backend (at each scrape; with workers, also every
        GAUGES_EVERY_S, since a scrape reaches one worker and the page counts every worker's last values)."""
        cfg, now = self.store.current, asyncio.get_running_loop().time()
        m = self.metrics
        pairs = list(self.scheduler.instance_states(cfg))
        rates = prefill_rates([inst for inst, _ in pairs], [state for _, state in pairs])
        for (inst, state), rate in zip(pairs, rates, strict=True):
            m.prefill_rate.labels(inst.name).set(rate)
            m.instance_routable.labels(inst.name).set(state.routable(now))
            m.instance_in_flight.labels(inst.name).set(len(state.in_flight) + state.others.requests)
            snap = state.last
            if snap is not None and snap.prefix_queries > 0:
                m.prefix_hit_rate.labels(inst.name).set(snap.prefix_hits / snap.prefix_queries)
            for source, index in (("sent", state.sent), ("reported", state.reported and state.reported.index)):
                if index is not None:
                    m.prefix_index_blocks.labels(inst.name, source).set(len(index))
            if inst.kv_events is not None:
                m.kv_events_up.labels(inst.name).set(state.events_ok)
        m.state_up.set(self.link is None or self.link.reachable)
        m.spend_unwritten.set(self.spend.unwritten if self.spend is not None else 0)

    async def _set_gauges_every(self) -> None:
        while True:
            await asyncio.sleep(GAUGES_EVERY_S)
            self._set_gauges()

    async def embeddings(self, request: web.Request) -> web.Response:
        return await self.embeddings_handler.handle(request, self.store.current, self.host)

    async def feedback(self, request: web.Request) -> web.Response:
        return await self.feedback_handler.handle(request, self.store.current, self.host)

    async def admin_refresh(self, request: web.Request) -> web.Response:
        check_admin(request, self.store.current)
        return _json(await self.refresher.refresh("admin endpoint"))

    async def admin_rollback(self, request: web.Request) -> web.Response:
        check_admin(request, self.store.current)
        return _json(await self.refresher.rollback())

    async def admin_reload(self, request: web.Request) -> web.Response:
        check_admin(request, self.store.current)
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
    # Body size and read time: checked per request by read_body, so a reload applies.
    app = web.Application(middlewares=[openai_errors, json_posts_only], handler_args=handler_args(gateway.store))
    app.router.add_post("/v1/chat/completions", gateway.chat)
    app.router.add_post("/v1/completions", gateway.completions)
    app.router.add_post("/v1/responses", gateway.responses)
    app.router.add_get("/v1/models", gateway.models)
    app.router.add_post("/v1/embeddings", gateway.embeddings)
    app.router.add_post("/v1/feedback", gateway.feedback)
    app.router.add_get("/health", gateway.health)
    app.router.add_get("/health/ready", gateway.ready)
    if gateway.store.current.server.metrics_port is None:
        app.router.add_get("/metrics", gateway.metrics_page)
    app.router.add_post("/admin/reload", gateway.admin_reload)
    app.router.add_post("/admin/refresh", gateway.admin_refresh)
    app.router.add_post("/admin/rollback", gateway.admin_rollback)

    async def lifecycle(app: web.Application):
        await gateway.open()
        watcher = asyncio.create_task(watch_file(gateway.store, gateway.count_reload))
        yield
        watcher.cancel()
        await _within("stopping the config watcher", _CLOSE_TASKS_S, watcher)
        await gateway.close()

    app.cleanup_ctx.append(lifecycle)
    return app


def handler_args(store: ConfigStore) -> dict:
    """Connection bounds of the HTTP server (fixed at start: a reload does not change them)."""
    server = store.current.server
    # aiohttp closes a connection that has been idle, or has not sent a whole request
    # head, for keepalive_timeout: that is what stops a slow client holding it.
    return {"keepalive_timeout": server.keepalive_timeout_s, "max_line_size": server.max_header_bytes,
            "max_field_size": server.max_header_bytes, "max_headers": server.max_headers}


class _Refused(asyncio.Protocol):
    """A connection over the cap: closed as soon as it is made."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        transport.close()


# How long a hand-over lets the previous runner's connections finish their answers before it closes them.
HAND_OVER_GRACE_S = 2.0


class CappedListener:
    """The API's listening socket: aiohttp's request handler (the runner's public `server`, a protocol
    factory) for each new connection while fewer than `max_connections` are open, else a connection closed
    at once. `hand_over` gives the socket to another runner (`up`'s start-up placeholder to the gateway);
    `cleanup` stops accepting first, then lets the runner close what is open."""

    def __init__(self, runner: web.BaseRunner, max_connections: int):
        self.runner = runner
        self.max_connections = max_connections
        self._server: asyncio.AbstractServer | None = None

    def protocol(self) -> asyncio.BaseProtocol:
        server = self.runner.server
        assert server is not None  # set up before listening
        return server() if len(server.connections) < self.max_connections else _Refused()

    async def start(self, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                    reuse_port: bool = False) -> None:
        self._server = await asyncio.get_running_loop().create_server(
            self.protocol, host, port, backlog=1024, reuse_address=True, reuse_port=reuse_port or None,
            ssl=ssl_context)

    async def hand_over(self, runner: web.BaseRunner) -> None:
        """Serve every new connection with `runner` (set up) from now on, on the same listening socket: closing
        one socket and binding another refuses the connections that come in between, and a client that saw
        the port open must never find it closed. The previous runner's connections finish their answers
        (within HAND_OVER_GRACE_S; the placeholder's close after one) before it is cleaned up."""
        previous, self.runner = self.runner, runner
        server = previous.server
        for _ in range(int(HAND_OVER_GRACE_S / 0.01)):
            if server is None or not server.connections:
                break
            await asyncio.sleep(0.01)
        await previous.cleanup()

    async def cleanup(self) -> None:
        if self._server is not None:
            self._server.close()
        await self.runner.cleanup()


async def listen(gateway: Gateway, host: str, port: int, *, ssl_context: ssl.SSLContext | None = None,
                 reuse_port: bool = False, listener: CappedListener | None = None) -> list:
    """Serve the gateway's API on host:port (and /metrics on [server].metrics_port if set); `reuse_port` lets
    several processes share the port (SO_REUSEPORT). `listener`: one already listening on host:port (`up`'s
    start-up placeholder), handed over to the gateway instead of a new socket bound; from this call on it is
    cleaned up here on failure, or by the caller with the rest. Returns what to clean up, in this order."""
    server = gateway.store.current.server
    runner = web.AppRunner(build_app(gateway), handler_cancellation=True, access_log=None,
                           shutdown_timeout=server.shutdown_timeout_s)
    api = listener or CappedListener(runner, server.max_connections)
    runners: list = [api]
    try:
        await runner.setup()  # the gateway's start-up (its app's cleanup_ctx), a placeholder still answering
        if listener is None:
            await api.start(host, port, ssl_context=ssl_context, reuse_port=reuse_port)
        else:
            await listener.hand_over(runner)
        if server.metrics_port is not None:
            metrics = web.Application()
            metrics.router.add_get("/metrics", gateway.metrics_page)
            metrics_runner = web.AppRunner(metrics, access_log=None, keepalive_timeout=server.keepalive_timeout_s,
                                           shutdown_timeout=server.shutdown_timeout_s)
            await metrics_runner.setup()
            runners.append(metrics_runner)
            await web.TCPSite(metrics_runner, host, server.metrics_port, reuse_address=True,
                              reuse_port=reuse_port or None, ssl_context=ssl_context).start()
    except BaseException:
        for r in reversed(runners):
            await r.cleanup()
        raise
    return runners
