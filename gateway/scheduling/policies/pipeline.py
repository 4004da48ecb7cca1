"""Pipeline mode (paper section 5): a model router, then a dispatcher among that model's instances.

The baselines run inside the same batching, telemetry and dispatch path as
RouteBalance; only these two steps differ. Eq. 1 and the budget filter are
bypassed: a pipeline never refuses, and relies on the dispatch-time clamp the
shell applies to every request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from gateway.config import DISPATCHERS, ROUTERS
from gateway.estimators.knn import KnnEstimator
from gateway.scheduling.policies.dispatchers import (
    Dispatcher,
    Random,
    RoundRobin,
    ShortestQueue,
)
from gateway.scheduling.policies.routers import Avengers, BestRoute, Passthrough, Router
from gateway.scheduling.policy import Decision, Estimates, PoolView, RouteRequest


class PipelinePolicy:
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
            tokens = float(estimates.length[r, best])
            decisions.append(Decision(
                tuple(ranked),
                quality=float(estimates.quality[r, best]),
                cost_usd=float(req.input_tokens * view.price_in[best] + tokens * view.price_out[best]),
                latency_s=float(view.tpot_prior_s[best] * tokens),
                tokens=tokens,
            ))
            # Dead reckoning, so shortest_queue sees this request when placing the next.
            view.dispatched(best, tokens, req.input_tokens)
        return decisions


def make_pipeline(name: str, *, knn: KnnEstimator | None = None, prices_out: Mapping[str, float] | None = None,
                  performance_weight: float = 0.7, clusters: int = 64, best_route_threshold: float = 0.02,
                  seed: int = 0) -> PipelinePolicy:
    """The policy "<router>+<dispatcher>"; `prices_out` maps a model to its USD per output token."""
    router_name, _, dispatcher_name = name.partition("+")
    if router_name not in ROUTERS or dispatcher_name not in DISPATCHERS:
        raise ValueError(f"unknown pipeline policy {name!r}; expected <router>+<dispatcher> with router one of "
                         f"{', '.join(ROUTERS)} and dispatcher one of {', '.join(DISPATCHERS)}")
    router: Router
    if router_name == "passthrough":
        router = Passthrough()
    elif router_name == "best_route":
        router = BestRoute(best_route_threshold)
    else:
        if knn is None or prices_out is None:
            raise ValueError(f"{name} needs the KNN estimator and the models' output prices")
        router = Avengers(knn, prices_out, performance_weight, clusters, seed)
    dispatcher: Dispatcher
    if dispatcher_name == "round_robin":
        dispatcher = RoundRobin()
    elif dispatcher_name == "shortest_queue":
        dispatcher = ShortestQueue()
    else:
        dispatcher = Random(seed)
    return PipelinePolicy(router, dispatcher)
