"""The evaluation sweeps: named sets of cells, run in worker processes, written as CSV and JSON.

    routebalance sim --sweep frontier          # paper Fig. 2: RouteBalance's weights vs every baseline
    routebalance sim --sweep arms              # paper section 6.3: the four isolation arms
    routebalance sim --sweep budget            # paper Table 8: budget-constrained mixes, filter on and off
    routebalance sim --sweep batching          # paper Fig. 4: LPT, adaptive windows, fixed batch sizes
    routebalance sim --sweep robustness        # tier loss, gamma-bursty and square-wave arrivals

A cell is (system, knobs, arrival process); every cell of a sweep replays
the same held-out prompts with the same arrival seed, so differences between
cells are the policies', not the samples'.
"""

from __future__ import annotations

import csv
import json
import logging
import multiprocessing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.sim.arrivals import ArrivalSpec
from gateway.sim.metrics import summarise
from gateway.sim.simulator import CellSpec, run_cell, with_batching

log = logging.getLogger(__name__)

RATES = (6, 12, 18, 24, 30)
# RouteBalance's weight tuples (quality, latency, cost): the four presets and a walk up the quality axis.
RB_WEIGHTS = {
    "cost": (0.1, 0.1, 0.8),
    "latency": (0.1, 0.8, 0.1),
    "uniform": (1 / 3, 1 / 3, 1 / 3),
    "q=0.5": (0.5, 0.25, 0.25),
    "q=0.65": (0.65, 0.175, 0.175),
    "quality": (0.8, 0.1, 0.1),
    "q=0.9": (0.9, 0.05, 0.05),
    "q=1": (1.0, 0.0, 0.0),
}
AVENGERS_WEIGHTS = (0.25, 0.53, 0.8)  # performance weight p_w
BEST_ROUTE_THRESHOLDS = (0.0, 0.02, 0.05)  # predicted-quality gap to the best model
BUDGET_SHARES = (0.75, 0.45, 0.30)
BIGGEST = "Qwen/Qwen2.5-72B-Instruct"


@dataclass(frozen=True)
class Cell:
    """One cell of a sweep: what to run, and the labels it is reported under."""

    system: str  # family shown in plots: routebalance, avengers, best_route, passthrough
    label: str  # e.g. "uniform", "p_w=0.53+round_robin"
    spec: CellSpec
    config_changes: tuple = ()  # ("batching" or a policy table, {field: value}) applied to the config for this cell
    tags: dict = field(default_factory=dict)


def _rb(label: str, weights, rate: float, n: int, arrivals: ArrivalSpec | None = None, **spec_kw) -> Cell:
    arr = arrivals or ArrivalSpec(rate=rate)
    return Cell("routebalance", label, CellSpec("routebalance", tuple(weights), arr, n, **spec_kw))


def _baselines(rate: float, n: int) -> list[Cell]:
    arr = ArrivalSpec(rate=rate)
    cells = [Cell("passthrough", d, CellSpec(f"passthrough+{d}", arrivals=arr, requests=n))
             for d in ("round_robin", "shortest_queue", "random")]
    for pw in AVENGERS_WEIGHTS:
        for d in ("round_robin", "shortest_queue"):
            cells.append(Cell("avengers", f"p_w={pw}+{d}", CellSpec(f"avengers+{d}", arrivals=arr, requests=n),
                              (("pipeline", {"avengers_performance_weight": pw}),)))
    for t in BEST_ROUTE_THRESHOLDS:
        for d in ("round_robin", "shortest_queue"):
            cells.append(Cell("best_route", f"t={t}+{d}", CellSpec(f"best_route+{d}", arrivals=arr, requests=n),
                              (("pipeline", {"best_route_threshold": t}),)))
    # The quality-only reference of the paper: every request to the best model on average.
    cells.append(Cell("single_model", "always 72B", CellSpec("passthrough+shortest_queue", arrivals=arr, requests=n,
                                                           model=BIGGEST)))
    return cells


def frontier(n: int, rates: Sequence[float] = RATES) -> list[Cell]:
    cells = []
    for rate in rates:
        cells += [_rb(label, w, rate, n) for label, w in RB_WEIGHTS.items()]
        cells += _baselines(rate, n)
    return cells


def arms(n: int, rates: Sequence[float] = RATES) -> list[Cell]:
    """Paper section 6.3 at uniform weights: what pricing latency at selection time buys."""
    uniform = RB_WEIGHTS["uniform"]
    variants = (
        ("1 full objective", {"latency_term": "heads"}),
        ("2 w_lat=0, shortest-queue tie-break", {"latency_term": "off", "tiebreak": "shortest_queue"}),
        ("3 w_lat=0, predicted-latency tie-break", {"latency_term": "off", "tiebreak": "predicted"}),
        ("4 static per-tier prior", {"latency_term": "prior"}),
    )
    return [Cell("routebalance", label, CellSpec("routebalance", uniform, ArrivalSpec(rate=rate), n),
                 (("routebalance", changes),)) for rate in rates for label, changes in variants]


def budget(n: int, rate: float = 16) -> list[Cell]:
    """Paper Table 8: a share of the prompts carries a budget; the admission filter on and off."""
    cells = []
    arr = ArrivalSpec(rate=rate)
    for share in BUDGET_SHARES:
        tags = {"budget_share": share}
        for on in (True, False):
            cells.append(Cell("routebalance", f"filter {'on' if on else 'off'}",
                              CellSpec("routebalance", RB_WEIGHTS["uniform"], arr, n, budget_share=share),
                              (("routebalance", {"budget_filter": on}),), tags))
        cells.append(Cell("best_route", "t=0.0+round_robin (argmax, no filter)",
                          CellSpec("best_route+round_robin", arrivals=arr, requests=n, budget_share=share),
                          (("pipeline", {"best_route_threshold": 0.0}),), tags))
    return cells


def batching(n: int, rates: Sequence[float] = (8, 16, 24)) -> list[Cell]:
    """Paper Fig. 4 at uniform weights: batch formation and LPT."""
    variants = (  # (label, [batching] changes, [policies.routebalance] changes); no rules: the config's adaptive ones
        ("eager (default)", {"mode": "eager"}, {}),
        ("window, adaptive (paper)", {"mode": "window"}, {}),
        ("window, adaptive, LPT off", {"mode": "window"}, {"lpt": False}),
        ("fixed batch 1", {"mode": "window", "rules": _fixed(1, 0)}, {}),
        ("fixed batch 16, 100 ms (adaptive off)", {"mode": "window", "rules": _fixed(16, 100)}, {}),
        ("fixed batch 32", {"mode": "window", "rules": _fixed(32, 200)}, {}),
    )
    cells = []
    for rate in rates:
        for label, batch_changes, sched_changes in variants:
            changes = (("batching", batch_changes),) + ((("routebalance", sched_changes),) if sched_changes else ())
            cells.append(Cell("routebalance", label, CellSpec("routebalance", RB_WEIGHTS["uniform"],
                                                              ArrivalSpec(rate=rate), n), changes))
    return cells


def _fixed(size: int, window_ms: float) -> tuple[dict, ...]:
    return ({"below": 1.01, "size": size, "window_ms": window_ms},)


def robustness(n: int, rate: float = 18) -> list[Cell]:
    """Tier loss (both 72B instances down) and non-Poisson arrivals at the same mean rate."""
    cells = []
    processes = (ArrivalSpec(rate=rate), ArrivalSpec("gamma", rate, shape=0.25),
                 ArrivalSpec("square", rate, low_high=(1 / 3, 5 / 3), period_s=30.0))
    for arr in processes:
        for label in ("uniform", "quality"):
            cells.append(_rb(label, RB_WEIGHTS[label], rate, n, arrivals=arr))
        cells.append(Cell("best_route", "t=0.02+shortest_queue", CellSpec("best_route+shortest_queue", arrivals=arr,
                                                                           requests=n),
                          (("pipeline", {"best_route_threshold": 0.02}),)))
        cells.append(Cell("passthrough", "round_robin", CellSpec("passthrough+round_robin", arrivals=arr, requests=n)))
    for label in ("uniform", "quality"):
        cells.append(_rb(label, RB_WEIGHTS[label], rate, n, down=(BIGGEST,)))
    cells.append(Cell("passthrough", "round_robin", CellSpec("passthrough+round_robin", arrivals=ArrivalSpec(rate=rate),
                                                             requests=n, down=(BIGGEST,))))
    return cells


SWEEPS = {"frontier": frontier, "arms": arms, "budget": budget, "batching": batching, "robustness": robustness}


# ---- running ------------------------------------------------------------------

_WORKER: dict = {}


def _load(config_path: str, requests: int, workload: str | None) -> None:
    """Per worker process: the config, the estimators and the evaluation set, once."""
    from gateway.config import load_config
    from gateway.estimators.bundle import Estimators
    from gateway.sim.evalset import load_evalset

    cfg = load_config(config_path)
    est = Estimators.load(cfg)  # run_sweep has built them
    _WORKER.update(cfg=cfg, est=est, evalset=load_evalset(cfg, requests, workload, est))


def configured(cfg, changes) -> object:
    for section, values in changes:
        if section == "batching":
            if "rules" in values:
                from gateway.config import BatchRule

                values = {**values, "rules": tuple(BatchRule(**r) for r in values["rules"])}
            cfg = with_batching(cfg, **values)
        else:  # a policy's own table
            cfg = cfg.with_options(section, **values)
    return cfg


def run_one(cell: Cell) -> dict:
    cfg, est = _WORKER["cfg"], _WORKER["est"]
    result = run_cell(configured(cfg, cell.config_changes), _WORKER["evalset"], cell.spec, est)
    row = summarise(result.outcomes, result.models)
    spec = cell.spec
    return {"system": cell.system, "label": cell.label, "policy": spec.policy,
            "w_quality": round(spec.weights[0], 4), "w_latency": round(spec.weights[1], 4),
            "w_cost": round(spec.weights[2], 4), "rate": spec.arrivals.rate, "arrivals": spec.arrivals.label(),
            "down": ",".join(spec.down), **cell.tags, **row,
            "batch_mean": sum(result.batches) / max(len(result.batches), 1)}


def run_sweep(cells: list[Cell], config_path: str, requests: int, workers: int = 2,
              workload: str | None = None) -> list[dict]:
    """Every cell, in order; the estimators are built if needed and the evaluation set is
    computed (and cached) in this process before the workers start."""
    from gateway.config import load_config
    from gateway.estimators.build import ensure_built

    ensure_built(load_config(config_path))
    _load(config_path, requests, workload)
    if workers <= 1:
        return [run_one(c) for c in cells]
    ctx = multiprocessing.get_context("spawn")  # no fork: FAISS and XGBoost keep thread pools
    with ctx.Pool(workers, initializer=_load, initargs=(config_path, requests, workload)) as pool:
        return pool.map(run_one, cells, chunksize=1)


def write_rows(rows: list[dict], out_dir: Path, name: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps(rows, indent=1, default=float))
    flat = [{**{k: v for k, v in r.items() if k != "mix"},
             **{f"mix_{m.split('/')[-1]}": round(s, 4) for m, s in r["mix"].items()}} for r in rows]
    keys = list(dict.fromkeys(k for r in flat for k in r))
    with csv_path.open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows({k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()} for r in flat)
    return json_path, csv_path
