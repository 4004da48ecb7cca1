"""RouteBalance: every request to the instance with the best Eq. 1 score (policies/routebalance/assign.py)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.routebalance.assign import RouteBalanceOptions, TpotFn, assign_batch


class RouteBalance(Policy):
    name = "routebalance"
    needs_estimates = True

    def __init__(self, options: RouteBalanceOptions, tpot: TpotFn | None,
                 tpot_error: Mapping[str, float] | None = None):
        self.options = options
        self.tpot = tpot  # the TPOT heads; None falls back to the static prior
        self.tpot_error = tpot_error  # each tier's head's held-out relative error
        self.rng = np.random.default_rng(options.seed)  # breaks exact ties: a run repeats, load spreads

    def prompt_blind(self, request: RouteRequest, view: PoolView) -> bool:
        # Among one model's instances the prompt's quality is the same everywhere and its predicted length
        # only scales each candidate's decode time: the model's mean length ranks them nearly as well, and
        # embedding a long prompt costs tens of milliseconds of the time to its first token.
        return len({view.instances[c].model for c in request.candidates}) == 1

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None:
            raise ValueError("routebalance needs the batch's estimates")
        return assign_batch(batch, estimates, view, self.options, self.tpot, self.rng, self.tpot_error)

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return cost.score_s(batch_size, self.options.uses_heads)


def build(context: PolicyContext) -> RouteBalance:
    est = context.estimators
    if est is None:
        return RouteBalance(context.options("routebalance"), None)
    return RouteBalance(context.options("routebalance"), est.heads.tpot, est.heads.errors)


OPTIONS = {"routebalance": RouteBalanceOptions}
ENTRIES = (PolicyEntry("routebalance", build, "quality, latency and cost priced together per instance (Eq. 1)",
                       needs_estimates=True, reads_prefixes=True),)
