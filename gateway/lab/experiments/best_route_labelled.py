"""BEST-Route's cells of the real-label world (labelled_sweep.py) and the quality preset's they are paired
with, rerun on their own when BEST-Route changes:

    routebalance sim --sweep best_route_labelled --workload ../shared/data/real-labels/zeroeval_crux_math_dev.jsonl

The rates are the labelled sweep's own (loadtest/results/labelled.csv: 30%, 60% and 90% of the capacity
its probe measured on that file, about 18.95 req/s), so the cells replay the same arrivals without probing
again.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments import labelled_sweep
from gateway.lab.experiments.sweeps import RB_WEIGHTS, Cell, Pair, _best_route, _rb
from gateway.lab.sim.arrivals import ArrivalSpec

RATES = {0.3: 5.68, 0.6: 11.37, 0.9: 17.05}  # load share -> req/s, as the labelled sweep ran them
REQUESTS = labelled_sweep.REQUESTS


def cells(n: int, rates: dict[float, float] = RATES) -> list[Cell]:
    out = []
    for load, rate in rates.items():
        for c in (_rb("quality", RB_WEIGHTS["quality"], rate, n),
                  _best_route(0.5, "shortest_queue", ArrivalSpec(rate=rate), n)):
            out.append(Cell(c.system, c.label, c.spec, c.config_changes, {**c.tags, "load": load}))
    return out


def pairs(cells: Sequence[Cell]) -> list[Pair]:
    return [Pair(f"quality preset vs BEST-Route @{load:g}", {"system": "routebalance", "label": "quality",
                                                            "load": load},
                 {"system": "best_route", "load": load}, ("quality", "cost_mean", "e2e_mean"))
            for load in dict.fromkeys(c.tags["load"] for c in cells)]
