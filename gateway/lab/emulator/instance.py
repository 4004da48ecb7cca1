"""One emulated vLLM instance: the engine model plus what the HTTP layer needs.

The pool's ticker advances every engine to the current loop time and calls
`deliver`, which wakes the streams that got tokens, records vLLM metrics and,
where the instance has `kv_events`, publishes what entered and left its prefix
cache as vLLM's KV-cache events (kv_events.py).
"""

from __future__ import annotations

import asyncio
import itertools
import random

from gateway.core.engine.engine import Engine, EngineSpec, Sequence, StepReport
from gateway.lab.emulator.kv_events import KvEventPublisher
from gateway.lab.emulator.settings import FaultsConfig
from gateway.lab.emulator.vllm_metrics import VllmMetrics


class EmulatedInstance:
    def __init__(self, cfg, faults: FaultsConfig, spec: EngineSpec, *, now: float, seed: int, key: str,
                 kv_events_encoding: str):
        """`cfg`: the instance's config entry (at `key`, e.g. "instances[3]"); `spec`: its engine model
        (settings.engine_for); `kv_events_encoding`: [emulator] kv_events_encoding."""
        self.cfg = cfg
        self.name: str = cfg.name
        self.model: str = cfg.model
        self.engine = Engine(spec, now=now, record_events=cfg.kv_events is not None)
        self.events = (KvEventPublisher(cfg.kv_events, spec.block_size, f"{key}.kv_events",
                                        kv_events_encoding)
                       if cfg.kv_events is not None else None)
        self.metrics = VllmMetrics(
            cfg.model,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len,
            block_size=spec.block_size,
            num_gpu_blocks=spec.num_gpu_blocks,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
            enable_prefix_caching=spec.prefix_caching,
        )
        self._cache_counted = (0, 0)  # the cache's queries and hits the metrics page has counted
        self.faults = faults  # replaced whole (it is frozen) when a knob changes
        self.rng = random.Random(f"{seed}:{cfg.name}")
        self._ids = itertools.count()
        self._wakeups: dict[object, asyncio.Event] = {}
        # Requests for several answers with samples not yet finished: group -> [samples left, samples, longest].
        self._groups: dict[str, list[int]] = {}

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.name}-{next(self._ids)}"

    def should_fail(self) -> bool:
        return self.faults.error_rate > 0 and self.rng.random() < self.faults.error_rate

    def submit(self, rid: str, *, prompt_tokens: int, max_tokens: int, output_tokens: int, now: float,
               domain: str | None = None, ids: list[int] | None = None, prefix: tuple[int, ...] = (),
               group: str | None = None, wake: asyncio.Event | None = None) -> tuple[Sequence, asyncio.Event]:
        """Queue a request on the engine; `domain` (the prompt's kind) picks its experts on an MoE instance;
        `prefix`: the chained hashes of the full blocks of its prompt's token `ids` (its cache lookup); `group`:
        the HTTP request it is one sample of (its samples share the prompt's prefill). `wake` (a new one if None)
        is set when it progresses: the samples of one HTTP request share theirs."""
        seq = self.engine.add(rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens, output_tokens=output_tokens,
                              now=now, domain=domain, prefix=prefix, group=group)
        if group is not None:
            counts = self._groups.setdefault(group, [0, 0, 0])
            counts[0] += 1
            counts[1] += 1
        if self.events is not None and seq.prefix:
            assert ids is not None  # a prefix is hashed from ids
            self.events.blocks.add(ids, seq.prefix)
        wake = wake if wake is not None else asyncio.Event()
        self._wakeups[rid] = wake
        return seq, wake

    def release(self, seq: Sequence, now: float) -> None:
        """The HTTP side is done with a request: abort it if it is still running."""
        self._wakeups.pop(seq.rid, None)
        if not seq.finished:
            aborted = self.engine.abort(seq.rid, now)
            if aborted is not None:
                self._observe_finished(aborted)
        if self.events is not None and seq.prefix:
            self.events.blocks.drop(seq.prefix)

    def went_down(self) -> None:
        """The instance went down (its port is closed): its prefix cache is lost, and subscribers are told at once
        (AllBlocksCleared; the publisher, which belongs to the emulator's process, stays up and keeps numbering).
        Blocks that requests still hold stay until the HTTP side aborts them as their connections drop."""
        if self.engine.cache is None:
            return
        self.engine.take_cache_events()  # what changed before is moot once the cache is cleared
        self.engine.cache.clear()
        if self.events is not None:
            self.events.publish([["AllBlocksCleared"]])

    def close(self) -> None:
        if self.events is not None:
            self.events.close()

    def deliver(self, report: StepReport) -> None:
        for seq in report.progressed:
            wake = self._wakeups.get(seq.rid)
            if wake is not None:
                wake.set()
        for seq in report.finished:
            self._observe_finished(seq)
        if report.prompt_tokens or report.generation_tokens:
            self.metrics.add_tokens(report.prompt_tokens, report.generation_tokens)
        if report.preemptions:
            self.metrics.add_preemptions(report.preemptions)
        for gap, count in report.inter_token:
            self.metrics.observe_inter_token(gap, count)
        if self.events is not None:
            self.events.publish_changes(*self.engine.take_cache_events(), self.engine.cache)

    def render_metrics(self) -> bytes:
        self.metrics.set_state(self.engine.num_running, self.engine.num_waiting, self.engine.kv_usage())
        cache = self.engine.cache
        if cache is not None:  # the engine keeps running totals; the counters take what came since the last page
            queries, hits = self._cache_counted
            self.metrics.add_prefix_cache(cache.queries - queries, cache.hits - hits)
            self._cache_counted = (cache.queries, cache.hits)
        return self.metrics.render()

    def _observe_finished(self, seq: Sequence) -> None:
        end = seq.finish_time
        scheduled = seq.first_scheduled if seq.first_scheduled is not None else end
        first = seq.first_token_time if seq.first_token_time is not None else end
        self.metrics.observe_finished(
            finished_reason=seq.finish_reason,
            ttft_s=first - seq.arrival,
            e2e_s=end - seq.arrival,
            queue_s=scheduled - seq.arrival,
            prefill_s=first - scheduled,
            decode_s=end - first,
            inference_s=end - scheduled,
            prompt_tokens=seq.prompt_tokens,
            generation_tokens=seq.generated,
            max_tokens=seq.max_tokens,
            n=None if seq.group is not None else 1,
            cached_tokens=seq.cached_tokens or 0,
        )
        if seq.group is not None:  # the request's own histograms, once its last sample is done
            counts = self._groups[seq.group]
            counts[0] -= 1
            counts[2] = max(counts[2], seq.generated)
            if counts[0] == 0:
                del self._groups[seq.group]
                self.metrics.observe_request(counts[1], counts[2])
