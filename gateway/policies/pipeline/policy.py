"""Pipeline mode (paper section 5): a model router, then a dispatcher among that model's instances.

The baselines run inside the same batching, telemetry and dispatch path as
RouteBalance; only these two steps differ. Eq. 1 and the budget filter are
bypassed: a pipeline never refuses, and relies on the budget clamp that the
loop's dispatch plans apply to every request.

This module registers the passthrough router with each dispatcher and owns
`[policies.pipeline]`, what every pipeline's dispatcher reads. A learned
router registers its own `<router>+<dispatcher>` policies with `entries` and
owns its own table (avengers.py, best_route.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gateway.config_schema import Section, section
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.pipeline.dispatchers import Dispatcher, PowerOfTwo, Random, RoundRobin, ShortestQueue
from gateway.policies.pipeline.routers import Passthrough, Router

DISPATCHERS = ("round_robin", "shortest_queue", "random", "power_of_two")
SAID = {"power_of_two": "power of two choices"}  # a dispatcher's name in words, where its name says too little


@section
class PipelineOptions(Section):
    """[policies.pipeline]: the seed of the random dispatcher and of every dispatcher's tie-breaks."""

    seed: int = 0


class PipelinePolicy(Policy):
    def __init__(self, router: Router, dispatcher: Dispatcher):
        self.router = router
        self.dispatcher = dispatcher
        self.name = f"{router.name}+{dispatcher.name}"
        self.needs_estimates = router.needs_estimates

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        usable = [view.usable(req.candidates) for req in batch]
        models = self.router.route(batch, usable, estimates, view)
        decisions = []
        for r, (req, cands, model) in enumerate(zip(batch, usable, models, strict=True)):
            mine = cands if model is None else [i for i in cands if view.instances[i].model == model]
            rest = [i for i in cands if i not in mine]
            # The other models' instances come after, so a failed first try can still land somewhere.
            ranked = self.dispatcher.rank(mine, view) + self.dispatcher.rank(rest, view)
            best = ranked[0]
            self.dispatcher.chose(best)
            if estimates is None:
                decisions.append(Decision(tuple(ranked)))
                view.dispatched(best, 0.0, req.input_tokens)
                continue
            predicted = view.predicted(req, estimates, r, best)
            decisions.append(Decision(tuple(ranked), latency_s=float(view.tpot_prior_s[best] * predicted["tokens"]),
                                      **predicted))
            # Dead reckoning, so shortest_queue sees this request when placing the next.
            view.dispatched(best, predicted["tokens"], req.input_tokens)
        return decisions

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return self.router.compute_s(batch_size)


def make_dispatcher(name: str, context: PolicyContext) -> Dispatcher:
    seed = context.options("pipeline").seed
    if name == "round_robin":
        return RoundRobin(seed)
    if name == "shortest_queue":
        return ShortestQueue(seed)
    if name == "power_of_two":
        return PowerOfTwo(seed)
    return Random(seed)


def entries(router: str, make_router: Callable[[PolicyContext], Router], what: str,
            needs_estimates: bool = True) -> tuple[PolicyEntry, ...]:
    """`<router>+<dispatcher>` for every dispatcher; `make_router` builds a new router for each policy object."""

    def entry(dispatcher: str) -> PolicyEntry:
        def build(context: PolicyContext) -> PipelinePolicy:
            return PipelinePolicy(make_router(context), make_dispatcher(dispatcher, context))

        return PolicyEntry(f"{router}+{dispatcher}", build,
                           f"baseline: {what}, then {SAID.get(dispatcher, dispatcher.replace('_', ' '))}",
                           needs_estimates=needs_estimates)

    return tuple(entry(d) for d in DISPATCHERS)


OPTIONS = {"pipeline": PipelineOptions}
ENTRIES = entries("passthrough", lambda context: Passthrough(), "no model choice", needs_estimates=False)
