"""The frontier on a labelled file (`routebalance sim --sweep labelled --workload FILE`): RouteBalance's
presets and quality-cost mixes against the baselines and every single model, replayed cross-fitted
(crossfit_world.py: no prompt is routed by an index that holds it).

The file's answers set the load (the real-label file's run to 180-940 tokens on average, several times the
synthetic workload's), so the rates are shares of the pool's capacity on this file, measured first:
the completions per second of shortest-queue dispatch over every instance when far more arrives than
it serves. Each run replays every prompt of the file once (in its fold), so a cell's quality is the
file's mean correctness under that policy and load.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments.sweeps import (
    BIGGEST,
    RB_WEIGHTS,
    Cell,
    Pair,
    _avengers,
    _best_route,
    _passthrough,
    _rb,
)
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.simulator import CellSpec

# Per cell and seed: each prompt of the shared real-label file twice, so that each fold's run (a fifth) lasts
# long enough for its queues to form at the highest load.
REQUESTS = 1900
LOADS = (0.3, 0.6, 0.9)  # shares of the measured capacity
OVERLOAD_RATE = 64.0  # req/s offered while capacity is measured: over three times the default pool's here
PROBE_PASSES = 5  # the probe replays this many times a cell's requests, so its queues stay long
DISPATCHER = "shortest_queue"  # how the baselines pick an instance of their model (and the probe dispatches)
PRESETS = ("cost", "uniform", "quality")
MIXES = {"mix 0.8:0.2": (0.8, 0.0, 0.2), "mix 0.5:0.5": (0.5, 0.0, 0.5), "mix 0.2:0.8": (0.2, 0.0, 0.8)}
SINGLE = {"always 7B": "Qwen/Qwen2.5-7B-Instruct", "always 14B": "Qwen/Qwen2.5-14B-Instruct", "always 72B": BIGGEST}


def capacity_cell(n: int) -> Cell:
    """Served requests per second over the run is the capacity when far more arrives than is served."""
    return _passthrough(DISPATCHER, ArrivalSpec(rate=OVERLOAD_RATE), PROBE_PASSES * n)


def cells(n: int, capacity: float, loads: Sequence[float] = LOADS) -> list[Cell]:
    out = []
    for load in loads:
        rate = round(load * capacity, 2)
        arr = ArrivalSpec(rate=rate)
        tags = {"load": load}
        group = [_rb(label, RB_WEIGHTS[label], rate, n) for label in PRESETS]
        group += [_rb(label, w, rate, n) for label, w in MIXES.items()]
        group += [_passthrough(DISPATCHER, arr, n), _avengers(0.53, DISPATCHER, arr, n),
                  _best_route(0.5, DISPATCHER, arr, n)]
        group += [Cell("single_model", label, CellSpec(f"passthrough+{DISPATCHER}", arrivals=arr, requests=n,
                                                       model=model)) for label, model in SINGLE.items()]
        out += [Cell(c.system, c.label, c.spec, c.config_changes, {**c.tags, **tags}) for c in group]
    return out


def pairs(cells: Sequence[Cell]) -> list[Pair]:
    figures = ("quality", "cost_mean", "e2e_mean")
    out = []
    for load in dict.fromkeys(c.tags["load"] for c in cells):
        def rb(label, load=load):
            return {"system": "routebalance", "label": label, "load": load}

        def single(label, load=load):
            return {"system": "single_model", "label": label, "load": load}

        out += [Pair(f"quality preset vs always 72B @{load:g}", rb("quality"), single("always 72B"), figures),
                Pair(f"quality preset vs always 14B @{load:g}", rb("quality"), single("always 14B"), figures),
                Pair(f"cost preset vs always 7B @{load:g}", rb("cost"), single("always 7B"), figures),
                Pair(f"quality preset vs Avengers-Pro @{load:g}", rb("quality"),
                     {"system": "avengers", "load": load}, figures),
                Pair(f"quality preset vs BEST-Route @{load:g}", rb("quality"),
                     {"system": "best_route", "load": load}, figures),
                Pair(f"uniform vs passthrough shortest_queue @{load:g}", rb("uniform"),
                     {"system": "passthrough", "label": DISPATCHER, "load": load}, figures)]
    return out
