"""What the gateway learns from its own traffic while it serves: each answer's length, and each answer's id
so that its client may rate it later (gateway/serving/feedback.py).

The request path only hashes the prompt, offers one label to the writer's bounded queue and logs the id in
memory; the store is written by the writer's task, in a thread (gateway/learning/writer.py).

Left out, and why:
- progressive answers: one answer made of a sketch and expansions by several models is no one model's
  answer to the prompt, so it gives neither a length nor a rating to any model;
- requests asking for several answers (n > 1): the usage sums them, so no one answer's length is known,
  and a rating could not say which answer it rates;
- the length of answers the request shapes (tools it may call, a JSON response_format: parse.py's
  `shaped`): a tool call's or a schema's length says nothing of how long the model answers the prompt
  (their ids are still logged: a rating of such an answer still rates its model);
- failed answers (the instance broke off, the size cap): not how long the model's answer is;
- a client that left before the end, when what it was delivered is unknown: its length is censored at what
  was delivered when the gateway counted that (it noticed at a write, or the stream was metered for a
  budget); when the lost connection cancels the request first, a pass-through stream has not counted
  anything yet, and "at least 0 tokens" is not worth storing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time

from gateway.config.sections import ApiKey, Config
from gateway.config.store import ConfigStore
from gateway.learning.completions import CompletionLog, LoggedCompletion, Principal
from gateway.learning.host_completions import HostCompletions, beside
from gateway.learning.labels import Label, prompt_hash
from gateway.learning.shared_completions import SharedCompletions
from gateway.learning.store import LabelStore, LabelStoreError
from gateway.learning.writer import LabelWriter
from gateway.serving.dispatch import Attempt, DecidedCall
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.relay import CLIENT_CLOSED
from gateway.serving.workers import SINGLE, Worker
from gateway.state.link import RedisLink

log = logging.getLogger("routebalance.learning")
PRUNE_EVERY_S = 3600.0  # how often labels past their retention are deleted
FLUSH_TIMEOUT_S = 5.0  # how long a refresh waits for the lengths still queued


class TrafficLearner:
    """The label store, its writer and the completion log of one gateway, opened at start when
    [learning] is enabled (`store` is None otherwise, and `unavailable` says why)."""

    def __init__(self, config: ConfigStore, metrics: GatewayMetrics, worker: Worker = SINGLE):
        self.config = config
        self.metrics = metrics
        self.worker = worker
        self.store: LabelStore | None = None
        self.writer: LabelWriter | None = None
        self.completions: CompletionLog | None = None
        # With a Redis state backend, or one host's workers: the completions of every process on it, so a
        # feedback reaching any of them is taken (set by `share`).
        self.shared: SharedCompletions | HostCompletions | None = None
        self.unavailable = "learning is off: [learning] enabled = false"
        self._tasks: list[asyncio.Task] = []

    async def open(self) -> None:
        learning = self.config.current.learning
        if not learning.enabled:
            log.info("learning from traffic is off ([learning] enabled = false)")
            return
        try:
            self.store = await asyncio.to_thread(LabelStore, learning.path, learning.max_labels)
        except LabelStoreError as e:  # serve anyway: learning is not worth refusing requests for
            self.unavailable = f"the label store could not be opened ({e}); learning is off until a restart"
            log.error("%s", self.unavailable)
            return
        self.completions = CompletionLog(*self._log_bounds(learning))
        self.writer = LabelWriter(self.store, learning.length_queue, self._count_length)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.writer.run()), loop.create_task(self._prune_forever())]
        log.info("learning from traffic: labels in %s (%d stored)", learning.path, self.store.rows)

    def reconfigure(self, cfg: Config) -> None:
        """A reload's bounds (the store's path and the writer's queue stay as they were at start)."""
        learning = cfg.learning
        if self.store is not None and self.completions is not None:
            self.store.max_labels = learning.max_labels
            self.completions.set_bounds(*self._log_bounds(learning))
        if self.shared is not None:
            self.shared.set_bounds(learning.completion_ttl_s, learning.max_completions,
                                   learning.max_completion_text_chars)

    def _log_bounds(self, learning) -> tuple[int, float, int]:
        """This process's log's bounds: its part of the host's, when workers share the host."""
        return (max(1, self.worker.part_of_count(learning.max_completions)), learning.completion_ttl_s,
                self.worker.part_of_count(learning.max_completion_text_chars))

    def share(self, link: RedisLink | None) -> None:
        """Publish the completions logged from now on, and look up there the ids not held here: in Redis when
        the state is there, else (one host's workers) in a SQLite file beside the state file."""
        cfg = self.config.current
        if self.store is None:
            return
        bounds = (cfg.learning.completion_ttl_s, cfg.learning.max_completions, cfg.learning.max_completion_text_chars)
        try:
            shared = (SharedCompletions(link, *bounds) if link is not None
                      else HostCompletions(beside(cfg.state.path), *bounds))
        except (OSError, sqlite3.Error) as e:  # serve anyway: feedback is then taken where its answer was served
            log.error("completions cannot be shared through %s: %s", beside(cfg.state.path), e)
            return
        self.shared = shared
        self._tasks.append(asyncio.get_running_loop().create_task(shared.run()))

    async def completion(self, completion_id: str) -> LoggedCompletion | None:
        """The completion a feedback names. With a shared log, its entry there (a feedback another process took
        rated it there, not here); else, or while Redis is away, this process's own."""
        assert self.completions is not None
        local = self.completions.get(completion_id, asyncio.get_running_loop().time())
        shared = await self.shared.lookup(completion_id) if self.shared is not None else None
        if shared is None or (local is not None and local.rating is not None and shared.rating is None):
            return local  # (a rating taken here and not yet shared counts)
        return shared

    async def flush(self, timeout_s: float = FLUSH_TIMEOUT_S) -> None:
        """Until the answer lengths offered so far are in the store (bounded: a refresh waits no longer)."""
        if self.writer is not None and not await self.writer.flush(timeout_s):
            log.warning("answer lengths still queued after %g s: a refresh goes on without them", timeout_s)

    async def close(self, timeout_s: float) -> None:
        """Write what is queued (within `timeout_s`), then stop and close the store."""
        if self.writer is not None:
            await self.writer.close(timeout_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.store is not None:
            await asyncio.to_thread(self.store.close)  # waits for a write still running in its thread

    def _count_length(self, result: str, n: int) -> None:
        self.metrics.length_labels.labels(result).inc(n)

    async def _prune_forever(self) -> None:
        store = self.store
        assert store is not None
        while True:
            days = self.config.current.learning.retention_days  # a reload's, from the next round
            try:
                gone = await asyncio.to_thread(store.prune, time.time(), days)
                if gone:
                    log.info("deleted %d labels older than %g days", gone, days)
            except LabelStoreError as e:
                log.warning("could not delete old labels: %s", e)
            await asyncio.sleep(PRUNE_EVERY_S)

    def observe(self, cfg: Config, key: ApiKey | None, address: str | None, call: DecidedCall,
                attempt: Attempt) -> None:
        """What one dispatched request teaches: its answer's length for the model that served it (censored
        when cut by max_tokens, the budget or the client leaving), and its id for a later feedback."""
        if self.writer is None or self.completions is None or (key is not None and not key.learn):
            return
        result = attempt.result
        left = attempt.status == CLIENT_CLOSED
        if attempt.index is None or call.req.n != 1 or (attempt.status != 200 and not left):
            return
        censored = left or result.cut_by_length or result.budget_exhausted
        if censored and not result.completion_tokens:
            return  # "at least 0 tokens" says nothing (see the module's docstring)
        model = call.cfg.instances[attempt.index].model
        text = call.req.prompt_text
        digest = prompt_hash(text)
        kept = text if cfg.learning.keep_prompt_text else None
        key_name = key.name if key is not None else None
        if not call.req.shaped:
            self.writer.offer(Label(digest, model, "length", result.completion_tokens, time.time(), kept, censored,
                                    key_name))
        if not left and result.completion_id is not None:
            now = asyncio.get_running_loop().time()
            entry = LoggedCompletion(result.completion_id, Principal.of(key_name, address), model, digest, kept, now)
            if self.completions.put(entry) and self.shared is not None:
                self.shared.publish(entry)
