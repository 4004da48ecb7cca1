"""Progressive mode's shell (PICE, papers/pice-progressive-inference.txt): the calls the plan makes.

One request asking for `routing.mode = "progressive"` (or `X-Route-Mode: progressive`) is served as:

1. the fallback rule (scheduling/progressive.py `fallback_reason`, limits in the config's [progressive]):
   code, single facts, empty prompts, and prompts whose predicted answer on the largest tier (the
   estimators' KNN length, one embedding) is short go through normal routing, as do requests the mode
   cannot serve (tools, media, a last turn that is not the user's); each counted in
   `routebalance_progressive_requests{result=<reason>}`, and the answer says so (`X-Route-Mode: normal`,
   `X-Route-Fallback: <reason>`);
2. the budget: the plan's worst case with one candidate per point and the most points must fit the
   request's budget and its key's remaining spend, else normal routing (which serves or refuses, 402);
3. one sketch call on the pool's largest tier (the model with the highest price), its least-loaded
   routable instance (a failed sketch is tried once more on another); a sketch of fewer than
   `min_points` points, or a sketch failed twice, goes through normal routing (its cost stays booked,
   and `X-Route-Fallback-Cost-USD` says how much);
4. one expansion call per point and candidate, all in parallel, on the cheapest models (candidate k
   on the k-th cheapest, so candidates differ; with a `seed`, candidate k samples with seed + k), each
   asking for logprobs; each point keeps its most
   confident expansion (mean token logprob); a point whose every candidate failed keeps the sketch's
   own words (`routebalance_progressive_points{result="sketch_text"}`);
5. the answer: one chat.completion, or a stream that sends the points in order as each is ready.

The sketch and every expansion carry the request's system prompt and earlier turns before their own
prompt, which replaces the last user turn, and the request's sampling parameters (`SAMPLING`).

Money: every upstream call reserves its worst case against the key before it goes and pays its real
cost when it ends (a call the key cannot cover is dropped, like a failed one); the answer's usage is
the sum over every call (the sketch and every candidate), with `cost_usd`, which is what the key is
booked. The upstream calls themselves are never streamed (the client's stream is the gateway's), and
they bypass the scheduler and its policies (least loaded among a model's instances instead) and the SLO
accounting (the README's "Not yet").
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field

import aiohttp
import orjson
from aiohttp import web

from gateway.accounting import RequestSpend, worst_case_usd
from gateway.api.errors import ApiError
from gateway.api.parse import CompletionRequest
from gateway.api.sse import DONE, json_event
from gateway.config import Config, Instance
from gateway.metrics import GatewayMetrics
from gateway.relay import (
    STREAM_HEADERS,
    Costing,
    RelayResult,
    UpstreamFailed,
    client_error,
    open_upstream,
    relay_full,
    upstream_timeout,
)
from gateway.scheduling.budget import per_token
from gateway.scheduling.ledger import PoolLedger
from gateway.scheduling.progressive import (
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
from gateway.tokens import TokenCounter
from gateway.workload.progressive import (
    EXPANSION_HEAD,
    QUESTION_MARK,
    SKELETON_MARK,
    expansion_prompt,
    sketch_prompt,
)

log = logging.getLogger("routebalance.progressive")
CHAT_PATH = "/v1/chat/completions"
PROGRESSIVE = "progressive"  # the counter's label for a request served progressively
SKETCH_ATTEMPTS = 2  # a failed sketch is tried once more, on another instance of the largest tier
# The request's fields every call carries (vLLM's sampling parameters); its stop strings, n, logprobs,
# response format and the like are not: they would break the sketch's numbered points or the assembly.
SAMPLING = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty", "repetition_penalty",
            "seed")


@dataclass(slots=True)
class Calls:
    """Every upstream call of one progressive request: what each cost (the answer's usage, the key's booking)."""

    usages: list[Usage] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=dict)  # this request's calls in flight, per instance

    @property
    def total(self) -> Usage:
        return sum_usage(self.usages)


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
    """Serves progressive requests through the gateway's session, pool ledger and metrics; the limits and the
    fallback rule are the config's [progressive], read per request."""

    def __init__(self, ledger: PoolLedger, metrics: GatewayMetrics, token_counter: TokenCounter, estimators=None):
        self.ledger = ledger
        self.metrics = metrics
        self.token_counter = token_counter
        self.estimators = estimators  # estimators.bundle.Estimators (the short-answer rule's length), or None

    def fall_back(self, reason: str, paid_usd: float = 0.0) -> FellBack:
        self.metrics.progressive.labels(reason).inc()
        log.info("progressive request served normally: %s", reason)
        return FellBack(reason, paid_usd)

    async def predicted_tokens(self, question: str, model: str) -> float | None:
        """The estimators' predicted answer length of `model` (None: not built, or a model without labels).
        One embedding, in the default executor: the event loop never waits on it."""
        if self.estimators is None:
            return None
        est = await asyncio.get_running_loop().run_in_executor(None, self.estimators.estimate, [question])
        return float(est.length[0, est.models.index(model)]) if model in est.models else None

    # ---- where the calls go ----------------------------------------------------------------------------
    def _pick(self, cfg: Config, model: str, calls: Calls, now: float, tried: Collection[str] = ()) -> Instance | None:
        """The least-loaded routable instance of `model` (the gateway's requests on it, this one's calls too),
        other than those `tried`."""
        best, best_load = None, 0.0
        for inst in cfg.instances:
            if inst.model != model or inst.name in tried or not self.ledger.routable(inst.name, now):
                continue
            state = self.ledger.of(inst.name)
            load = len(state.in_flight) + state.others.requests + calls.pending.get(inst.name, 0)
            if best is None or load < best_load:
                best, best_load = inst, load
        return best

    def tiers(self, cfg: Config, now: float) -> tuple[str, list[str]] | None:
        """The sketch model and the expansion models among the routable ones (scheduling/progressive.py)."""
        return tiers({inst.model: (inst.price_output_per_mtok, inst.price_input_per_mtok)
                      for inst in cfg.instances if self.ledger.routable(inst.name, now)}, cfg.progressive.candidates)

    # ---- one upstream call -----------------------------------------------------------------------------
    async def _call(self, session: aiohttp.ClientSession, cfg: Config, inst: Instance, messages: list[dict],
                    max_tokens: int, spend: RequestSpend, calls: Calls, logprobs: bool,
                    sampling: dict) -> dict | None:
        """One non-streamed call, reserved before and paid after; its answer's JSON, or None if it failed."""
        up = cfg.upstream
        timeout = upstream_timeout(up, stream=False)
        prompt_tokens = self.token_counter.count_chat(messages)
        worst = worst_case_usd(inst, prompt_tokens, max_tokens, 1)
        costing = Costing.for_instance(inst, prompt_tokens, self.token_counter.count, up.max_response_bytes,
                                       cfg.server.tokenize_inline_chars)
        body: dict = {**sampling, "model": inst.model, "messages": messages, "max_tokens": max_tokens,
                      "stream": False}
        if logprobs:
            body["logprobs"] = True
        held = await spend.hold(worst)  # 402 when the key cannot cover it: the caller decides
        rid = object()
        loop = asyncio.get_running_loop()
        self.ledger.of(inst.name).dispatched(rid, prompt_tokens, max_tokens, loop.time(), streaming=False)
        calls.pending[inst.name] = calls.pending.get(inst.name, 0) + 1
        result = RelayResult()
        cost: float | None = None
        try:
            upstream = await open_upstream(session, inst, CHAT_PATH, orjson.dumps(body), timeout, False)
            if upstream.status >= 400:
                cost = 0.0
                err = await client_error(upstream)
                log.warning("progressive call on %s refused: %s", inst.name, err.message)
                return None
            resp = await relay_full(upstream, inst, result, costing)
            cost = result.cost_usd
            assert isinstance(resp.body, bytes)
            return orjson.loads(resp.body)
        except UpstreamFailed as e:
            log.warning("progressive call on %s failed: %s", inst.name, e)
            cost = e.cost(costing, prompt_tokens, worst)
            return None
        finally:
            self.ledger.of(inst.name).done(rid)
            calls.pending[inst.name] -= 1
            if cost is None:  # cancelled: the client left
                cost = result.cost_when_left(worst)
            spend.pay_held(held, cost)
            calls.usages.append(Usage(result.prompt_tokens, result.completion_tokens, cost))
            if result.cost_usd is not None:
                self.metrics.answered(inst.model, result.cost_usd, result.prompt_tokens, result.completion_tokens)

    # ---- the request -----------------------------------------------------------------------------------
    async def serve(self, request: web.Request, session: aiohttp.ClientSession, cfg: Config,
                    req: CompletionRequest, spend: RequestSpend) -> web.StreamResponse | FellBack:
        """The progressive answer, or why the request is to be routed normally (counted)."""
        limits, question = cfg.progressive.limits(), req.prompt_text
        history = _history(req)
        if history is None:
            return self.fall_back("unsupported")
        loop = asyncio.get_running_loop()
        picked = self.tiers(cfg, loop.time())
        if picked is None:
            return self.fall_back("no_tiers")
        large, small = picked
        rule = cfg.progressive.rule()
        reason = fallback_reason(question, None, rule)
        if reason in (Fallback.EMPTY, Fallback.CODE):  # the prompt alone decides: no embedding
            return self.fall_back(reason.value)
        # The scheduler embeds the same text if the request falls back: the embedder's cache answers it then.
        reason = fallback_reason(question, await self.predicted_tokens(question, large), rule)
        if reason is not None:
            return self.fall_back(reason.value)
        prices = {inst.model: Price(per_token(inst.price_input_per_mtok), per_token(inst.price_output_per_mtok))
                  for inst in cfg.instances}
        sketch_messages = [*history, {"role": "user", "content": sketch_prompt(question, limits.max_points)}]
        tokens = {"sketch": self.token_counter.count_chat(sketch_messages),
                  # the expansion prompt carries the question and a skeleton of at most sketch_max_tokens,
                  # renumbered ("N. " per point)
                  "expand": self.token_counter.count_chat([*history, {
                      "role": "user", "content": EXPANSION_HEAD + SKELETON_MARK + QUESTION_MARK + question}])
                  + limits.sketch_max_tokens + 3 * limits.max_points}
        if candidates_within(large, small, tokens, prices, spend.budget_left(), limits) == 0:
            return self.fall_back("budget")
        calls = Calls()
        sketch, tried = None, []
        while sketch is None and len(tried) < SKETCH_ATTEMPTS:
            sketch_inst = self._pick(cfg, large, calls, loop.time(), tried)
            if sketch_inst is None:
                break
            try:
                sketch = await self._call(session, cfg, sketch_inst, sketch_messages, limits.sketch_max_tokens,
                                          spend, calls, logprobs=False, sampling=_sampling(req, 0))
            except ApiError:  # the key cannot cover it now (others spent meanwhile): normal routing decides
                if not tried:
                    return self.fall_back("budget")
                break
            tried.append(sketch_inst.name)
        if not tried:
            return self.fall_back("no_tiers")
        points = parse_points(_content(sketch) or "", limits.max_points) if sketch is not None else []
        if sketch is None or len(points) < limits.min_points:  # normal routing; the sketch stays paid
            return self.fall_back("sketch_failed" if sketch is None else "few_points", calls.total.cost)
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
                inst = self._pick(cfg, model, calls, loop.time())
                if inst is None:
                    return None
                try:
                    data = await self._call(session, cfg, inst, prompts[index], limits.expansion_max_tokens, spend,
                                            calls, logprobs=True, sampling=_sampling(req, k))
                except ApiError:  # the key cannot cover this candidate: dropped
                    return None
                if data is None:
                    return None
                text = _content(data)
                if not text or not text.strip():
                    return None
                return Candidate(text, _logprobs(data), Usage(0, _completion_tokens(data)), inst.name)

            found = [c for c in await asyncio.gather(*(one(k) for k in range(n_cand))) if c is not None]
            if not found:
                self.metrics.progressive_points.labels("sketch_text").inc()
                return None
            self.metrics.progressive_points.labels("expanded").inc()
            return found[choose(found)].text

        tasks = [loop.create_task(expand(i)) for i in range(len(points))]
        headers = {"X-Route-Mode": PROGRESSIVE, "X-Route-Points": str(len(points)), "X-Route-Model": large,
                   "X-Route-Instance": tried[-1], "X-Route-Candidates": str(n_cand)}
        rid, created = f"chatcmpl-prog-{uuid.uuid4().hex}", int(time.time())
        try:
            if req.stream:
                return await self._stream(request, cfg, req, points, tasks, calls, headers, rid, created, large)
            expansions = list(await asyncio.gather(*tasks))
            total = calls.total
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
                      tasks: list[asyncio.Task], calls: Calls, headers: dict[str, str], rid: str, created: int,
                      model: str) -> web.StreamResponse:
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
            total = calls.total
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
