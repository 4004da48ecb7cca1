"""Pipeline mode (paper section 5): a model router, then a dispatcher among that model's instances.

The baselines run inside the same batching, telemetry and dispatch path as
RouteBalance; only these two steps differ. Eq. 1 and the budget filter are
bypassed: a pipeline never refuses, and relies on the budget clamp that the
loop's dispatch plans apply to every request.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.config_schema import Section, option, section
from gateway.scheduling.budget import per_token, predicted_cost
from gateway.scheduling.policies.base import Policy, PolicyContext, PolicyEntry
from gateway.scheduling.policies.dispatchers import Dispatcher, Random, RoundRobin, ShortestQueue
from gateway.scheduling.policies.routers import Avengers, BestRoute, Passthrough, Router
from gateway.scheduling.request import Decision, Estimates, RouteRequest
from gateway.scheduling.view import PoolView

ROUTERS = ("passthrough", "avengers", "best_route")
DISPATCHERS = ("round_robin", "shortest_queue", "random")


@section
class PipelineOptions(Section):
    """[policies.pipeline]: Avengers-Pro's performance weight and number of
    embedding clusters, BEST-Route's quality-gap threshold, and the seed of the
    random dispatcher and of the clustering."""

    avengers_performance_weight: float = option(0.7, ge=0, le=1)
    avengers_clusters: int = option(64, ge=1)
    best_route_threshold: float = option(0.02, ge=0)
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
            tokens = float(estimates.length[r, best])
            decisions.append(Decision(
                tuple(ranked),
                quality=float(estimates.quality[r, best]),
                cost_usd=float(predicted_cost(req.input_tokens, tokens * req.n, view.price_in[best],
                                              view.price_out[best])),
                latency_s=float(view.tpot_prior_s[best] * tokens),
                tokens=tokens,
            ))
            # Dead reckoning, so shortest_queue sees this request when placing the next.
            view.dispatched(best, tokens, req.input_tokens)
        return decisions


def make_router(name: str, context: PolicyContext) -> Router:
    knobs = context.options("pipeline")
    if name == "passthrough":
        return Passthrough()
    if name == "best_route":
        return BestRoute(knobs.best_route_threshold)
    if context.estimators is None:
        raise ValueError("avengers needs the KNN estimator, which is not built: run `routebalance train`")
    prices_out = {i.model: per_token(i.price_output_per_mtok) for i in context.config.instances}
    return Avengers(context.estimators.knn, prices_out, knobs.avengers_performance_weight, knobs.avengers_clusters,
                    knobs.seed)


def make_dispatcher(name: str, context: PolicyContext) -> Dispatcher:
    if name == "round_robin":
        return RoundRobin()
    if name == "shortest_queue":
        return ShortestQueue()
    return Random(context.options("pipeline").seed)


def _entry(router: str, dispatcher: str) -> PolicyEntry:
    def build(context: PolicyContext) -> PipelinePolicy:
        return PipelinePolicy(make_router(router, context), make_dispatcher(dispatcher, context))

    what = {"passthrough": "no model choice", "avengers": "Avengers-Pro-style cluster ranking picks the model",
            "best_route": "BEST-Route-style cheapest model near the best picks the model"}[router]
    return PolicyEntry(f"{router}+{dispatcher}", build, f"baseline: {what}, then {dispatcher.replace('_', ' ')}",
                       needs_estimates=router != "passthrough")


OPTIONS = {"pipeline": PipelineOptions}
ENTRIES = tuple(_entry(r, d) for r in ROUTERS for d in DISPATCHERS)
