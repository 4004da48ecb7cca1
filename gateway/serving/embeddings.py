"""POST /v1/embeddings: to the model's embed instances (`kind = "embed"`), by load, priced per input token.

Keys, rate limits and spend limits apply as to any request: each attempt reserves its worst case against
the key (the inputs as counted, plus their special tokens, each at most the model's context) and is paid
at the tokens the instance reports, once. The scheduling loop, its policies and estimators, answer-length
learning and the judge never see an embeddings request: there is no answer to predict, learn or judge.
A connection failure or 5xx goes on to the next instance, as a chat request's attempt does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import aiohttp
import orjson
from aiohttp import web

from gateway.api.embeddings import EmbeddingsRequest, parse_embeddings
from gateway.api.errors import ApiError
from gateway.config.sections import ApiKey, Config, Instance
from gateway.serving.body import read_body
from gateway.serving.embed_pool import EmbedPool
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.relay import (
    COUNTED,
    Costing,
    UpstreamFailed,
    client_error,
    client_trace,
    open_upstream,
    read_answer,
    route_headers,
    upstream_timeout,
    usage_count,
)
from gateway.tenancy.access import Access
from gateway.tenancy.spend.request import KeyLedger, RequestSpend
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.serving.tracing import RequestTrace, Tracing

ROUTE = "/v1/embeddings"
# Tokens an embedding model adds to each input ([CLS] and [SEP] of a BERT-style tokenizer), reserved on top of
# the gateway's count, whose tokenizer is not the model's.
SPECIAL_TOKENS = 2


def embedders_for(cfg: Config, model: str) -> tuple[Instance, ...]:
    """The embed instances serving `model`; 400 for a generating model, 404 for an unknown one."""
    found = tuple(inst for inst in cfg.embedders if inst.model == model)
    if found:
        return found
    embedding = ", ".join(cfg.embedding_models()) or "none in this pool"
    if model in cfg.models() or model in cfg.server.aliases:
        raise ApiError(400, f"'{model}' does not serve embeddings; embedding models: {embedding}", "model",
                       "model_not_supported")
    raise ApiError(404, f"The model '{model}' does not exist; embedding models: {embedding}", "model",
                   "model_not_found")


class EmbeddingsHandler:
    def __init__(self, access: Access, metrics: GatewayMetrics, token_counter: TokenCounter,
                 session: Callable[[], aiohttp.ClientSession | None], ledger: Callable[[], KeyLedger | None],
                 tracing: Tracing | None = None):
        self.access = access
        self.tracing = tracing  # the gateway's tracer, when it traces (serving/tracing.py)
        self.metrics = metrics
        self.token_counter = token_counter
        self._session = session  # the gateway's pooled client session
        self._ledger = ledger  # the gateway's spend ledger (opened when the config first has keys)
        self.pool = EmbedPool()

    async def handle(self, request: web.Request, cfg: Config, host: str) -> web.Response:
        loop = asyncio.get_running_loop()
        start = loop.time()
        status, instance = 500, "none"
        spend: RequestSpend | None = None
        trace = self.tracing.request(request.headers, "embeddings", request.path) if self.tracing is not None else None
        self.metrics.in_flight.inc()
        try:
            key = self.access.authorize(request, cfg, host)
            raw = await read_body(request, cfg.server.max_body_bytes, cfg.server.body_timeout_s)
            req = parse_embeddings(raw)
            self.access.permit_model(key, req.model, loop.time())
            instances = embedders_for(cfg, req.model)
            counts = await self._count(req, cfg, len(raw))
            worst_tokens = self._worst_tokens(req, counts, min(i.max_model_len for i in instances))
            spend = await self._spend(key)
            passed = client_trace(request.headers) if trace is None else None
            resp = await self._attempts(cfg, req, instances, sum(counts), worst_tokens, spend, trace, passed)
            status, instance = resp.status, resp.headers["X-Route-Instance"]
            self.metrics.e2e.labels("embeddings").observe(loop.time() - start)
            return resp
        except ApiError as e:
            status = e.status
            if trace is not None:
                trace.failed(e)
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        finally:
            self.metrics.in_flight.dec()
            self.metrics.requests.labels("embeddings", instance, str(status)).inc()
            if spend is not None and spend.key is not None and spend.paid_usd:
                self.metrics.key_spend.labels(spend.key.name).inc(spend.paid_usd)
            if trace is not None:
                trace.end(status, instance, None)

    async def _count(self, req: EmbeddingsRequest, cfg: Config, body_bytes: int) -> list[int]:
        """Each input's tokens (token ids count themselves); a large body is counted in a worker thread."""
        def count() -> list[int]:
            return [len(x) if isinstance(x, tuple) else self.token_counter.count(x) for x in req.inputs]
        if body_bytes <= cfg.server.tokenize_inline_chars:
            return count()
        return await asyncio.get_running_loop().run_in_executor(None, count)

    @staticmethod
    def _worst_tokens(req: EmbeddingsRequest, counts: list[int], max_len: int) -> int:
        """The most tokens the instance can bill: each input with its special tokens, at most the context.
        Past the context an input is refused (400) unless the client asks vLLM to truncate it."""
        truncates = req.body.get("truncate_prompt_tokens") is not None
        for i, n in enumerate(counts):
            if n > max_len and not truncates:
                raise ApiError(400, f"input {i} has {n} tokens; the model '{req.model}' embeds at most {max_len}",
                               "input", "context_length_exceeded")
        return sum(min(n + SPECIAL_TOKENS, max_len) for n in counts)

    async def _spend(self, key: ApiKey | None) -> RequestSpend:
        ledger = self._ledger()
        if key is not None and ledger is None:  # keys without their ledger: fail closed
            raise ApiError(503, "the spend ledger is unavailable; requests of keys are refused until it is back",
                           None, "ledger_unavailable", headers={"Retry-After": "5"})
        spend = RequestSpend(None, key, ledger, time.time)
        await spend.load()
        left = spend.budget_left()
        if left is not None and left <= 0:
            raise spend.refusal()
        return spend

    async def _attempts(self, cfg: Config, req: EmbeddingsRequest, instances: tuple[Instance, ...],
                        counted: int, worst_tokens: int, spend: RequestSpend,
                        trace: RequestTrace | None, passed: dict[str, str] | None) -> web.Response:
        """The least loaded instance first; on a connection failure or a 5xx the next, up to [upstream].retries
        failed attempts. Each attempt holds its worst case against the key and is paid for once. `passed`: the
        client's trace context, sent on when the gateway does not trace."""
        loop = asyncio.get_running_loop()
        up = cfg.upstream
        timeout = upstream_timeout(up, stream=False)
        failure: UpstreamFailed | None = None
        failed = attempts = 0
        for inst in self.pool.order(instances, loop.time()):
            if failed > up.retries:
                break
            session = self._session()
            assert session is not None  # opened with the app
            costing = Costing.for_instance(inst, counted, max_answer_bytes=up.max_response_bytes)
            worst = costing.cost(worst_tokens, 0)
            held = await self._hold(spend, worst)
            attempts += 1
            traced = trace.attempt(inst, attempts, None) if trace is not None else None
            cost: float | None = None
            try:
                with self.pool.running(inst.name):
                    payload = orjson.dumps({**req.body, "model": inst.model})
                    upstream = await open_upstream(session, inst, ROUTE, payload, timeout,
                                                   trace_headers=traced.headers if traced is not None else passed)
                    if traced is not None:
                        traced.answered(upstream.status)
                    if upstream.status >= 400:  # the instance is well; the request is not
                        self.pool.answered(inst.name)
                        cost = 0.0
                        raise await client_error(upstream)
                    data = await read_answer(upstream, inst, costing)
                self.pool.answered(inst.name)
                prompt, cost = self._cost(data, costing)
                self.metrics.answered(inst.model, cost, prompt, 0)
                headers = {**route_headers(inst), "X-Route-Cost-USD": f"{cost:.10f}"}
                return web.Response(body=orjson.dumps(data), content_type="application/json", headers=headers)
            except UpstreamFailed as e:
                failure = e
                if traced is not None:
                    traced.failed(e)
                if e.blame or e.unreachable:
                    self.pool.failed(inst.name, loop.time() + cfg.health.cooldown_s)
                cost = e.cost(costing, counted, worst)
                if e.unreachable:  # it never read the request: trying the next costs no retry
                    continue
                failed += 1
                if not e.retry:
                    break
            finally:
                spend.pay_held(held, worst if cost is None else cost)  # None: the client left mid-call
                if traced is not None:
                    traced.end()
        assert failure is not None  # every way out of the loop but an answer or a refusal failed an attempt
        raise ApiError(failure.status, str(failure))

    @staticmethod
    async def _hold(spend: RequestSpend, worst: float):
        """The attempt's worst case held against the key; 402 naming the inputs (not a chat request's
        max_tokens) when the key cannot cover it."""
        try:
            return await spend.hold(worst)
        except ApiError as e:
            if e.status != 402 or spend.key is None:
                raise
            key, left = spend.key, spend.key_remaining()
            raise ApiError(402, f"the key {key.name!r} cannot reserve this request's worst case of {worst:.10f} USD "
                                f"(its inputs' tokens) within its spend limit of {key.spend_limit_usd} USD"
                                + ("" if left is None else f" ({left:.10f} USD left)"),
                           "input", "spend_limit_exceeded") from None

    @staticmethod
    def _cost(data: dict, costing: Costing) -> tuple[int, float]:
        """The answer's cost from the tokens the instance reports (its usage gains `cost_usd`), else from the
        gateway's own count, marked as counted."""
        usage = data.get("usage")
        if isinstance(usage, dict) and "prompt_tokens" in usage:
            prompt = usage_count(usage, "prompt_tokens")
        else:
            prompt = costing.prompt_tokens
            usage = data["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt, "cost_source": COUNTED}
        usage["prompt_tokens"] = prompt
        usage["cost_usd"] = cost = costing.cost(prompt, 0)
        return prompt, cost
