"""RouteBalance: every request to the instance with the best Eq. 1 score (scheduling/assign.py)."""

from __future__ import annotations

from collections.abc import Sequence

from gateway.scheduling.assign import ScoreOptions, TpotFn, assign_batch
from gateway.scheduling.policy import Decision, Estimates, PoolView, RouteRequest


class RouteBalance:
    name = "routebalance"
    needs_estimates = True

    def __init__(self, options: ScoreOptions, tpot: TpotFn | None):
        self.options = options
        self.tpot = tpot  # the TPOT heads; None falls back to the static prior

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None:
            raise ValueError("routebalance needs the batch's estimates")
        return assign_batch(batch, estimates, view, self.options, self.tpot)
