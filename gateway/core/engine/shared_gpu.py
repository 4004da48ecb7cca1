"""Several models time-sharing one GPU: model swapping and warm start, for the simulator.

A vLLM server serves one model. QLM (papers/qlm-queue-management.txt
section 5) multiplexes several models on one device by swapping weights,
which stock vLLM does not let a gateway do; so this lives in the engine
model only, and the simulator runs the config instances that name the same
`gpu_id` as members of one SharedGpu (each member an Engine: one model's
queue and KV cache on that GPU).

- One member's model is on the GPU at a time, and only its engine runs.
- The GPU serves its members first come first served: while a request of
  another member waits that arrived before the loaded one's waiting
  requests, the loaded member admits nothing newer, finishes its running
  batch, and the GPU loads the model of the oldest waiting request (the
  KV cache goes with the old weights). Requests of several models
  interleaved in time therefore swap often; a gateway that releases one
  model's requests at a time (QLM's pulling) swaps rarely.
- A load takes the warm time (host memory to GPU) when the model is in host
  memory, else the cold time (storage into host memory first).
- Warm start: `warm(members, now)` names the models the controller wants in
  host memory (at most `host_slots`, most wanted first); those not there are
  read from storage in the background, one after another (a wanted model
  that is on the GPU is copied out instead), each taking the place of one
  no longer wanted; a read for a model no longer wanted is dropped. A GPU
  whose controller never calls it loads every model cold, as a server
  loading from its model registry.

Functional core: no I/O, no clock; the caller passes time in.
"""

from __future__ import annotations

from gateway.core.engine.engine import Engine, StepReport


def gpu_groups(instances) -> list[tuple[int, ...]]:
    """The config instances of each GPU, in config order: one of its own, or all those naming its gpu_id."""
    groups: dict[object, list[int]] = {}
    for k, inst in enumerate(instances):
        groups.setdefault(("own", k) if inst.gpu_id is None else inst.gpu_id, []).append(k)
    return [tuple(g) for g in groups.values()]


class SharedGpu:
    def __init__(self, engines: dict[int, Engine], load_s: dict[int, tuple[float, float]], host_slots: int = 2):
        """`engines`: member (config instance index) -> its engine, the first one's model loaded at the
        start; `load_s`: member -> (warm, cold) seconds to load its model."""
        if not engines or set(load_s) != set(engines):
            raise ValueError("every member needs an engine and its load times")
        self.engines = engines
        self.load_s = load_s
        self.host_slots = host_slots
        self.loaded = next(iter(engines))
        self.ready_at: float | None = None  # while a load is under way: when the model is on the GPU
        self.warm_at: dict[int, float] = {}  # member -> when its weights are (or will be) in host memory
        self.swaps = 0
        self.swap_s = 0.0  # seconds the GPU spent loading weights

    @property
    def shared(self) -> bool:
        """Several models take turns on it (one member: it runs exactly as its engine alone)."""
        return len(self.engines) > 1

    def advance(self, until: float) -> dict[int, StepReport]:
        """Run the GPU up to `until`: the loaded model's steps, and the swaps its queues call for."""
        reports: dict[int, StepReport] = {}
        while True:
            if self.ready_at is not None:
                if self.ready_at > until:
                    break
                self.engines[self.loaded].resume(self.ready_at)
                self.ready_at = None
            engine = self.engines[self.loaded]
            engine.gate(self._oldest_elsewhere()[1])
            _merge(reports.setdefault(self.loaded, StepReport()), engine.advance(until))
            if not engine.drained:
                break
            member, arrived = self._oldest_elsewhere()
            if member is None:
                break
            self._load(member, max(engine.last_step_end, arrived))
        return reports

    def warm(self, members, now: float) -> None:
        """Bring these members' models (most wanted first) into host memory, as far as it holds them.
        The storage reader finishes the read under way if that model is still wanted (else drops it),
        then reads the wanted ones in order; models already there stay until their room is needed."""
        wanted = [m for m in dict.fromkeys(members) if m in self.engines][:self.host_slots]
        resident = {m: t for m, t in self.warm_at.items() if t <= now}
        reading = min(((t, m) for m, t in self.warm_at.items() if t > now), default=None)
        kept: dict[int, float] = {}
        reader = now
        if reading is not None and reading[1] in wanted:
            kept[reading[1]] = reader = reading[0]
        for m in wanted:
            if m in kept:
                continue
            warm, cold = self.load_s[m]
            if m in resident:
                kept[m] = resident[m]
            elif m == self.loaded and self.ready_at is None:
                kept[m] = now + warm  # copied out of the GPU in the background
            else:
                reader += cold - warm
                kept[m] = reader
        for m, t in resident.items():  # the room left keeps what is there
            if len(kept) >= self.host_slots:
                break
            kept.setdefault(m, t)
        self.warm_at = kept

    def _oldest_elsewhere(self) -> tuple[int | None, float]:
        """The member other than the loaded one whose oldest waiting request arrived first, and when."""
        best, at = None, float("inf")
        for m, e in self.engines.items():
            if m != self.loaded and e.waiting and e.waiting[0].arrival < at:
                best, at = m, e.waiting[0].arrival
        return best, at

    def _load(self, member: int, start: float) -> None:
        warm, cold = self.load_s[member]
        in_host = self.warm_at.get(member)
        seconds = cold if in_host is None else max(in_host - start, 0.0) + warm
        self.engines[self.loaded].gate(float("inf"))  # off the GPU: its queue is judged again when it returns
        self.loaded, self.ready_at = member, start + seconds
        self.swaps += 1
        self.swap_s += seconds


def _merge(into: StepReport, report: StepReport) -> None:
    into.progressed += [s for s in report.progressed if s not in into.progressed]
    into.finished += report.finished
    into.inter_token += report.inter_token
    into.prompt_tokens += report.prompt_tokens
    into.generation_tokens += report.generation_tokens
    into.preemptions += report.preemptions
    into.steps += report.steps
    into.experts += report.experts
