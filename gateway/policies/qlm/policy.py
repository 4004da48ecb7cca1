"""QLM (papers/qlm-queue-management.txt): SLO-aware queue management at the gateway; and its EDF baseline.

What QLM does here, operation by operation (sections 4-7):
- Request groups: requests that share their candidate instances (the model
  they asked for), SLO class and predicted answer length (a power-of-two
  bucket) form a group, FCFS inside; a group holds at most `max_group`
  requests (the paper's delta x batch size). Plans are made per group.
- Virtual queues: one per instance, an ordered list of groups. The RCT
  estimator (policies/qlm/rct.py) gives each group's completion time as a
  distribution; the plan generator (policies/qlm/plan.py) places and orders
  the groups to meet as many SLOs as it can, preferring the best-answering
  model that still meets a group's SLO.
- Request pulling (`hold`): a request stays in the gateway until it heads its
  instance's virtual queue and the instance runs fewer than its cap (the
  batch at which a decode step is `slowdown` x a lone one) with nothing
  waiting in vLLM's own queue: the order QLM chose is the order served.
- Eviction (`evict`): when the head of a queue would miss its SLO waiting for
  a slot but would meet it starting now, a running request of the same
  instance with slack to spare, whose client has seen nothing yet (not
  streamed, or before its first token), is aborted and queued again.
- Model swapping: instances that share a GPU (`gpu_id`, several models time-
  sharing one device) share one virtual queue; a group of another model than
  the one the queue ends with waits for the drain and the swap (rct.py), so
  the plan gathers each model's groups on the GPUs that hold it, and pulling
  releases one model's requests at a time (a request goes only when no other
  model of its GPU has requests in flight), so the GPU swaps once per stretch.
- Warm start (`warm`): the models next in each shared GPU's queue are named
  for host memory, so their swap is a copy over PCIe, not a read from storage.
  Only the simulator's engine model heeds it: stock vLLM gives a gateway no
  control of its weights.
- GPU-CPU state swap (`keeps_state`): an evicted request's KV cache goes to
  host memory when copying it over the host link is faster than computing
  it again (the paper's Insight #2; on this pool it always is), so it
  resumes where it stopped. Simulated engines only; live, eviction
  recomputes.

`edf` is the paper's EDF baseline on the same machinery: requests pulled in
deadline order, each on the instance where it finishes soonest; no groups,
no deferral of hopeless requests, no eviction, swaps taken as free and no
warm start.

Requests without an SLO are planned as if their deadline were `no_slo_s`
away. A request whose SLO no candidate can meet even on an idle instance is
refused (503, `slo_infeasible`) or served best-effort, per `on_infeasible`.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

import numpy as np

from gateway.config_schema import Section, build_section, option, section
from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.profiles import arch_for, load_seconds, spec_for_instance
from gateway.core.engine.shared_gpu import gpu_groups
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Completion, Decision, DispatchPlan, Estimates, Refusal, RouteRequest, Ticket
from gateway.core.settings import InstanceSettings
from gateway.core.view import PoolView
from gateway.policies.qlm.heads_curve import heads_curve
from gateway.policies.qlm.plan import GroupView, Queues, choose, greedy_plan, soonest
from gateway.policies.qlm.rct import InstanceModel, Normal, QueueLoad, completion, execution, length, wait

PROFILE_MIN_SEEN = 5  # answers of a kind before the workload profile corrects the estimators

# What one plan costs the simulated scheduler per group and instance considered (measured: see README).
PLAN_S_PER_GROUP_INSTANCE = 2e-5


@section
class QlmOptions(Section):
    """[policies.qlm]: QLM's knobs and the switches of its ablation."""

    # A group meets its SLO when P(completion <= deadline) >= confidence (the paper's Delta).
    confidence: float = option(0.9, gt=0, le=1)
    # Groups that cannot meet their SLO with this probability anywhere go to the back of the queues.
    floor: float = option(0.05, ge=0, le=1)
    # An instance takes requests while its decode step stays within slowdown x a lone step.
    slowdown: float = option(2.0, gt=1)
    max_group: int = option(32, ge=1)  # requests per group: delta (4) x a batch of 8
    length_cv: float = option(0.5, ge=0)  # answer length spread, a share of the predicted mean
    no_slo_s: float = option(3600.0, gt=0)  # the deadline a request without an SLO is planned with
    on_infeasible: Literal["refuse", "serve"] = "refuse"
    # The ablation: switch each operation off.
    pulling: bool = True  # off: dispatch at once to the planned instance (vLLM's own queue orders)
    eviction: bool = True
    grouping: bool = True  # off: every request is its own group
    warm_start: bool = True  # off: every swap on a shared GPU loads its model from storage
    # Off: an evicted request starts over. Simulated engines only: live it always starts over (on the instance
    # it left, where the plan pins it while on).
    state_swap: bool = True
    max_evictions: int = option(1, ge=0)  # per request
    # An instance whose KV cache is this full (at the last scrape) takes no more requests: they would
    # wait in vLLM's own queue, behind whatever fills it (the mega prompts of the paper's W_C).
    kv_limit: float = option(0.9, gt=0, le=1)
    # The plan is made again when requests join it, and at least this often while requests are held.
    replan_s: float = option(0.5, ge=0)
    # Where the completion-time estimate's decode-step curve comes from: the engine model the simulator and
    # emulator run ("engine": exact there), or a line through the TPOT heads' answers ("heads", heads_curve.py).
    step_curve: Literal["engine", "heads"] = "engine"


@section
class EdfOptions(Section):
    """[policies.edf]: the EDF baseline's pulling cap (as QLM's) and the deadline of requests without an SLO."""

    slowdown: float = option(2.0, gt=1)
    length_cv: float = option(0.5, ge=0)
    no_slo_s: float = option(3600.0, gt=0)
    kv_limit: float = option(0.9, gt=0, le=1)


@dataclass(slots=True)
class Planned:
    """What QLM keeps of a request it decided (Decision.detail)."""

    answer_tokens: np.ndarray  # (instances,) predicted answer tokens on each
    quality: np.ndarray  # (instances,) predicted quality on each
    bucket: tuple[int, int]  # log2 buckets of its prompt and its predicted answer length


@dataclass(slots=True)
class Group:
    key: tuple
    members: list[Ticket] = field(default_factory=list)  # held, FCFS


@dataclass(slots=True)
class Running:
    """A request this policy dispatched: where, what it is predicted to produce, how far it got."""

    instance: int
    answer_tokens: float
    deadline: float
    started: float  # when it was dispatched
    cv: float  # its length's spread, a share of answer_tokens (0: it runs to its max_tokens)
    streamed: int = 0

    def left(self, now: float, step_s: float) -> float:
        """Answer tokens it has still to give, in the mean: given the tokens it has made (what it has
        streamed back, or what the time since dispatch makes at `step_s` a token when that is more: an
        answer that is not streamed reports nothing until it ends), the rest of a normal length.
        One that has run past its prediction is still expected to go on a while, not to end now."""
        done = max(float(self.streamed), (now - self.started) / step_s)
        return max(self.answer_tokens + self.cv * self.answer_tokens * _overrun(done, self) - done, 1.0)


def _overrun(done: float, r: Running) -> float:
    """E[Z | Z > z] for a standard normal Z (the inverse Mills ratio), z = how far `done` is past r's
    predicted length, in spreads: what a length of that mean and spread has beyond `done` is its mean
    plus this many spreads, less `done`."""
    spread = r.cv * r.answer_tokens
    if spread <= 0:
        return 0.0
    z = (done - r.answer_tokens) / spread
    tail = 0.5 * math.erfc(z / math.sqrt(2.0))
    if tail < 1e-12:  # far past: the ratio tends to z + 1/z
        return z + 1.0 / z
    return math.exp(-0.5 * z * z) / math.sqrt(2.0 * math.pi) / tail


class Qlm(Policy):
    name = "qlm"
    needs_estimates = True

    def __init__(self, instances: Sequence[InstanceSettings], options: QlmOptions,
                 mode: Literal["plan", "edf"] = "plan", specs: Sequence[EngineSpec] | None = None):
        """`specs`: each instance's engine model as QLM plans with it (default: the engine's own)."""
        self.mode = mode
        self.options = options
        specs = specs if specs is not None else [spec_for_instance(i) for i in instances]
        self.models = [InstanceModel.of(spec, options.slowdown, _swap_s(i, mode))
                       for i, spec in zip(instances, specs, strict=True)]
        self.instances = instances
        self.members = dict(enumerate(gpu_groups(instances)))  # virtual queue (a GPU) -> its instances
        owner = {i: q for q, members in self.members.items() for i in members}
        self.queue_of = tuple(owner[i] for i in range(len(instances)))  # instance -> its virtual queue
        # GPU -> the instance whose model is loaded (the first, as a shared GPU starts; then the last dispatched).
        self.loaded = {q: members[0] for q, members in self.members.items()}
        self._next_models: list[int] = []  # what `warm` names, from the last plan
        self._lock = threading.Lock()  # assign runs in the scheduler's worker thread, the rest on the loop
        self.groups: dict[tuple, Group] = {}
        self.group_of: dict[Ticket, Group] = {}
        self.running: dict[int, dict[Ticket, Running]] = {}  # instance -> what this policy runs there
        self._order: dict[Ticket, int] = {}  # held ticket -> its planned instance
        self._queues: dict[int, deque[Ticket]] = {}  # virtual queue -> its held requests in planned order
        self._loads: dict[int, QueueLoad] = {}  # virtual queue -> its load as the estimator saw it when planned
        self._running_on: dict[Ticket, int] = {}
        # Held requests a victim was already evicted for: the pool view shows the freed slot only at the
        # next scrape, and until then the same head must not take a second victim.
        self._rescued: set[Ticket] = set()
        # Evicted requests whose KV cache waits in an instance's host memory (state swap): they go back there.
        self._resume_on: dict[Ticket, int] = {}
        self._dirty = True  # requests joined since the last plan
        self._planned_at = -math.inf
        # Workload profile, learnt as requests complete: per (model, prompt bucket), the answer tokens
        # seen and the ones predicted, so a kind of prompt the estimators misjudge (a mega prompt's
        # long answer) is planned at the length it really has.
        self._seen: dict[tuple[str, int], list[float]] = {}

    # ---- option shorthands -----------------------------------------------------------
    @property
    def _grouping(self) -> bool:
        return self.options.grouping

    @property
    def _pulling(self) -> bool:
        return self.options.pulling

    @property
    def _evicting(self) -> bool:
        return self.options.eviction

    def _deadline(self, ticket: Ticket) -> float:
        slo = ticket.request.slo_s
        return ticket.arrived + (slo if slo is not None else self.options.no_slo_s)

    # ---- deciding ------------------------------------------------------------------------
    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None:
            raise ValueError(f"{self.name} needs the batch's estimates")
        out = []
        for r, req in enumerate(batch):
            cands = view.usable(req.candidates)
            answer = estimates.length[r] * self._correction(view.instances, req.input_tokens)
            quality = estimates.quality[r]
            planned = Planned(answer.copy(), quality.copy(),
                              (_bucket(req.input_tokens), _bucket(float(np.mean(answer[list(cands)])))))
            # A first placement: where the request would finish soonest if it were queued now.
            finish = {i: completion(self.models[i], QueueLoad.empty(self.models[i], view.in_flight[i]),
                                    length(answer[i], self.options.length_cv), req.input_tokens) for i in cands}
            ranked = tuple(sorted(cands, key=lambda i: finish[i].mean))
            slo = req.slo_s
            if (slo is not None and self.options.on_infeasible == "refuse"
                    and max(_idle(self.models[i], answer[i], self.options.length_cv, req.input_tokens).p_at_most(slo)
                            for i in cands) < self.options.floor):
                best = min(_idle(self.models[i], answer[i], 0.0, req.input_tokens).mean for i in cands)
                out.append(Decision((), refused=Refusal(
                    503, f"the SLO of {slo:g} s cannot be met: the fastest candidate needs about {best:.1f} s on an "
                         f"idle instance", "slo_infeasible", "routing.slo_s", "slo_infeasible", final=True)))
                continue
            i = ranked[0]
            out.append(Decision(ranked, quality=float(quality[i]), tokens=float(answer[i]),
                                latency_s=finish[i].mean, detail=planned))
        return out

    # ---- pulling --------------------------------------------------------------------------
    def hold(self, ticket: Ticket, view: PoolView) -> bool | Decision:
        with self._lock:
            if ticket not in self.group_of:
                self._join(ticket)
                if not self._grouping and self._queues:
                    self._insert(ticket, view)  # a group of one: placed without planning the rest again
            if self._dirty or (self.mode == "plan" and view.now - self._planned_at >= self.options.replan_s):
                self._replan(view)  # EDF's order only changes as requests join
            i = self._order[ticket]
            queue = self._queues[self.queue_of[i]]
            if self._pulling and (queue[0] is not ticket or not self._has_room(i, view)):
                return True
            queue.remove(ticket)  # the head, unless pulling is off
            self._leave(ticket)
        d = ticket.decision
        if d is None or not d.ranked or d.ranked[0] == i:
            return False
        detail = _planned(ticket)
        return Decision((i, *[j for j in d.ranked if j != i]), quality=float(detail.quality[i]),
                        tokens=float(detail.answer_tokens[i]), detail=detail)

    def _has_room(self, i: int, view: PoolView) -> bool:
        """Room on instance i: below its cap, nothing in vLLM's queue, KV to spare; and on a shared GPU,
        no other model's request in flight (the GPU finishes one model's stretch before it swaps)."""
        siblings = self.members[self.queue_of[i]]
        if len(siblings) > 1 and any(view.in_flight[j] > 0 for j in siblings if j != i):
            return False
        return (bool(view.available[i]) and view.in_flight[i] < self.models[i].cap and view.waiting[i] == 0
                and view.kv_usage[i] < self.options.kv_limit)

    def _running(self, i: int, view: PoolView) -> float:
        """Requests on instance i as the estimator counts them: a full KV cache or vLLM's own queue
        leave no free slot, whatever the count."""
        full = view.waiting[i] > 0 or view.kv_usage[i] >= self.options.kv_limit
        return float(self.models[i].cap if full else view.in_flight[i])

    def _join(self, ticket: Ticket) -> None:
        req = ticket.request
        key: tuple
        if ticket in self._resume_on:  # its KV cache waits on one instance: a group of its own, pinned there
            key = ("resume", id(ticket))
        elif self._grouping:
            base = (req.candidates, req.slo_class, _planned(ticket).bucket)
            n = 0
            while len(self.groups.get((*base, n), Group(())).members) >= self.options.max_group:
                n += 1
            key = (*base, n)
        else:
            key = (id(ticket),)
        group = self.groups.setdefault(key, Group(key))
        group.members.append(ticket)
        self.group_of[ticket] = group
        self._dirty = True

    def _insert(self, ticket: Ticket, view: PoolView) -> None:
        """Place a request of its own group into the current plan: on the instance the plan generator
        would choose given the queues, at its deadline's place (a deferred one: at the end)."""
        group = self._group_view(self.group_of[ticket], view.now)
        placed = choose(group, self.models, self._loads, self.queue_of, view.available, self.options.confidence,
                        self.options.floor, self.mode)
        i, _, answer = placed or soonest(group, self.models, self._loads, self.queue_of, view.available)
        q = self.queue_of[i]
        self._loads[q] = self._loads[q].toward(i, self.models[i]).plus(answer)
        queue, deadline = self._queues[q], self._deadline(ticket)
        at = len(queue)
        if placed is not None:
            at = next((k for k, t in enumerate(queue) if self._deadline(t) > deadline), len(queue))
        queue.insert(at, ticket)
        self._order[ticket] = i
        self._dirty = False

    def _leave(self, ticket: Ticket) -> None:
        self._rescued.discard(ticket)
        self._resume_on.pop(ticket, None)
        group = self.group_of.pop(ticket, None)
        if group is None:
            return
        group.members.remove(ticket)
        if not group.members:
            del self.groups[group.key]
        i = self._order.pop(ticket, None)
        if i is not None and ticket in self._queues.get(self.queue_of[i], ()):
            self._queues[self.queue_of[i]].remove(ticket)

    def _replan(self, view: PoolView) -> None:
        """Place and order every held group; each instance's queue of held requests follows."""
        groups = [g for g in self.groups.values() if g.members]
        views = [self._group_view(g, view.now) for g in groups]
        plan = greedy_plan(views, self.models, self._queues_now(view), view.available, self.options.confidence,
                           self.options.floor, order=self.mode)
        self._loads = plan.loads
        self._order.clear()
        self._queues = {q: deque(t for g in order for t in groups[g].members) for q, order in plan.queues.items()}
        self._next_models = []
        for q, order in plan.queues.items():
            for g in order:
                for t in groups[g].members:
                    self._order[t] = plan.placed[g]
            if len(self.members[q]) > 1:  # the models after the loaded one's stretch, in the order they come
                stretch = [plan.placed[g] for g in order]
                head = next((k for k, i in enumerate(stretch) if i != self.loaded[q]), len(stretch))
                self._next_models += dict.fromkeys(stretch[head:])
        self._dirty = False
        self._planned_at = view.now

    def _queues_now(self, view: PoolView) -> Queues:
        """Each virtual queue as it stands before the plan: what runs on its GPU now (on a shared GPU,
        the loaded model's requests and the answer tokens they have still to give)."""
        start = {}
        for q, members in self.members.items():
            if len(members) == 1:
                start[q] = QueueLoad.empty(self.models[members[0]], self._running(members[0], view))
                continue
            i = self.loaded[q]
            running = self._running(i, view)
            step = self.models[i].step_s(running)
            rest = tuple(r.left(view.now, step) for r in self.running.get(i, {}).values())
            start[q] = QueueLoad.empty(self.models[i], running, rest, member=i)
        return Queues(self.queue_of, start)

    def keeps_state(self, ticket: Ticket, instance: int) -> bool:
        model = self.models[instance]
        return self.options.state_swap and model.kv_swap_s_per_token < model.prefill_s_per_token

    def warm(self) -> Sequence[int]:
        return self._next_models if self.options.warm_start else ()

    def _group_view(self, group: Group, now: float) -> GroupView:
        members = group.members
        details = [_planned(t) for t in members]
        return GroupView(
            key=group.key,
            candidates=(self._resume_on[members[0]],) if members[0] in self._resume_on else
            members[0].request.candidates,
            slack_s=min(self._deadline(t) for t in members) - now,
            size=len(members),
            answer_tokens=np.mean([d.answer_tokens for d in details], axis=0),
            quality=np.mean([d.quality for d in details], axis=0),
            prompt_tokens=float(np.mean([t.request.input_tokens for t in members])),
            cv=self.options.length_cv,
        )

    # ---- eviction -----------------------------------------------------------------------------
    def evict(self, view: PoolView, now: float) -> Sequence[Ticket]:
        if not self._evicting:
            return ()
        victims = []
        with self._lock:
            if self._dirty:
                self._replan(view)
            for queue in self._queues.values():
                if not queue or queue[0] in self._rescued:
                    continue
                i = self._order[queue[0]]
                if view.available[i] and not self._has_room(i, view):
                    victim = self._victim(i, queue[0], view, now)
                    if victim is not None:
                        victims.append(victim)
                        if self.keeps_state(victim, i):
                            self._resume_on[victim] = i
                        self._rescued.add(queue[0])
        return victims

    def _victim(self, i: int, head: Ticket, view: PoolView, now: float) -> Ticket | None:
        """A running request of instance i to abort for `head`, or None: only when `head` misses
        waiting but meets starting now, and the victim can afford to start over behind it. A full KV
        cache gives up the request holding the most tokens; a full batch, the one with most slack."""
        model, cv, confidence = self.models[i], self.options.length_cv, self.options.confidence
        answer = length(float(_planned(head).answer_tokens[i]), cv)
        slack = self._deadline(head) - now
        running = self._running(i, view)
        waiting = self._first_slot(i, view, now, answer) + execution(model, answer, head.request.input_tokens,
                                                                     min(model.cap, running + 1))
        at_once = completion(model, QueueLoad.empty(model, model.cap - 1), answer, head.request.input_tokens)
        if waiting.p_at_most(slack) >= confidence or at_once.p_at_most(slack) < confidence:
            return None
        kv_bound = view.waiting[i] > 0 or view.kv_usage[i] >= self.options.kv_limit
        best, best_key = None, -math.inf
        for t, r in self.running.get(i, {}).items():
            if not t.evictable or t.evictions >= self.options.max_evictions:
                continue
            behind = QueueLoad.empty(model, model.cap).plus(answer)
            if self.keeps_state(t, i):  # it resumes: the rest of its answer, nothing to prefill
                again = completion(model, behind, length(r.left(now, model.step_s(running)), cv), 0)
            else:
                again = completion(model, behind, length(r.answer_tokens, cv), t.request.input_tokens)
            if again.p_at_most(self._deadline(t) - now) < confidence:
                continue  # it could not afford to start over
            key = t.request.input_tokens + r.streamed if kv_bound else self._deadline(t) - now - again.mean
            if key > best_key:
                best, best_key = t, key
        return best

    def _first_slot(self, i: int, view: PoolView, now: float, typical: Normal) -> Normal:
        """Seconds until full instance i frees a slot. When it runs only requests this policy dispatched
        and vLLM queues none, the end of the one with the least answer left; else Eq. 2's fluid view,
        the tail of a `typical` answer."""
        model, running = self.models[i], self._running(i, view)
        known = list(self.running.get(i, {}).values())
        if running < model.cap or not known or len(known) < view.in_flight[i] or view.waiting[i] > 0:
            return wait(model, QueueLoad.empty(model, running), typical)
        step = model.step_s(running)
        seconds = min(r.left(now, step) for r in known) * step
        return Normal(seconds, (self.options.length_cv * seconds) ** 2)

    # ---- lifecycle ----------------------------------------------------------------------------
    def on_dispatch(self, ticket: Ticket, plan: DispatchPlan, now: float) -> None:
        detail = ticket.decision.detail if ticket.decision else None
        tokens = float(detail.answer_tokens[plan.instance]) if isinstance(detail, Planned) else 0.0
        with self._lock:
            self._leave(ticket)
            self._stop(ticket)  # a request tried again elsewhere (failover) runs in one place
            cv = 0.0 if ticket.request.to_max_tokens else self.options.length_cv
            self.running.setdefault(plan.instance, {})[ticket] = Running(plan.instance, tokens, self._deadline(ticket),
                                                                         now, cv)
            self._running_on[ticket] = plan.instance
            self.loaded[self.queue_of[plan.instance]] = plan.instance

    def on_progress(self, ticket: Ticket, tokens: int, now: float) -> None:
        i = self._running_on.get(ticket)
        if i is not None:
            self.running[i][ticket].streamed = tokens

    def _stop(self, ticket: Ticket) -> Running | None:
        i = self._running_on.pop(ticket, None)
        return None if i is None else self.running[i].pop(ticket)

    def on_complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        with self._lock:
            self._leave(ticket)
            r = self._stop(ticket)
            if r is not None and completion.ok and completion.instance == r.instance and r.answer_tokens > 0:
                key = (self.instances[r.instance].model, _bucket(ticket.request.input_tokens))
                seen = self._seen.setdefault(key, [0.0, 0.0, 0.0])
                seen[0] += 1
                seen[1] += completion.completion_tokens
                seen[2] += r.answer_tokens / self._factor(key)  # what the estimators said, before correction

    def _factor(self, key: tuple[str, int]) -> float:
        """Answer tokens seen over tokens the estimators predicted, for a kind of prompt on a model
        (1 until a few answers have been seen)."""
        seen = self._seen.get(key)
        if seen is None or seen[0] < PROFILE_MIN_SEEN or seen[2] <= 0:
            return 1.0
        return seen[1] / seen[2]

    def _correction(self, instances: Sequence[InstanceSettings], prompt_tokens: int) -> np.ndarray:
        bucket = _bucket(prompt_tokens)
        with self._lock:
            return np.array([self._factor((inst.model, bucket)) for inst in instances])

    def compute_s(self, batch_size: int, cost) -> float:
        groups = max(len(self.groups), 1) if self._grouping else batch_size + len(self.group_of)
        return batch_size * len(self.models) * PLAN_S_PER_GROUP_INSTANCE + groups * len(self.models) * \
            PLAN_S_PER_GROUP_INSTANCE


def _planned(ticket: Ticket) -> Planned:
    """What `assign` kept of a request's decision."""
    detail = ticket.decision.detail if ticket.decision is not None else None
    if not isinstance(detail, Planned):
        raise ValueError("a request qlm did not decide")
    return detail


def _swap_s(inst, mode: str) -> float:
    """The constant swap time QLM plans with: the paper's conservative estimate, a load from storage.
    Warm start makes most swaps cheaper than that (measured: planning with the warm time instead
    swaps more often than the warm reads keep up with, and meets fewer SLOs). EDF takes swaps as free."""
    if mode == "edf" or inst.gpu_id is None:
        return 0.0
    return load_seconds(inst.model, inst.gpu_count)[1]


def _bucket(tokens: float) -> int:
    return int(math.log2(max(tokens, 1.0)))


def _idle(model: InstanceModel, answer_tokens: float, cv: float, prompt_tokens: int) -> Normal:
    """A request's completion on an idle instance: its floor."""
    return completion(model, QueueLoad.empty(model, 0), length(float(answer_tokens), cv), prompt_tokens)


def build_qlm(context: PolicyContext) -> Qlm:
    options = context.options("qlm")
    instances = context.config.instances
    specs = [spec_for_instance(i) for i in instances]
    if options.step_curve == "heads":
        if context.estimators is None:
            raise ValueError("qlm's step_curve = \"heads\" needs the TPOT heads, which are not built: "
                             "run `routebalance train`")
        specs = [_from_heads(context.estimators.heads, i, spec, options.slowdown)
                 for i, spec in zip(instances, specs, strict=True)]
    return Qlm(instances, options, specs=specs)


def _from_heads(heads, inst, spec: EngineSpec, slowdown: float) -> EngineSpec:
    """The engine model with its decode-step line replaced by the heads' (unchanged for a tier without a head)."""
    curve = heads_curve(heads, inst, spec, arch_for(inst.model).mean_output_tokens, slowdown)
    if curve is None:
        return spec
    return replace(spec, tpot_s=curve[0], batch_slope=curve[1])


def build_edf(context: PolicyContext) -> Qlm:
    edf = context.options("edf")
    # QLM's machinery with its intelligence off: deadline order, no groups, no deferral, no eviction.
    options = build_section(QlmOptions, {"slowdown": edf.slowdown, "length_cv": edf.length_cv, "no_slo_s": edf.no_slo_s,
                                         "floor": 0.0, "on_infeasible": "serve", "pulling": True, "eviction": False,
                                         "grouping": False, "warm_start": False, "kv_limit": edf.kv_limit},
                            "policies.edf")
    policy = Qlm(context.config.instances, options, mode="edf")
    policy.name = "edf"
    return policy


OPTIONS = {"qlm": QlmOptions, "edf": EdfOptions}
ENTRIES = (
    PolicyEntry("qlm", build_qlm, "QLM: request groups in per-instance virtual queues, planned for SLO attainment; "
                "request pulling and eviction", needs_estimates=True),
    PolicyEntry("edf", build_edf, "earliest deadline first: requests pulled in SLO-deadline order to the instance "
                "that finishes them soonest", needs_estimates=True),
)
