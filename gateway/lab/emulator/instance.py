"""One emulated vLLM instance: the engine model plus what the HTTP layer needs.

The pool's ticker advances every engine to the current loop time and calls
`deliver`, which wakes the streams that got tokens and records vLLM metrics.
"""

from __future__ import annotations

import asyncio
import itertools
import random

from gateway.core.engine.engine import Engine, EngineSpec, Sequence, StepReport
from gateway.lab.emulator.settings import FaultsConfig
from gateway.lab.emulator.vllm_metrics import VllmMetrics


class EmulatedInstance:
    def __init__(self, cfg, faults: FaultsConfig, spec: EngineSpec, *, now: float, seed: int):
        """`cfg`: the instance's config entry; `spec`: its engine model (settings.engine_for)."""
        self.cfg = cfg
        self.name: str = cfg.name
        self.model: str = cfg.model
        self.engine = Engine(spec, now=now)
        self.metrics = VllmMetrics(
            cfg.model,
            max_num_seqs=spec.max_num_seqs,
            max_model_len=spec.max_model_len,
            block_size=spec.block_size,
            num_gpu_blocks=spec.num_gpu_blocks,
            gpu_memory_utilization=cfg.gpu_memory_utilization,
        )
        self.faults = faults  # replaced whole (it is frozen) when a knob changes
        self.rng = random.Random(f"{seed}:{cfg.name}")
        self._ids = itertools.count()
        self._wakeups: dict[object, asyncio.Event] = {}

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{self.name}-{next(self._ids)}"

    def should_fail(self) -> bool:
        return self.faults.error_rate > 0 and self.rng.random() < self.faults.error_rate

    def submit(self, rid: str, *, prompt_tokens: int, max_tokens: int, output_tokens: int,
               now: float, domain: str | None = None) -> tuple[Sequence, asyncio.Event]:
        """Queue a request on the engine; `domain` (the prompt's kind) picks its experts on an MoE instance."""
        seq = self.engine.add(rid, prompt_tokens=prompt_tokens, max_tokens=max_tokens, output_tokens=output_tokens,
                              now=now, domain=domain)
        wake = asyncio.Event()
        self._wakeups[rid] = wake
        return seq, wake

    def release(self, seq: Sequence, now: float) -> None:
        """The HTTP side is done with a request: abort it if it is still running."""
        self._wakeups.pop(seq.rid, None)
        if not seq.finished:
            aborted = self.engine.abort(seq.rid, now)
            if aborted is not None:
                self._observe_finished(aborted)

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

    def render_metrics(self) -> bytes:
        self.metrics.set_state(self.engine.num_running, self.engine.num_waiting, self.engine.kv_usage())
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
        )
