"""BEST-Route's cells of the real-label world (labelled_sweep.py) and the quality preset's they are paired
with, rerun on their own when BEST-Route changes:

    routebalance sim --sweep best_route_labelled --workload ../shared/data/real-labels/zeroeval_crux_math_dev.jsonl

The cells are the labelled sweep's own, at the rates it sets (30%, 60% and 90% of the capacity its probe
measures on the file, which is seeded and so the same as the labelled sweep's), so they replay the same
arrivals.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments import labelled_sweep
from gateway.lab.experiments.sweeps import Cell, Pair

REQUESTS = labelled_sweep.REQUESTS


def cells(n: int, capacity: float) -> list[Cell]:
    """The labelled sweep's quality-preset and BEST-Route cells at the pool's measured `capacity`."""
    return [c for c in labelled_sweep.cells(n, capacity)
            if c.system == "best_route" or (c.system == "routebalance" and c.label == "quality")]


def pairs(cells: Sequence[Cell]) -> list[Pair]:
    return [Pair(f"quality preset vs BEST-Route @{load:g}", {"system": "routebalance", "label": "quality",
                                                            "load": load},
                 {"system": "best_route", "load": load}, ("quality", "cost_mean", "e2e_mean"))
            for load in dict.fromkeys(c.tags["load"] for c in cells)]
