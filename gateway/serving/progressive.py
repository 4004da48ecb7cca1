"""Progressive mode's shell (PICE, papers/pice-progressive-inference.txt): the calls the plan makes.

One request asking for `routing.mode = "progressive"` (or `X-Route-Mode: progressive`) is served as:

1. the fallback rule (core/progressive.py `fallback_reason`, limits in the config's [progressive]):
   code and empty prompts go through normal routing at once, as do requests the mode cannot serve
   (tools, media, a last turn that is not the user's); single facts and prompts whose predicted answer
   on the largest tier is short go through normal routing once the sketch call is decided (its batch's
   estimate carries that length); each counted in `routebalance_progressive_requests{result=<reason>}`,
   and the answer says so (`X-Route-Mode: normal`, `X-Route-Fallback: <reason>`);
2. the budget: the plan's worst case with one candidate per point and the most points must fit the
   request's budget and its key's remaining spend, else normal routing (which serves or refuses, 402);
3. one sketch call on the pool's largest tier (the model with the highest price); a sketch of fewer
   than `min_points` points, or a failed one, goes through normal routing (its cost stays booked, and
   `X-Route-Fallback-Cost-USD` says how much);
4. one expansion call per point and candidate, all in parallel, on the cheapest models (candidate k
   on the k-th cheapest, so candidates differ; with a `seed`, candidate k samples with seed + k), each
   asking for logprobs; each point keeps its most confident expansion (PICE's Eq. 3, core/progressive.py
   `confidence`: token probability, length and ROUGE-L against the point, weighted by [progressive]); a point
   whose every candidate failed keeps the sketch's own words
   (`routebalance_progressive_points{result="sketch_text"}`);
5. the answer: one chat.completion, or a stream that sends the points in order as each is ready.

Every call is a request of its own to the scheduling loop: decided by the request's policy (among the
instances of its model) in a batch with the others, booked in the pool state, dispatched, retried and
paid like any request (gateway/serving/dispatch.py), so failures count towards instance health and
cooldowns. The calls carry no SLO of their own (the request's end-to-end SLO is not split among them).

The sketch and every expansion carry the request's system prompt and earlier turns before their own
prompt, which replaces the last user turn, and the request's sampling parameters (`SAMPLING`).

Money: every attempt of every call reserves its worst case against the key before it goes and pays its
real cost when it ends (a call the key cannot cover is dropped, like a failed one); the answer's usage
sums the tokens of every call (the sketch and every candidate, each its last attempt's) and its
`cost_usd` what every attempt cost, which is what the key is booked. The upstream calls themselves are
never streamed (the client's stream is the gateway's). Each call is a request to the scheduling loop, so
the decision metrics (batch wait, decisions per policy and model) count calls, not client requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import orjson
from aiohttp import web

from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.api.sse import DONE, json_event
from gateway.config.sections import Config
from gateway.core.budget import token_prices
from gateway.core.progressive import (
    Candidate,
    Fallback,
    Price,
    Usage,
    answer_part,
    assemble,
    candidates_within,
    choose,
    fallback_reason,
    parse_points,
    sum_usage,
    tiers,
)
from gateway.core.progressive_prompts import (
    EXPANSION_HEAD,
    QUESTION_MARK,
    SKELETON_MARK,
    expansion_prompt,
    sketch_prompt,
)
from gateway.core.request import Completion, RouteRequest, Ticket
from gateway.serving.dispatch import CallDispatcher, DecidedCall
from gateway.serving.driver import Scheduler, candidates_for
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.relay import STREAM_HEADERS
from gateway.tenancy.spend.request import RequestSpend
from gateway.tokens import TokenCounter

if TYPE_CHECKING:
    from gateway.serving.tracing import RequestTrace

log = logging.getLogger("routebalance.progressive")
PROGRESSIVE = "progressive"  # the counter's label for a request served progressively
# The request's fields every call carries (vLLM's sampling parameters); its stop strings, n, logprobs,
# response format and the like are not: they would break the sketch's numbered points or the assembly.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
            "seed")


@dataclass(slots=True)
class Calls:
    """Every upstream call of one progressive request: the tokens each answered with (the answer's usage)."""

    usages: list[Usage] = field(default_factory=list)
    paid_before: float = 0.0  # what the request had paid when its first call went
    trace: RequestTrace | None = None  # the request's span, when the gateway traces: each call's attempts go in it

    def total(self, spend: RequestSpend) -> Usage:
        """Every call's tokens, and what they cost together (every attempt, failed ones too: what the key
        was booked)."""
        tokens = sum_usage(self.usages)
        return Usage(tokens.prompt_tokens, tokens.completion_tokens, spend.paid_usd - self.paid_before)


@dataclass(frozen=True, slots=True)
class FellBack:
    """A progressive request to be routed normally: why, and what its sketch already cost (booked)."""

    reason: str
    paid_usd: float = 0.0

    def headers(self) -> dict[str, str]:
        """What the normally routed answer says of it."""
        out = {"X-Route-Mode": "normal", "X-Route-Fallback": self.reason}
        if self.paid_usd:
            out["X-Route-Fallback-Cost-USD"] = f"{self.paid_usd:.10f}"
        return out


class Progressive:
    """Serves progressive requests: every call it makes is decided by the scheduling loop (the request's
    policy, in a batch with the others) and dispatched like any request (gateway/serving/dispatch.py); the
    limits and the fallback rule are the config's [progressive], read per request."""

    def __init__(self, scheduler: Scheduler, dispatcher: CallDispatcher, metrics: GatewayMetrics,
                 token_counter: TokenCounter):
        self.scheduler = scheduler
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.token_counter = token_counter

    def fall_back(self, reason: str, paid_usd: float = 0.0) -> FellBack:
        self.metrics.progressive.labels(reason).inc()
        log.info("progressive request served normally: %s", reason)
        return FellBack(reason, paid_usd)

    def tiers(self, cfg: Config) -> tuple[str, list[str]] | None:
        """The sketch model and the expansion models among the routable ones (core/progressive.py)."""
        routable = self.scheduler.routable_instances(cfg)
        return tiers({inst.model: (inst.price_output_per_mtok, inst.price_input_per_mtok) for inst in routable},
                     cfg.progressive.candidates)

    # ---- one call --------------------------------------------------------------------------------------
    async def _decide(self, cfg: Config, req: CompletionRequest, routed: RouteRequest, spend: RequestSpend,
                      model: str, messages: list[dict], max_tokens: int, logprobs: bool, sampling: dict,
                      trace: RequestTrace | None) -> tuple[Ticket, CompletionRequest]:
        """A call to `model` decided by the request's policy, in the next batch. The estimators see the
        request's question (the embedder's cache answers it after the first call)."""
        body: dict = {**sampling, "model": model, "messages": messages, "max_tokens": max_tokens, "stream": False}
        if logprobs:
            body["logprobs"] = True
        call = CompletionRequest(chat=True, body=body, model=model, stream=False, include_usage=False,
                                 prompt_text=req.prompt_text, max_tokens=max_tokens, routing=req.routing)
        routed = dataclasses.replace(
            routed, candidates=candidates_for(cfg, model), input_tokens=self.token_counter.count_chat(messages),
            max_tokens=max_tokens, budget_usd=spend.budget_left(), n=1, slo_s=None, tpot_slo_s=None,
            slo_class="none", to_max_tokens=False)
        return await self.scheduler.decide(routed, model, False, cfg, trace), call

    async def _run(self, ticket: Ticket, call: CompletionRequest, spend: RequestSpend,
                   calls: Calls) -> tuple[dict | None, DecidedCall | None]:
        """Dispatch a decided call; its answer's JSON (None if it was refused or failed: its attempts are paid),
        and the call (None if it never went). Raises the 402 of a key that cannot cover it."""
        refused = ticket.decision.refused if ticket.decision is not None else None
        if refused is not None:
            self.scheduler.complete(ticket, Completion(False, None))
            log.warning("progressive call to %s refused: %s", ticket.model, refused.message)
            return None, None
        done = DecidedCall(ticket, call, spend, trace=calls.trace)
        try:
            resp = await self.dispatcher.serve(done)
        except ApiError as e:
            if e.status == 402:
                raise
            log.warning("progressive call to %s failed: %s", ticket.model, e.message)
            return None, done
        finally:
            result = done.attempt.result
            calls.usages.append(Usage(result.prompt_tokens, result.completion_tokens))
        if resp.status >= 400 or not isinstance(resp, web.Response) or not isinstance(resp.body, bytes):
            return None, done
        return orjson.loads(resp.body), done

    # ---- the request -----------------------------------------------------------------------------------
    async def serve(self, request: web.Request, cfg: Config, req: CompletionRequest, spend: RequestSpend,
                    routed: RouteRequest, trace: RequestTrace | None = None) -> web.StreamResponse | FellBack:
        """The progressive answer, or why the request is to be routed normally (counted). `routed` is the
        request as normal routing would schedule it: its calls take its weights and policy. A traced request's
        span gets every call's estimate and attempts as children."""
        limits, question = cfg.progressive.limits(), req.prompt_text
        history = _history(req)
        if history is None:
            return self.fall_back("unsupported")
        picked = self.tiers(cfg)
        if picked is None:
            return self.fall_back("no_tiers")
        large, small = picked
        rule = cfg.progressive.rule()
        reason = fallback_reason(question, None, rule)
        if reason in (Fallback.EMPTY, Fallback.CODE):  # the prompt alone decides: no embedding
            return self.fall_back(reason.value)
        prices = {inst.model: Price(*token_prices(inst)) for inst in cfg.instances}
        sketch_messages = [*history, {"role": "user", "content": sketch_prompt(question, limits.max_points)}]
        tokens = {"sketch": self.token_counter.count_chat(sketch_messages),
                  # the expansion prompt carries the question and a skeleton of at most sketch_max_tokens,
                  # renumbered ("N. " per point)
                  "expand": self.token_counter.count_chat([*history, {
                      "role": "user", "content": EXPANSION_HEAD + SKELETON_MARK + QUESTION_MARK + question}])
                  + limits.sketch_max_tokens + 3 * limits.max_points}
        if candidates_within(large, small, tokens, prices, spend.budget_left(), limits) == 0:
            return self.fall_back("budget")
        calls = Calls(paid_before=spend.paid_usd, trace=trace)
        try:
            ticket, call = await self._decide(cfg, req, routed, spend, large, sketch_messages,
                                              limits.sketch_max_tokens, False, _sampling(req, 0), trace)
        except ApiError:  # the queue is full, or no decision in time: normal routing decides
            return self.fall_back("sketch_failed")
        # The sketch's decision carries the estimators' answer length on the largest tier (its batch's
        # estimate): the short-answer rule reads it, and the sketch goes only if the prompt suits the mode.
        # A policy that asks for no estimates leaves it None: the length rules then see no estimate.
        d = ticket.decision
        reason = fallback_reason(question, d.answer_tokens if d is not None else None, rule)
        if reason is not None:
            self.scheduler.complete(ticket, Completion(False, None))
            return self.fall_back(reason.value)
        try:
            sketch, sketched = await self._run(ticket, call, spend, calls)
        except ApiError:  # the key cannot cover it now (others spent meanwhile): normal routing decides
            return self.fall_back("budget", calls.total(spend).cost)
        if sketched is None:  # its policy refused it (its budget, say): normal routing decides
            return self.fall_back("sketch_failed")
        points = parse_points(_content(sketch) or "", limits.max_points) if sketch is not None else []
        if sketch is None or len(points) < limits.min_points:  # normal routing; the sketch stays paid
            return self.fall_back("sketch_failed" if sketch is None else "few_points", calls.total(spend).cost)
        prompts = [[*history, {"role": "user", "content": expansion_prompt(question, points, p)}]
                   for p in range(1, len(points) + 1)]
        tokens["expand"] = max(self.token_counter.count_chat(p) for p in prompts)
        # at least one candidate: the fit of one was checked before the sketch (a call the key cannot cover
        # is dropped, its point keeping the sketch's words)
        n_cand = candidates_within(large, small, tokens, prices, spend.budget_left(), limits, len(points),
                                   sketched=True) or 1
        self.metrics.progressive.labels(PROGRESSIVE).inc()

        async def expand(index: int) -> str | None:
            async def one(k: int) -> Candidate | None:
                model = small[k % len(small)]
                try:
                    ticket, call = await self._decide(cfg, req, routed, spend, model, prompts[index],
                                                      limits.expansion_max_tokens, True, _sampling(req, k), trace)
                    data, done = await self._run(ticket, call, spend, calls)
                except ApiError:  # not scheduled in time, or the key cannot cover this candidate: dropped
                    return None
                text = _content(data)
                if done is None or not text or not text.strip():
                    return None
                return Candidate(text, _logprobs(data), Usage(0, _completion_tokens(data)), done.attempt.instance)

            found = [c for c in await asyncio.gather(*(one(k) for k in range(n_cand))) if c is not None]
            if not found:
                self.metrics.progressive_points.labels("sketch_text").inc()
                return None
            self.metrics.progressive_points.labels("expanded").inc()
            return found[choose(found, points[index], limits.confidence)].text

        loop = asyncio.get_running_loop()
        tasks = [loop.create_task(expand(i)) for i in range(len(points))]
        headers = {"X-Route-Mode": PROGRESSIVE, "X-Route-Points": str(len(points)), "X-Route-Model": large,
                   "X-Route-Instance": sketched.attempt.instance, "X-Route-Candidates": str(n_cand)}
        rid, created = f"chatcmpl-prog-{uuid.uuid4().hex}", int(time.time())
        try:
            if req.stream:
                return await self._stream(request, cfg, req, points, tasks, calls, spend, headers, rid, created,
                                          large)
            expansions = list(await asyncio.gather(*tasks))
            total = calls.total(spend)
            message = {"role": "assistant", "content": assemble(points, expansions)}
            answer = {"id": rid, "object": "chat.completion", "created": created, "model": large,
                      "choices": [{"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}],
                      "usage": _usage(total)}
            headers["X-Route-Cost-USD"] = f"{total.cost:.10f}"
            return web.Response(body=orjson.dumps(answer), content_type="application/json", headers=headers)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # each pays for its calls

    async def _stream(self, request: web.Request, cfg: Config, req: CompletionRequest, points: Sequence[str],
                      tasks: list[asyncio.Task], calls: Calls, spend: RequestSpend, headers: dict[str, str],
                      rid: str, created: int, model: str) -> web.StreamResponse:
        """The points in order, each as soon as it and every point before it are ready."""
        resp = web.StreamResponse(headers={**STREAM_HEADERS, **headers})
        await resp.prepare(request)

        def chunk(delta: dict, finish: str | None = None) -> bytes:
            return json_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

        async def write(data: bytes) -> None:
            async with asyncio.timeout(cfg.server.write_timeout_s):
                await resp.write(data)

        await write(chunk({"role": "assistant", "content": ""}))
        for i, (point, task) in enumerate(zip(points, tasks, strict=True)):
            await write(chunk({"content": answer_part(i, point, await task)}))
        await write(chunk({}, "stop"))
        if req.include_usage:
            total = calls.total(spend)
            await write(json_event({"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
                                    "choices": [], "usage": _usage(total)}))
        await write(DONE)
        await resp.write_eof()
        return resp


def _sampling(req: CompletionRequest, candidate: int) -> dict:
    """The request's sampling parameters for one call; with an integer seed, candidate k samples with
    seed + k, so candidates on one model differ as sampling makes them, and a run repeats."""
    out = {name: req.body[name] for name in SAMPLING if name in req.body}
    seed = out.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool):
        out["seed"] = seed + candidate
    return out


def _history(req: CompletionRequest) -> list[dict] | None:
    """The turns before the last user turn (system prompt, earlier exchanges), which the sketch and every
    expansion carry before their own prompt; None when the request does not suit the mode: tools, media, or
    a last turn that is not the user's (the answer would continue it, not answer the question)."""
    messages = req.body["messages"]
    if req.tools or req.has_media or messages[-1].get("role") != "user":
        return None
    return list(messages[:-1])


def _content(data: dict | None) -> str | None:
    try:
        content = data["choices"][0]["message"]["content"]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return None
    return content if isinstance(content, str) else None


def _logprobs(data: dict) -> list[float] | None:
    try:
        content = data["choices"][0]["logprobs"]["content"]
        lps = [float(t["logprob"]) for t in content]
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return lps or None


def _completion_tokens(data: dict) -> int:
    usage = data.get("usage")
    v = usage.get("completion_tokens") if isinstance(usage, dict) else None
    return v if isinstance(v, int) and v >= 0 else 0


def _usage(total: Usage) -> dict:
    return {"prompt_tokens": total.prompt_tokens, "completion_tokens": total.completion_tokens,
            "total_tokens": total.total_tokens, "cost_usd": total.cost}
