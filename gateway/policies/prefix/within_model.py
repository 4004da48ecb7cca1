"""`routebalance+<baseline>`: RouteBalance chooses the model, a prefix baseline chooses among its instances.

vllm-router and SGLang's router place a request among the workers of the
model the client named; in a pool of several models something else must
name it. These policies let RouteBalance's score (Eq. 1 with its cache term,
under the request's preset) name the model and then hand the request to
`cache_aware`, `llmd` or `session_affinity` restricted to that model's
instances. Quality and cost then follow the preset as RouteBalance's own do,
and a comparison with RouteBalance isolates how each places a request among
one model's instances (docs/results/prefix.md).

RouteBalance decides the whole batch on a probe copy of the view, so its own
dead reckoning does not count twice; the baseline then places each request
on the real view, dead-reckoning as it always does. A refusal (a budget no
candidate can pay) stays RouteBalance's. The other models' instances follow
the chosen model's in the ranked list, for retries.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.prefix import cache_aware, llmd, session_affinity
from gateway.policies.routebalance import policy as routebalance


class WithinModel(Policy):
    needs_estimates = True

    def __init__(self, chooser: routebalance.RouteBalance, placer: Policy):
        self.chooser = chooser
        self.placer = placer
        self.name = f"{chooser.name}+{placer.name}"

    def prompt_blind(self, request: RouteRequest, view: PoolView) -> bool:
        return self.chooser.prompt_blind(request, view)

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None:
            raise ValueError(f"{self.name} needs the batch's estimates")
        chosen = self.chooser.assign(batch, estimates, view.probe())
        decisions = []
        for r, (req, pick) in enumerate(zip(batch, chosen, strict=True)):
            if not pick.ranked:  # refused
                decisions.append(pick)
                continue
            model = view.instances[pick.ranked[0]].model
            mine = tuple(i for i in req.candidates if view.instances[i].model == model)
            placed = self.placer.assign([replace(req, candidates=mine)], None, view)[0]
            best = placed.ranked[0]
            rest = tuple(i for i in pick.ranked if i not in placed.ranked)
            decisions.append(replace(placed, ranked=placed.ranked + rest, **view.predicted(req, estimates, r, best)))
        return decisions

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return self.chooser.compute_s(batch_size, cost)


def entry(placer: str, build_placer: Callable[[PolicyContext], Policy]) -> PolicyEntry:
    def build(context: PolicyContext) -> WithinModel:
        return WithinModel(routebalance.build(context), build_placer(context))

    return PolicyEntry(f"routebalance+{placer}", build, f"baseline: RouteBalance names the model, then {placer} "
                       "places the request among that model's instances", needs_estimates=True, reads_prefixes=True)


ENTRIES = (entry(cache_aware.NAME, cache_aware.build), entry(llmd.NAME, llmd.build),
           entry(session_affinity.NAME, session_affinity.build))
