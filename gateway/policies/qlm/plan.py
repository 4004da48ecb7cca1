"""QLM's request groups and plan generator (papers/qlm-queue-management.txt sections 4 and 7).

A plan puts each request group in one virtual queue, in order, to be served
by one instance of that queue's GPU (most GPUs serve one instance; those
shared by several models swap between them, and a group of another model
than the one its queue ends with pays the swap, so groups of one model
gather on the GPUs that already serve it).
Its objective is the paper's chance constraint (Eq. 12) counted: as many
requests as possible whose group completes within its SLO with probability
at least `confidence`; among the instances that achieve it for a group, the
one whose model answers it best (QLM itself is quality-blind: it serves the
model a request names; with `model: "auto"` the gateway chooses, and picks
the best model that still meets the SLO).

The greedy generator takes the groups earliest deadline first (optimal for
one queue when every deadline can be met) and puts each on the best
instance that meets it, given what is already queued there; a group that no
instance can meet with probability `floor` is deferred to the back of the
least-loaded queue, so it delays no group that can still be saved (where
plain EDF would serve the hopeless first). `optimal_plan` searches every
assignment and order exhaustively for the same objective: the reference the
greedy one is measured against on small cases.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from gateway.policies.qlm.rct import InstanceModel, Normal, QueueLoad, completion, length


@dataclass(slots=True)
class GroupView:
    """What the plan knows of one request group (its members are queued FCFS)."""

    key: tuple
    candidates: tuple[int, ...]  # instances its requests may use
    slack_s: float  # time left to its earliest member's deadline
    size: int  # requests in it
    answer_tokens: np.ndarray  # (instances,) mean predicted answer tokens on each
    quality: np.ndarray  # (instances,) mean predicted quality on each
    prompt_tokens: float  # mean prompt tokens
    cv: float = 0.5  # answer length spread, a share of the mean


@dataclass(frozen=True, slots=True)
class Queues:
    """The virtual queues a plan fills: which queue (GPU) each instance's requests join, and each
    queue's load before the plan (what runs on it now)."""

    of: tuple[int, ...]  # instance -> its queue
    start: dict[int, QueueLoad]  # queue -> its load now

    @classmethod
    def dedicated(cls, models: Sequence[InstanceModel], running: np.ndarray) -> Queues:
        """One queue per instance, each running `running[i]` requests."""
        return cls(tuple(range(len(models))), {i: QueueLoad.empty(m, running[i]) for i, m in enumerate(models)})


@dataclass(slots=True)
class Plan:
    queues: dict[int, list[int]] = field(default_factory=dict)  # queue -> group indices, in order
    p_meet: dict[int, float] = field(default_factory=dict)  # group index -> P(it completes within its slack)
    placed: dict[int, int] = field(default_factory=dict)  # group index -> instance
    loads: dict[int, QueueLoad] = field(default_factory=dict)  # queue -> its load with the plan's groups

    def met(self, groups: Sequence[GroupView], confidence: float) -> int:
        """Requests whose group meets its SLO with at least `confidence` (the objective)."""
        return sum(groups[g].size for g, p in self.p_meet.items() if p >= confidence)


def group_completion(model: InstanceModel, load: QueueLoad, g: GroupView, i: int) -> tuple[Normal, Normal]:
    """(completion of the group's last request, one request's answer) when `g` joins instance i's
    queue `load`: the group's own earlier requests queue before its last one."""
    answer = length(float(g.answer_tokens[i]), g.cv)
    return completion(model, load.plus(answer, g.size - 1), answer, g.prompt_tokens), answer


def choose(group: GroupView, models: Sequence[InstanceModel], queued: dict[int, QueueLoad], queue_of: Sequence[int],
           usable: np.ndarray, confidence: float, floor: float,
           order: str = "plan") -> tuple[int, float, Normal] | None:
    """Where a group goes behind the queues `queued`: (instance, P(meet), one answer), or None when
    no instance meets it with probability `floor` (defer it). `order` "edf": where it finishes soonest."""
    options = []
    for i in _usable(group.candidates, usable):
        c, answer = group_completion(models[i], queued[queue_of[i]].toward(i, models[i]), group, i)
        options.append((i, c.p_at_most(group.slack_s), float(group.quality[i]), c.mean, answer))
    if order == "edf":
        i, p, _, _, answer = min(options, key=lambda o: o[3])
        return i, p, answer
    meeting = [o for o in options if o[1] >= confidence]
    if meeting:  # the best model that meets it; of its instances, the one that finishes it soonest
        i, p, _, _, answer = max(meeting, key=lambda o: (o[2], -o[3]))
        return i, p, answer
    i, p, _, _, answer = max(options, key=lambda o: (o[1], -o[3]))
    return (i, p, answer) if p >= floor else None


def soonest(group: GroupView, models: Sequence[InstanceModel], queued: dict[int, QueueLoad], queue_of: Sequence[int],
            usable: np.ndarray) -> tuple[int, float, Normal]:
    """Where a deferred group finishes soonest: (instance, P(meet), one answer)."""
    scored = []
    for i in _usable(group.candidates, usable):
        c, answer = group_completion(models[i], queued[queue_of[i]].toward(i, models[i]), group, i)
        scored.append((c.mean, i, c.p_at_most(group.slack_s), answer))
    _, i, p, answer = min(scored, key=lambda o: o[0])
    return i, p, answer


def greedy_plan(groups: Sequence[GroupView], models: Sequence[InstanceModel], queues: Queues,
                usable: np.ndarray, confidence: float, floor: float, order: str = "plan") -> Plan:
    """The plan generator: groups earliest deadline first, each placed by `choose`; the deferred ones
    behind every group that can still be saved, each on the queue where it finishes soonest.
    `order` "edf" is the EDF baseline: no deferral, each group where it finishes soonest."""
    plan = Plan(queues={q: [] for q in queues.start}, loads=dict(queues.start))
    deferred = []
    for g in sorted(range(len(groups)), key=lambda k: groups[k].slack_s):
        placed = choose(groups[g], models, plan.loads, queues.of, usable, confidence, floor, order)
        if placed is None:
            deferred.append(g)
        else:
            place(plan, models, queues.of, g, *placed, groups[g].size)
    for g in deferred:
        place(plan, models, queues.of, g, *soonest(groups[g], models, plan.loads, queues.of, usable), groups[g].size)
    return plan


def _usable(candidates: tuple[int, ...], usable: np.ndarray) -> list[int]:
    up = [i for i in candidates if usable[i]]
    return up or list(candidates)


def place(plan: Plan, models: Sequence[InstanceModel], queue_of: Sequence[int], g: int, i: int, p: float,
          answer: Normal, size: int) -> None:
    """Put group g at the back of instance i's queue."""
    q = queue_of[i]
    plan.queues[q].append(g)
    plan.placed[g] = i
    plan.p_meet[g] = p
    plan.loads[q] = plan.loads[q].toward(i, models[i]).plus(answer, size)


def evaluate(order: dict[int, list[int]], placed: dict[int, int], groups: Sequence[GroupView],
             models: Sequence[InstanceModel], queues: Queues) -> Plan:
    """The plan that these queues (queue -> groups in order, each on its instance `placed[g]`) are,
    with each group's P(meet)."""
    plan = Plan(queues={q: list(gs) for q, gs in order.items()}, loads=dict(queues.start))
    for q, gs in order.items():
        for g in gs:
            i = placed[g]
            load = plan.loads[q].toward(i, models[i])
            c, answer = group_completion(models[i], load, groups[g], i)
            plan.placed[g], plan.p_meet[g] = i, c.p_at_most(groups[g].slack_s)
            plan.loads[q] = load.plus(answer, groups[g].size)
    return plan


def optimal_plan(groups: Sequence[GroupView], models: Sequence[InstanceModel], queues: Queues,
                 confidence: float) -> Plan:
    """The best plan by exhaustive search over every assignment and order (small cases only):
    most requests met with `confidence`, then the highest sum of P(meet)."""
    n = len(groups)
    if n > 7:
        raise ValueError("exhaustive search is for small cases (at most 7 groups)")
    best, best_key = Plan(), (-1, -1.0)
    names = list(queues.start)
    for assignment in itertools.product(*[groups[g].candidates for g in range(n)]):
        placed = dict(enumerate(assignment))
        members = [[g for g in range(n) if queues.of[assignment[g]] == q] for q in names]
        for orders in itertools.product(*[itertools.permutations(m) for m in members]):
            plan = evaluate({q: list(o) for q, o in zip(names, orders, strict=True)}, placed, groups, models, queues)
            key = (plan.met(groups, confidence), sum(plan.p_meet.values()))
            if key > best_key:
                best, best_key = plan, key
    return best
