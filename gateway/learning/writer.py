"""Answer lengths from the request path to the label store, without the request ever waiting on a disk.

A request offers its length label to a bounded queue and goes on (`offer` never blocks); one background
task takes what has queued within GATHER_S of the first label, up to a batch, and writes it in a worker
thread, one transaction per batch.
When the queue is full (the disk cannot keep up) a label is dropped and counted, never held: a length
is one observation among many, and memory must not grow with a slow disk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from gateway.learning.labels import Label
from gateway.learning.store import LabelStore, LabelStoreError

log = logging.getLogger("routebalance.learning")
BATCH = 256  # labels per transaction: one commit for many labels while traffic is high
# A label that finds fewer than a batch queued waits this long for the next ones to share its transaction:
# taken one at a time, every answer cost a commit and a hand-off to a thread.
GATHER_S = 0.2


class LabelWriter:
    """`count(outcome, n)` hears what became of every label offered: "stored", "exists" (a label for the
    prompt, model and censoring was already stored), "full" (the store is at max_labels), "queue_full",
    "write_failed"."""

    def __init__(self, store: LabelStore, capacity: int, count: Callable[[str, int], None]):
        self.store = store
        self.count = count
        self._queue: asyncio.Queue[Label] = asyncio.Queue(maxsize=capacity)
        self._closed = False
        self._offered = 0  # labels queued so far
        self._settled = 0  # of those, labels whose write has finished (written, or failed and counted)
        self._settled_changed = asyncio.Condition()

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def offer(self, label: Label) -> bool:
        """Queue a label for the writer; False (and counted) when it is dropped."""
        if self._closed:
            return False
        try:
            self._queue.put_nowait(label)
        except asyncio.QueueFull:
            self.count("queue_full", 1)
            return False
        self._offered += 1
        return True

    async def flush(self, timeout_s: float) -> bool:
        """Wait until the labels queued before this call are written (at most `timeout_s`): what a refresh
        reads then includes the answers served before it. False when the time ran out."""
        target = self._offered
        try:
            async with asyncio.timeout(timeout_s), self._settled_changed:
                await self._settled_changed.wait_for(lambda: self._settled >= target)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        """Write queued labels until cancelled."""
        while True:
            batch = [await self._queue.get()]
            if self._queue.qsize() + 1 < BATCH and not self._closed:
                await asyncio.sleep(GATHER_S)
            while len(batch) < BATCH and not self._queue.empty():
                batch.append(self._queue.get_nowait())
            try:
                await self._write(batch)
            finally:
                self._settled += len(batch)
                for _ in batch:
                    self._queue.task_done()
                async with self._settled_changed:
                    self._settled_changed.notify_all()

    async def _write(self, batch: list[Label]) -> None:
        try:
            outcomes = await asyncio.to_thread(self.store.add_many, batch)
        except (LabelStoreError, ValueError) as e:
            log.warning("could not store %d answer lengths: %s", len(batch), e)
            self.count("write_failed", len(batch))
            return
        for outcome, n in outcomes.items():
            self.count(outcome, n)

    async def close(self, timeout_s: float) -> None:
        """Take no more labels, and wait at most `timeout_s` for those queued to be written (the caller
        stops `run` afterwards); what is left then is counted as dropped."""
        self._closed = True
        try:
            async with asyncio.timeout(timeout_s):
                await self._queue.join()
        except TimeoutError:
            left = self._queue.qsize()
            log.warning("shutdown: %d answer lengths not written within %g s", left, timeout_s)
            self.count("write_failed", left)
