"""QLM's request groups and plan generator (papers/qlm-queue-management.txt sections 4 and 7).

A plan puts each request group in one instance's virtual queue, in order.
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

from gateway.scheduling.rct import InstanceModel, Normal, QueueLoad, completion, length


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


@dataclass(slots=True)
class Plan:
    queues: dict[int, list[int]] = field(default_factory=dict)  # instance -> group indices, in order
    p_meet: dict[int, float] = field(default_factory=dict)  # group index -> P(it completes within its slack)
    placed: dict[int, int] = field(default_factory=dict)  # group index -> instance

    def met(self, groups: Sequence[GroupView], confidence: float) -> int:
        """Requests whose group meets its SLO with at least `confidence` (the objective)."""
        return sum(groups[g].size for g, p in self.p_meet.items() if p >= confidence)


def group_completion(model: InstanceModel, load: QueueLoad, g: GroupView, i: int) -> tuple[Normal, Normal]:
    """(completion of the group's last request, one request's answer) when `g` joins instance i's
    queue `load`: the group's own earlier requests queue before its last one."""
    answer = length(float(g.answer_tokens[i]), g.cv)
    return completion(model, load.plus(answer, g.size - 1), answer, g.prompt_tokens), answer


def choose(group: GroupView, models: Sequence[InstanceModel], queued: dict[int, QueueLoad], usable: np.ndarray,
           confidence: float, floor: float, order: str = "plan") -> tuple[int, float, Normal] | None:
    """Where a group goes behind the queues `queued`: (instance, P(meet), one answer), or None when
    no instance meets it with probability `floor` (defer it). `order` "edf": where it finishes soonest."""
    options = []
    for i in _usable(group.candidates, usable):
        c, answer = group_completion(models[i], queued[i], group, i)
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


def soonest(group: GroupView, models: Sequence[InstanceModel], queued: dict[int, QueueLoad],
            usable: np.ndarray) -> tuple[int, float, Normal]:
    """Where a deferred group finishes soonest: (instance, P(meet), one answer)."""
    scored = []
    for i in _usable(group.candidates, usable):
        c, answer = group_completion(models[i], queued[i], group, i)
        scored.append((c.mean, i, c.p_at_most(group.slack_s), answer))
    _, i, p, answer = min(scored, key=lambda o: o[0])
    return i, p, answer


def greedy_plan(groups: Sequence[GroupView], models: Sequence[InstanceModel], running: np.ndarray,
                usable: np.ndarray, confidence: float, floor: float, order: str = "plan") -> Plan:
    """The plan generator: groups earliest deadline first, each placed by `choose`; the deferred ones
    behind every group that can still be saved, each on the queue where it finishes soonest.
    `order` "edf" is the EDF baseline: no deferral, each group where it finishes soonest."""
    plan = Plan(queues={i: [] for i in range(len(models))})
    queued = {i: QueueLoad.empty(m, running[i]) for i, m in enumerate(models)}
    deferred = []
    for g in sorted(range(len(groups)), key=lambda k: groups[k].slack_s):
        placed = choose(groups[g], models, queued, usable, confidence, floor, order)
        if placed is None:
            deferred.append(g)
        else:
            _place(plan, queued, g, *placed, groups[g].size)
    for g in deferred:
        _place(plan, queued, g, *soonest(groups[g], models, queued, usable), groups[g].size)
    return plan


def _usable(candidates: tuple[int, ...], usable: np.ndarray) -> list[int]:
    up = [i for i in candidates if usable[i]]
    return up or list(candidates)


def _place(plan: Plan, queued: dict[int, QueueLoad], g: int, i: int, p: float, answer: Normal, size: int) -> None:
    plan.queues[i].append(g)
    plan.placed[g] = i
    plan.p_meet[g] = p
    queued[i] = queued[i].plus(answer, size)


def evaluate(queues: dict[int, list[int]], groups: Sequence[GroupView], models: Sequence[InstanceModel],
             running: np.ndarray) -> Plan:
    """The plan that these queues (instance -> groups in order) are, with each group's P(meet)."""
    plan = Plan(queues={i: list(q) for i, q in queues.items()})
    for i, order in queues.items():
        load = QueueLoad.empty(models[i], running[i])
        for g in order:
            c, answer = group_completion(models[i], load, groups[g], i)
            plan.placed[g], plan.p_meet[g] = i, c.p_at_most(groups[g].slack_s)
            load = load.plus(answer, groups[g].size)
    return plan


def optimal_plan(groups: Sequence[GroupView], models: Sequence[InstanceModel], running: np.ndarray,
                 confidence: float) -> Plan:
    """The best plan by exhaustive search over every assignment and order (small cases only):
    most requests met with `confidence`, then the highest sum of P(meet)."""
    n, instances = len(groups), range(len(models))
    if n > 7:
        raise ValueError("exhaustive search is for small cases (at most 7 groups)")
    best, best_key = Plan(), (-1, -1.0)
    for assignment in itertools.product(*[groups[g].candidates for g in range(n)]):
        members = {i: [g for g in range(n) if assignment[g] == i] for i in instances}
        for orders in itertools.product(*[itertools.permutations(members[i]) for i in instances]):
            plan = evaluate({i: list(o) for i, o in zip(instances, orders, strict=True)}, groups, models, running)
            key = (plan.met(groups, confidence), sum(plan.p_meet.values()))
            if key > best_key:
                best, best_key = plan, key
    return best
