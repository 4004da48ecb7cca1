"""Swap-aware first come, first served: QLM's fair multi-model baseline (papers/qlm-queue-management.txt).

The naive FCFS baseline (`passthrough+round_robin`) sends every request at
once and leaves the order to the GPU, which serves its models first come,
first served (gateway/core/engine/shared_gpu.py): requests of several models
interleaved in time make a shared GPU swap about once per request. An
operator who runs such GPUs would let the loaded model finish what it has
before swapping; this is that, and nothing more (no SLOs, no estimates, no
warm start, no choice of GPU):

- Placement as the naive baseline's: round robin over the instances of the
  model the request names (one per GPU).
- Each shared GPU serves one model at a time: the first at the start (as a
  shared GPU starts), then the one it was last sent. A request of that model
  goes at once while no other model's request waits for the GPU; while one
  waits, only until `max_stretch` requests have gone since the GPU turned to
  that model (0: the instance's `max_num_seqs`, one full batch).
- The GPU turns to another model when the one it serves has nothing in
  flight and nothing more it may send: to the model of the oldest waiting
  request, whose requests then go, oldest first.

So the oldest waiting request waits at most one stretch (`max_stretch`
requests, their drain and one swap): no model starves. A GPU of one model
(no `gpu_id`, as every stock vLLM server) sends everything at once, as the
naive baseline does.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from gateway.config_schema import Section, option, section
from gateway.core.engine.shared_gpu import gpu_groups
from gateway.core.policy import PolicyContext, PolicyEntry
from gateway.core.request import Completion, Ticket
from gateway.core.settings import InstanceSettings
from gateway.core.view import PoolView
from gateway.policies.pipeline.dispatchers import Dispatcher
from gateway.policies.pipeline.policy import PipelinePolicy, make_dispatcher
from gateway.policies.pipeline.routers import Passthrough

NAME = "swap_aware_fcfs"


@section
class SwapAwareOptions(Section):
    """[policies.swap_aware_fcfs]: how long a shared GPU keeps its model while other models' requests wait."""

    # Requests of the loaded model sent since the GPU turned to it, after which it takes no more while another
    # model's request waits (0: the instance's max_num_seqs). The tie-break seed is [policies.pipeline]'s.
    max_stretch: int = option(0, ge=0)


class SwapAwareFcfs(PipelinePolicy):
    def __init__(self, instances: Sequence[InstanceSettings], options: SwapAwareOptions, dispatcher: Dispatcher):
        super().__init__(Passthrough(), dispatcher)
        self.name = NAME
        shared = [g for g in gpu_groups(instances) if len(g) > 1]
        self.gpu_of = {i: g for g, members in enumerate(shared) for i in members}  # instance -> its shared GPU
        self.serving = [members[0] for members in shared]  # GPU -> the instance whose model it serves
        self.sent = [0] * len(shared)  # GPU -> requests of that model sent since it turned to it
        self.bound = [options.max_stretch or inst.max_num_seqs for inst in instances]
        self.waiting: dict[int, deque[Ticket]] = {i: deque() for i in self.gpu_of}  # instance -> held, oldest first
        self._held: dict[Ticket, int] = {}

    def hold(self, ticket: Ticket, view: PoolView) -> bool:
        i = _instance(ticket)
        g = self.gpu_of.get(i)
        if g is None:
            return False
        serving = self.serving[g]
        if i == serving:
            go = self.sent[g] < self.bound[i] or self._oldest_other(g) is None
        else:  # a swap: only once the served model has drained, and for the oldest waiting request
            go = (view.in_flight[serving] == 0 and (not self.waiting[serving] or self.sent[g] >= self.bound[serving])
                  and self._oldest_other(g) in (ticket, None))
        if not go:
            if ticket not in self._held:
                self._held[ticket] = i
                self.waiting[i].append(ticket)
            return True
        if i != serving:
            self.serving[g], self.sent[g] = i, 0
        self.sent[g] += 1
        self._forget(ticket)
        return False

    def _oldest_other(self, g: int) -> Ticket | None:
        """The oldest request waiting for GPU g of another model than the one it serves."""
        heads = [q[0] for i, q in self.waiting.items() if q and self.gpu_of[i] == g and i != self.serving[g]]
        return min(heads, key=lambda t: t.arrived, default=None)

    def _forget(self, ticket: Ticket) -> None:
        i = self._held.pop(ticket, None)
        if i is not None:
            self.waiting[i].remove(ticket)

    def on_complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        self._forget(ticket)  # a request whose client left while it was held


def _instance(ticket: Ticket) -> int:
    """The instance the request was placed on (-1: none)."""
    d = ticket.decision
    return d.ranked[0] if d is not None and d.ranked else -1


def build(context: PolicyContext) -> SwapAwareFcfs:
    return SwapAwareFcfs(context.config.instances, context.options(NAME), make_dispatcher("round_robin", context))


OPTIONS = {NAME: SwapAwareOptions}
ENTRIES = (PolicyEntry(NAME, build, "baseline: first come, first served, round robin, but a GPU shared by several "
                       "models keeps its model while it has requests (up to a bound) before swapping", False),)
