"""Judged shadow answers (opt-in): labels for the models that did not answer.

Traffic labels only the model that served a prompt. With `[learning] shadow_share` above 0 and a `[judge]`,
a sampled share of answered requests is also sent, after the answer, to one other pool model that has an
idle instance (no request of this gateway on it), and the judge scores both answers in [0, 1]: two "judge"
labels (the served model's and the other's) and the other's answer length go to the label store, for the
next refresh.

Bounds: at most `shadow_max_in_flight` shadow calls at once (a request is never queued for one: past the
bound it is skipped), `shadow_max_tokens` per shadow answer, and `shadow_usd_per_day` of spend per UTC day,
reserved before a call at its worst case (prompt plus shadow_max_tokens) and settled at what the instance
reports. The spend is the gateway's own: it is booked to no client's key, and counted in
`routebalance_shadow_cost_usd_total` and the log. Only whole, non-streamed, single answers are shadowed (a
stream's text is not kept), and not those the request shapes (tools, a JSON response_format: a tool call or
a schema's JSON is no answer to the prompt to judge, nor a length to learn); keys with `learn = false` never
are. A judge outside the pool sees prompts only
where `[judge] outside_pool_may_see_prompts` says so (checked at start: otherwise shadowing stays off).
`shadow_share` turning on and the `[judge]` are read at start; the share and the bounds apply from a reload
on. The judge's own calls are not counted in the spend (its price is not in the config).
Shadow calls bypass the scheduler: they are not booked in the pool state, which is why they go only to idle
instances and are few.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import aiohttp
import numpy as np
import orjson

from gateway.config.sections import ApiKey, Config
from gateway.config.store import ConfigStore
from gateway.core.budget import predicted_cost, token_prices
from gateway.learning.judge import Judge, JudgeError
from gateway.learning.labels import Label, prompt_hash
from gateway.serving.daily_spend import DailySpend
from gateway.serving.dispatch import Attempt, DecidedCall
from gateway.serving.driver import Scheduler
from gateway.serving.learner import TrafficLearner
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.relay import RelayResult, note_answer, upstream_payload, usage_count
from gateway.serving.workers import SINGLE, Worker

log = logging.getLogger("routebalance.shadow")
MAX_BODY = 4 << 20  # bytes of a shadow answer read at most


class ShadowAnswers:
    def __init__(self, store: ConfigStore, learner: TrafficLearner, scheduler: Scheduler, metrics: GatewayMetrics,
                 session: Callable[[], aiohttp.ClientSession | None], worker: Worker = SINGLE, seed: int = 0):
        self.store = store
        self.worker = worker  # the caps are the host's: this process takes its part of each
        self.learner = learner
        self.scheduler = scheduler
        self.metrics = metrics
        self._session = session
        self.rng = np.random.default_rng(seed)
        self.judge: Judge | None = None
        self._tasks: set[asyncio.Task] = set()
        self.spend = DailySpend()

    async def open(self) -> None:
        cfg = self.store.current
        if cfg.learning.shadow_share <= 0 or self.learner.store is None:
            return
        try:
            judge = Judge(cfg.judge, [i.url for i in cfg.instances])
        except JudgeError as e:
            log.error("judged shadow answers are off: %s", e)
            return
        self.judge = await judge.__aenter__()
        log.info("judged shadow answers: %.0f%% of answered requests, judged by %s", 100 * cfg.learning.shadow_share,
                 cfg.judge.model)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.judge is not None:
            await self.judge.__aexit__(None, None, None)

    def offer(self, cfg: Config, key: ApiKey | None, call: DecidedCall, attempt: Attempt) -> None:
        """After an answered request: maybe start one shadow call (never waits, never raises)."""
        learning = cfg.learning
        req, result = call.req, attempt.result
        in_flight_cap = self.worker.part_of_count(learning.shadow_max_in_flight)
        if (self.judge is None or attempt.status != 200 or attempt.index is None or req.stream or req.n != 1
                or req.shaped or result.answer_text is None or (key is not None and not key.learn)
                or len(self._tasks) >= in_flight_cap or self.rng.random() >= learning.shadow_share):
            return
        served = cfg.instances[attempt.index]
        others = [i for i in self.scheduler.routable_instances(cfg)
                  if i.model != served.model and self.scheduler.in_flight(i.name) == 0]
        if not others:
            self.metrics.shadow.labels("no_idle_instance").inc()
            return
        other = others[int(self.rng.integers(len(others)))]
        price_in, price_out = token_prices(other)
        worst = float(predicted_cost(result.prompt_tokens, learning.shadow_max_tokens, price_in, price_out))
        if self.spend.today_usd + worst > self.worker.part(learning.shadow_usd_per_day):
            self.metrics.shadow.labels("spend_cap").inc()
            return
        self.spend.add(worst)  # reserved; settled when the answer's usage is known
        task = asyncio.get_running_loop().create_task(
            self._shadow(cfg, key, call, served.model, result.answer_text, other, worst))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _shadow(self, cfg: Config, key: ApiKey | None, call: DecidedCall, served_model: str, answer: str,
                      other, reserved: float) -> None:
        outcome, paid = "failed", reserved
        try:
            text, prompt_tokens, tokens, cut = await self._ask(cfg, call, other)
            if tokens:  # without usage the reservation stands as the cost, and no length is learned
                paid = float(predicted_cost(prompt_tokens, tokens, *token_prices(other)))
            judge = self.judge
            assert judge is not None
            prompt = call.req.prompt_text
            scores = await asyncio.gather(judge.score(prompt, answer), judge.score(prompt, text))
            digest, now, kept = prompt_hash(prompt), time.time(), prompt if cfg.learning.keep_prompt_text else None
            name = key.name if key is not None else None
            writer = self.learner.writer
            if writer is not None:
                writer.offer(Label(digest, served_model, "judge", scores[0], now, kept, key=name))
                writer.offer(Label(digest, other.model, "judge", scores[1], now, kept, key=name))
                if tokens:
                    writer.offer(Label(digest, other.model, "length", tokens, now, kept, cut, name))
            outcome = "judged"
        except JudgeError as e:
            outcome = "judge_failed"
            log.warning("shadow answer of %s not judged: %s", other.name, e)
        except (aiohttp.ClientError, TimeoutError, ValueError) as e:  # unreachable, or not an OpenAI answer
            log.warning("shadow call to %s failed: %s", other.name, e)
        finally:
            self.spend.add(paid - reserved)
            self.metrics.shadow.labels(outcome).inc()
            self.metrics.shadow_cost.inc(paid)

    async def _ask(self, cfg: Config, call: DecidedCall, other) -> tuple[str, int, int, bool]:
        """The other instance's whole answer: (text, prompt tokens, answer tokens, cut at max_tokens)."""
        session = self._session()
        if session is None:
            raise aiohttp.ClientError("the gateway is closing")
        route = "/v1/chat/completions" if call.req.chat else "/v1/completions"
        # no longer than the client allowed the served answer, so the two are judged on the same terms
        limit = min(cfg.learning.shadow_max_tokens, call.req.max_tokens or cfg.learning.shadow_max_tokens)
        payload = upstream_payload(call.req, other, limit)
        async with asyncio.timeout(cfg.upstream.total_timeout_s):
            async with session.post(other.url.rstrip("/") + route, data=payload,
                                    headers={"Content-Type": "application/json"}) as resp:
                body = await resp.content.read(MAX_BODY + 1)
                if resp.status != 200 or len(body) > MAX_BODY:
                    raise ValueError(f"HTTP {resp.status}, {len(body)} bytes")
        data = orjson.loads(body)
        if not isinstance(data, dict):
            raise ValueError(f"a JSON {type(data).__name__}, not an answer")
        answer = RelayResult()
        note_answer(data, answer)  # as the relay reads a whole answer: its text, and whether it was cut
        if answer.answer_text is None:
            raise ValueError("no single answer text")
        usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
        return (answer.answer_text, usage_count(usage, "prompt_tokens"), usage_count(usage, "completion_tokens"),
                answer.cut_by_length)
