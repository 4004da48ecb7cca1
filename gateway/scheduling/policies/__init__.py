"""Routing policies: RouteBalance and the pipeline-mode baselines, built from the config."""

from __future__ import annotations

from gateway.scheduling.assign import ScoreOptions
from gateway.scheduling.budget import per_token
from gateway.scheduling.policies.routebalance import RouteBalance


def score_options(cfg) -> ScoreOptions:
    s = cfg.scheduler
    return ScoreOptions(s.quality_term, s.latency_term, s.tiebreak, s.lpt, s.budget_filter)


def make_policy(name: str, cfg, estimators=None):
    """The policy called `name` (config.POLICY_NAMES); `estimators` may be None if not built."""
    if name == "routebalance":
        return RouteBalance(score_options(cfg), estimators.heads.tpot if estimators else None)
    from gateway.scheduling.policies.pipeline import make_pipeline

    knobs = cfg.scheduler.pipeline
    return make_pipeline(
        name,
        knn=estimators.knn if estimators else None,
        prices_out={i.model: per_token(i.price_output_per_mtok) for i in cfg.instances},
        performance_weight=knobs.avengers_performance_weight,
        clusters=knobs.avengers_clusters,
        best_route_threshold=knobs.best_route_threshold,
        seed=knobs.seed,
    )
