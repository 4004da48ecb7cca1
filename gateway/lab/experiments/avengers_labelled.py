"""Avengers-Pro across its performance weights on the real-label file, against the quality preset:

    routebalance sim --sweep avengers_labelled --workload ../shared/data/real-labels/zeroeval_crux_math_dev.jsonl

The labelled sweep (labelled_sweep.py) runs Avengers-Pro at its paper setting (p_w 0.53) only; the
RouteBalance paper compares its quality preset with the best Avengers-Pro cell of a grid. These cells run
the synthetic frontier's grid (sweeps.AVENGERS_WEIGHTS) with the labelled sweep's dispatcher at its loads
(shares of the capacity the same seeded probe measures), beside the labelled sweep's quality-preset cells.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments import labelled_sweep
from gateway.lab.experiments.labelled_sweep import DISPATCHER
from gateway.lab.experiments.sweeps import AVENGERS_WEIGHTS, Cell, Pair, _avengers

REQUESTS = labelled_sweep.REQUESTS


def cells(n: int, capacity: float) -> list[Cell]:
    """The quality preset's cells of the labelled sweep, and Avengers-Pro at every p_w of the grid."""
    out = [c for c in labelled_sweep.cells(n, capacity) if c.system == "routebalance" and c.label == "quality"]
    for c in list(out):  # at each load, the grid on the preset's own arrivals
        out += [Cell(a.system, a.label, a.spec, a.config_changes, dict(c.tags))
                for a in (_avengers(pw, DISPATCHER, c.spec.arrivals, n) for pw in AVENGERS_WEIGHTS)]
    return out


def pairs(cells: Sequence[Cell]) -> list[Pair]:
    labels = tuple(f"p_w={pw}+{DISPATCHER}" for pw in AVENGERS_WEIGHTS)
    return [Pair(f"quality preset vs best Avengers-Pro @{load:g}",
                 {"system": "routebalance", "label": "quality", "load": load},
                 {"system": "avengers", "label": labels, "load": load}, ("quality", "cost_mean", "e2e_mean"))
            for load in dict.fromkeys(c.tags["load"] for c in cells)]
