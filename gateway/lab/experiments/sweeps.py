"""The evaluation sweeps: named sets of cells, each run on several arrival seeds in worker processes,
written as CSV and JSON with 95% intervals, and paired comparisons of chosen cells.

    routebalance sim --sweep frontier          # paper Fig. 2: RouteBalance's weights vs every baseline
    routebalance sim --sweep arms              # paper section 6.3: the four isolation arms
    routebalance sim --sweep budget            # paper Table 8: budget-constrained mixes, filter on and off
    routebalance sim --sweep batching          # paper Fig. 4: LPT, adaptive windows, fixed batch sizes
    routebalance sim --sweep robustness        # tier loss, gamma-bursty and square-wave arrivals
    routebalance sim --sweep staleness         # scale-out: replicas that see each other's dispatches late

(gateway/lab/experiments/catalog.py names every sweep, these and the SLO-aware policies' own.)

A cell is (system, knobs, arrival process). Every cell runs on seeds
0..S-1: the seed changes the arrival times and which requests carry a
budget, never the prompts, and every cell of a sweep replays the same prompts
on the same seeds. The policies' own random choices (tie-breaks, random
dispatch, k-means) keep their config seeds, so the intervals are over
arrivals and prompts, not over those. A cell's row holds
each figure's mean over its seeds and, for the headline figures, a 95%
bootstrap interval over seeds and requests (stats.py). Because two cells on
one seed see the same prompts at the same times, a declared pair of cells is
compared request by request: the paired interval of their difference leaves
out what they share, and is far narrower than the two cells' own intervals.
"""

from __future__ import annotations

import csv
import dataclasses
import heapq
import json
import logging
import multiprocessing
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.metrics import (
    HEADLINE,
    PAIRED,
    RequestArrays,
    mean_over_seeds,
    paired_differences,
    summarise,
    with_intervals,
)
from gateway.lab.sim.replicas import sharing_mode
from gateway.lab.sim.simulator import CellSpec, run_cell, with_batching

log = logging.getLogger(__name__)

RATES = (6, 12, 18, 24, 30)  # the load curve (and the arms)
FULL_RATES = (12, 30)  # the frontier's every system: the paper's light load and its heaviest
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
AVENGERS_WEIGHTS = (0.25, 0.39, 0.53, 0.70, 0.80)  # performance weight p_w
BEST_ROUTE_THRESHOLDS = (0.0, 0.3, 0.5, 0.6, 0.7, 0.8)  # highest tolerated probability of a cheaper model falling short
HEADLINE_PW, HEADLINE_THRESHOLD = 0.53, 0.5  # the baselines' cells on the load curve
DISPATCHERS = ("round_robin", "shortest_queue")
BUDGET_SHARES = (0.75, 0.45, 0.30)
BIGGEST = "Qwen/Qwen2.5-72B-Instruct"


@dataclass(frozen=True)
class Cell:
    """One cell of a sweep: what to run, and the labels it is reported under."""

    system: str  # family shown in plots: routebalance, avengers, best_route, passthrough, single_model
    label: str  # e.g. "uniform", "p_w=0.53+round_robin"
    spec: CellSpec
    config_changes: tuple = ()  # ("batching", "progressive" or a policy table, {field: value}) applied to the config
    tags: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Pair:
    """A paired comparison, cell A minus cell B, on the same seeds, prompts and arrivals.

    Each side names row fields its cell has (`system`, `label`, `rate`,
    `arrivals`, `down`, a tag); a tuple value means any of those. A side that
    matches several cells is the one of highest mean quality, e.g. "the best
    BEST-Route cell" (chosen on the same runs, so that side is a little
    optimistic).
    """

    name: str
    a: dict
    b: dict
    figures: tuple[str, ...] = PAIRED  # what is compared (metrics.request_figures' names)
    relative: bool = False  # A's figure over B's, minus 1, too (`<figure>_rel`, with its paired interval)
    at: dict = field(default_factory=dict)  # columns written into the pair's row, e.g. where A sits on a plot


# ---- the cells -------------------------------------------------------------------------------

def _rb(label: str, weights, rate: float, n: int, arrivals: ArrivalSpec | None = None, **spec_kw) -> Cell:
    arr = arrivals or ArrivalSpec(rate=rate)
    return Cell("routebalance", label, CellSpec("routebalance", tuple(weights), arr, n, **spec_kw))


def _passthrough(dispatcher: str, arr: ArrivalSpec, n: int, **spec_kw) -> Cell:
    return Cell("passthrough", dispatcher, CellSpec(f"passthrough+{dispatcher}", arrivals=arr, requests=n, **spec_kw))


def _avengers(pw: float, dispatcher: str, arr: ArrivalSpec, n: int) -> Cell:
    return Cell("avengers", f"p_w={pw}+{dispatcher}", CellSpec(f"avengers+{dispatcher}", arrivals=arr, requests=n),
                (("avengers", {"performance_weight": pw}),))


def _best_route(threshold: float, dispatcher: str, arr: ArrivalSpec, n: int, serial: bool = False,
                **spec_kw) -> Cell:
    scoring = "serial" if serial else "concurrent"
    label = f"t={threshold}{' serial' if serial else ''}+{dispatcher}"
    return Cell("best_route", label, CellSpec(f"best_route+{dispatcher}", arrivals=arr, requests=n, **spec_kw),
                (("best_route", {"threshold": threshold, "scoring": scoring}),))


def _always_72b(arr: ArrivalSpec, n: int) -> Cell:
    # The quality-only reference of the paper: every request to the best model on average.
    return Cell("single_model", "always 72B", CellSpec("passthrough+shortest_queue", arrivals=arr, requests=n,
                                                       model=BIGGEST))


def _every_system(rate: float, n: int) -> list[Cell]:
    arr = ArrivalSpec(rate=rate)
    cells = [_rb(label, w, rate, n) for label, w in RB_WEIGHTS.items()]
    cells += [_passthrough(d, arr, n) for d in ("round_robin", "shortest_queue", "random")]
    cells += [_avengers(pw, d, arr, n) for pw in AVENGERS_WEIGHTS for d in DISPATCHERS]
    cells += [_best_route(t, d, arr, n) for t in BEST_ROUTE_THRESHOLDS for d in DISPATCHERS]
    return [*cells, _always_72b(arr, n)]


def _headline(rate: float, n: int) -> list[Cell]:
    """The cells of the load curve: the presets against each baseline at its paper setting."""
    arr = ArrivalSpec(rate=rate)
    return [*(_rb(label, RB_WEIGHTS[label], rate, n) for label in ("uniform", "quality", "cost")),
            _passthrough("round_robin", arr, n), _always_72b(arr, n),
            _best_route(HEADLINE_THRESHOLD, "round_robin", arr, n),
            _best_route(HEADLINE_THRESHOLD, "round_robin", arr, n, serial=True),
            _avengers(HEADLINE_PW, "round_robin", arr, n)]


def frontier(n: int, rates: Sequence[float] = FULL_RATES, curve: Sequence[float] = RATES) -> list[Cell]:
    """Every system at `rates`; the headline cells (the load curve) at every rate of `curve` too."""
    cells: dict[tuple, Cell] = {}
    for rate in sorted({*rates, *curve}):
        every = _every_system(rate, n) if rate in rates else []
        for cell in every + (_headline(rate, n) if rate in curve else []):
            cells.setdefault((cell.system, cell.label, rate), cell)
    return list(cells.values())


def frontier_pairs(cells: Sequence[Cell]) -> list[Pair]:
    rates = sorted({c.spec.arrivals.rate for c in cells})
    full = sorted({c.spec.arrivals.rate for c in cells if c.system == "passthrough" and c.label == "random"})
    concurrent = tuple(c.label for c in cells if c.system == "best_route" and "serial" not in c.label)
    br = f"t={HEADLINE_THRESHOLD}+round_robin"
    pairs = []
    for rate in full:
        def rb(label, rate=rate):
            return {"system": "routebalance", "label": label, "rate": rate}

        pairs += [_quality_vs_best_route(rate, concurrent),
                  Pair(f"quality preset vs best Avengers-Pro @{rate:g}", rb("quality"),
                       {"system": "avengers", "rate": rate}),
                  Pair(f"quality preset vs always 72B @{rate:g}", rb("quality"),
                       {"system": "single_model", "rate": rate}),
                  Pair(f"uniform vs passthrough round_robin @{rate:g}", rb("uniform"),
                       {"system": "passthrough", "label": "round_robin", "rate": rate})]
    for rate in rates:
        pairs += [Pair(f"uniform vs BEST-Route {br} @{rate:g}",
                       {"system": "routebalance", "label": "uniform", "rate": rate},
                       {"system": "best_route", "label": br, "rate": rate}),
                  _serial_vs_concurrent(rate)]
    return pairs


def _quality_vs_best_route(rate: float, concurrent: tuple[str, ...]) -> Pair:
    """The quality preset against the best of BEST-Route's concurrent cells (`concurrent`: their labels)."""
    return Pair(f"quality preset vs best BEST-Route @{rate:g}",
                {"system": "routebalance", "label": "quality", "rate": rate},
                {"system": "best_route", "label": concurrent, "rate": rate})


def _serial_vs_concurrent(rate: float) -> Pair:
    """BEST-Route at the headline threshold with serial against concurrent scoring."""
    return Pair(f"BEST-Route t={HEADLINE_THRESHOLD}: serial vs concurrent scoring @{rate:g}",
                {"system": "best_route", "label": f"t={HEADLINE_THRESHOLD} serial+round_robin", "rate": rate},
                {"system": "best_route", "label": f"t={HEADLINE_THRESHOLD}+round_robin", "rate": rate})


# The rates the paper's BEST-Route comparisons quote: 12 (the quality ceiling) and 24-30 (the load gap).
BEST_ROUTE_CURVE = (12, 24, 30)


def best_route_cells(n: int, rates: Sequence[float] = FULL_RATES,
                     curve: Sequence[float] = BEST_ROUTE_CURVE) -> list[Cell]:
    """The frontier's BEST-Route cells and the RouteBalance cells they are compared with (the quality preset at
    `rates`, uniform at every rate of `curve`), to rerun on their own when BEST-Route changes. Round-robin
    dispatch only: shortest-queue routes the same (the router picks the model) and its frontier cells are
    within 1% of round robin's E2E."""
    keep = {("quality", r) for r in rates} | {("uniform", r) for r in curve}
    return [c for c in frontier(n, rates, curve)
            if (c.system == "best_route" and not c.label.endswith("+shortest_queue"))
            or (c.system == "routebalance" and (c.label, c.spec.arrivals.rate) in keep)]


def best_route_pairs(cells: Sequence[Cell]) -> list[Pair]:
    """frontier_pairs' comparisons with BEST-Route, on best_route_cells (which has no passthrough cells)."""
    quality_rates = sorted({c.spec.arrivals.rate for c in cells if c.label == "quality"})
    concurrent = tuple(c.label for c in cells if c.system == "best_route" and "serial" not in c.label)
    br = f"t={HEADLINE_THRESHOLD}+round_robin"
    pairs = [_quality_vs_best_route(rate, concurrent) for rate in quality_rates]
    for rate in sorted({c.spec.arrivals.rate for c in cells}):
        pairs += [Pair(f"BEST-Route {br} vs uniform @{rate:g}",  # relative: how many times uniform's E2E, minus 1
                       {"system": "best_route", "label": br, "rate": rate},
                       {"system": "routebalance", "label": "uniform", "rate": rate}, relative=True),
                  _serial_vs_concurrent(rate)]
    return pairs


ARMS = (
    ("1 full objective", {"latency_term": "heads"}),
    ("2 w_lat=0, shortest-queue tie-break", {"latency_term": "off", "tiebreak": "shortest_queue"}),
    ("3 w_lat=0, predicted-latency tie-break", {"latency_term": "off", "tiebreak": "predicted"}),
    ("4 static per-tier prior", {"latency_term": "prior"}),
)


def arms(n: int, rates: Sequence[float] = RATES) -> list[Cell]:
    """Paper section 6.3 at uniform weights: what pricing latency at selection time buys."""
    uniform = RB_WEIGHTS["uniform"]
    return [Cell("routebalance", label, CellSpec("routebalance", uniform, ArrivalSpec(rate=rate), n),
                 (("routebalance", changes),)) for rate in rates for label, changes in ARMS]


def arms_pairs(cells: Sequence[Cell]) -> list[Pair]:
    full = ARMS[0][0]
    return [Pair(f"arm 1 vs arm {other[0]} @{rate:g}", {"label": full, "rate": rate}, {"label": other, "rate": rate})
            for rate in sorted({c.spec.arrivals.rate for c in cells}) for other, _ in ARMS[1:3]]


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
        cells.append(Cell("best_route", "t=0.0+round_robin (no filter)",
                          CellSpec("best_route+round_robin", arrivals=arr, requests=n, budget_share=share),
                          (("best_route", {"threshold": 0.0}),), tags))
    return cells


def budget_pairs(cells: Sequence[Cell]) -> list[Pair]:
    return [Pair(f"filter on vs off, budget share {share:g}", {"label": "filter on", "budget_share": share},
                 {"label": "filter off", "budget_share": share})
            for share in dict.fromkeys(c.tags["budget_share"] for c in cells)]


# (label, [batching] changes, [policies.routebalance] changes); without rules, the config's adaptive ones.
BATCHING: tuple[tuple[str, dict, dict], ...] = (
    ("eager (default)", {"mode": "eager"}, {}),
    ("window, adaptive (paper)", {"mode": "window"}, {}),
    ("window, adaptive, LPT off", {"mode": "window"}, {"lpt": False}),
    ("fixed batch 1", {"mode": "window", "rules": ({"below": 1.01, "size": 1, "window_ms": 0},)}, {}),
    ("fixed batch 16, 100 ms (adaptive off)", {"mode": "window",
                                               "rules": ({"below": 1.01, "size": 16, "window_ms": 100},)}, {}),
    ("fixed batch 32", {"mode": "window", "rules": ({"below": 1.01, "size": 32, "window_ms": 200},)}, {}),
)


def batching(n: int, rates: Sequence[float] = (8, 16, 24)) -> list[Cell]:
    """Paper Fig. 4 at uniform weights: batch formation and LPT."""
    cells = []
    for rate in rates:
        for label, batch_changes, sched_changes in BATCHING:
            changes = (("batching", batch_changes),) + ((("routebalance", sched_changes),) if sched_changes else ())
            cells.append(Cell("routebalance", label, CellSpec("routebalance", RB_WEIGHTS["uniform"],
                                                              ArrivalSpec(rate=rate), n), changes))
    return cells


def batching_pairs(cells: Sequence[Cell]) -> list[Pair]:
    eager, window, no_lpt = (b[0] for b in BATCHING[:3])
    pairs = []
    for rate in sorted({c.spec.arrivals.rate for c in cells}):
        pairs += [Pair(f"eager vs window batching @{rate:g}", {"label": eager, "rate": rate},
                       {"label": window, "rate": rate}),
                  Pair(f"window batching: LPT on vs off @{rate:g}", {"label": window, "rate": rate},
                       {"label": no_lpt, "rate": rate})]
    return pairs


def robustness(n: int, rate: float = 18) -> list[Cell]:
    """Tier loss (both 72B instances down) and non-Poisson arrivals at the same mean rate."""
    cells = []
    for arr in _processes(rate):
        cells += [_rb(label, RB_WEIGHTS[label], rate, n, arrivals=arr) for label in ("uniform", "quality")]
        cells += [_best_route(HEADLINE_THRESHOLD, "round_robin", arr, n), _passthrough("round_robin", arr, n)]
    cells += [_rb(label, RB_WEIGHTS[label], rate, n, down=(BIGGEST,)) for label in ("uniform", "quality")]
    return [*cells, _passthrough("round_robin", ArrivalSpec(rate=rate), n, down=(BIGGEST,))]


def _processes(rate: float) -> tuple[ArrivalSpec, ...]:
    return (ArrivalSpec(rate=rate), ArrivalSpec("gamma", rate, shape=0.25),
            ArrivalSpec("square", rate, low_high=(1 / 3, 5 / 3), period_s=30.0))


def robustness_pairs(cells: Sequence[Cell]) -> list[Pair]:
    def rb(label: str, **at) -> dict:
        return {"system": "routebalance", "label": label, **at}

    pairs = []
    for arrivals in dict.fromkeys(c.spec.arrivals.label() for c in cells if not c.spec.down):
        at = {"arrivals": arrivals, "down": ""}
        pairs += [Pair(f"uniform vs passthrough round_robin, {arrivals}", rb("uniform", **at),
                       {"system": "passthrough", **at}),
                  Pair(f"quality preset vs BEST-Route, {arrivals}", rb("quality", **at),
                       {"system": "best_route", **at})]
    return [*pairs, Pair("uniform vs passthrough round_robin, 72B down", rb("uniform", down=BIGGEST),
                         {"system": "passthrough", "down": BIGGEST})]


# ---- scale-out: replicas that share their accounting late (replicas.py) -------------------------------

# (workload, req/s, share of long prompts): the paper's workload at two loads, and one whose long prompts
# (3,000 prompt and 1,000 answer tokens, QLM's W_C) fill the instances' KV caches so that requests queue.
STALENESS_LOADS = (("paper", 12.0, 0.0), ("paper", 24.0, 0.0), ("10% long prompts", 12.0, 0.1))
STALENESS_REPLICAS = 3
STALENESS_MS = (0, 100, 250, 500, 1000, 2000, 4000, 8000)  # from one replica's publication to the others' read
SYNC_INTERVAL_S = 0.25  # [state].sync_interval_s's default
STALENESS_REQUESTS = 1200  # per cell: the sweep's 165 runs in a few minutes on two cores
ONE_REPLICA = "1 replica"
STALENESS_PAIRED = ("quality", "e2e_mean", "e2e_p90")


def staleness(n: int, loads: Sequence[tuple[str, float, float]] = STALENESS_LOADS,
              replicas: int = STALENESS_REPLICAS, delays_ms: Sequence[float] = STALENESS_MS,
              sync_s: float = SYNC_INTERVAL_S) -> list[Cell]:
    """RouteBalance (uniform) on `replicas` replicas behind a round-robin balancer, each publishing its share of
    the work every `sync_s` and reading the others' `delays_ms` late; against one replica (the reference),
    instant sharing (one ledger, no delay) and none at all (each replica sees its own dispatches only)."""
    cells = []
    for workload, rate, long_share in loads:
        def cell(label: str, r: int, sync: float, delay_ms: float | None, workload=workload, rate=rate,
                 long_share=long_share) -> Cell:
            spec = CellSpec("routebalance", RB_WEIGHTS["uniform"], ArrivalSpec(rate=rate), n, mega_share=long_share,
                            replicas=r, sync_interval_s=sync, staleness_s=(delay_ms or 0) / 1000)
            mode = sharing_mode(r, sync)
            return Cell("routebalance", label, spec, tags={
                "workload": workload, "replicas": r, "sharing": mode,
                "sync_ms": {"periodic": 1000 * sync, "instant": 0.0}.get(mode), "staleness_ms": delay_ms})

        cells.append(cell(ONE_REPLICA, 1, sync_s, None))
        cells.append(cell(f"{replicas} replicas, instant", replicas, 0.0, 0.0))
        cells += [cell(f"{replicas} replicas, {d:g} ms late", replicas, sync_s, float(d)) for d in delays_ms]
        cells.append(cell(f"{replicas} replicas, not shared", replicas, float("inf"), None))
    return cells


def staleness_pairs(cells: Sequence[Cell]) -> list[Pair]:
    """Every multi-replica cell against one replica on the same load, relative changes too."""
    pairs = []
    for c in cells:
        if c.spec.replicas > 1:
            at = {"workload": c.tags["workload"], "rate": c.spec.arrivals.rate}
            pairs.append(Pair(f"{c.label} vs one, {at['workload']} @{at['rate']:g}", {"label": c.label, **at},
                              {"label": ONE_REPLICA, **at}, STALENESS_PAIRED, relative=True,
                              at={k: c.tags[k] for k in ("workload", "sharing", "sync_ms", "staleness_ms")}))
    return pairs


# ---- what a sweep costs ------------------------------------------------------------------------

# CPU seconds per simulated request of one run (3,534-request cells at 6 to 30 req/s, this 2-core machine).
# RouteBalance charges its XGBoost TPOT heads per batch (6 to 14 s a cell); without them, and for the
# pipeline baselines, a cell is mostly the engine model (1.2 to 3.7 s).
# QLM and EDF plan their held requests as they go: about 5 s a cell of 2,500 under overload, EDF
# (a group per request) about twice that.
SECONDS_PER_REQUEST = {"heads": 9.0 / 3534, "plain": 2.0 / 3534, "qlm": 5.0 / 2500, "edf": 10.0 / 2500}
RUN_OVERHEAD_S = 0.15  # per run: the cell's config and policy (a baseline fits its router), the engines
INTERVALS_S = 0.7  # per cell, in the main process once the runs are in: the bootstrap of its figures
START_S = 20.0  # the workers load the estimators and the evaluation set


PROGRESSIVE_CALLS = 6  # simulated calls per request of a progressive cell, about (sweep "progressive")


def run_seconds(cell: Cell, requests: int) -> float:
    """Expected seconds of one run of the cell (on a core of its own)."""
    kind = cell.spec.policy if cell.spec.policy in SECONDS_PER_REQUEST else "heads" if _uses_heads(cell) else "plain"
    per_request = SECONDS_PER_REQUEST[kind]
    if cell.spec.progressive:  # a sketch and some ten expansions for each request that is not routed whole
        per_request *= PROGRESSIVE_CALLS
    return RUN_OVERHEAD_S + per_request * min(requests, cell.spec.requests)


def _uses_heads(cell: Cell) -> bool:
    """RouteBalance calls the TPOT heads unless an arm prices latency by the static prior, or not at all."""
    if cell.spec.policy != "routebalance":
        return False
    options = {k: v for section, values in cell.config_changes if section == "routebalance" for k, v in values.items()}
    term = options.get("latency_term", "heads")
    return term == "heads" or (term == "off" and options.get("tiebreak") == "predicted")


def estimate_seconds(cells: Sequence[Cell], requests: int, seeds: int, workers: int) -> float:
    """Expected wall time of a sweep: its runs, longest first, each on the first free worker; then the intervals."""
    free_at = [START_S] * max(workers, 1)
    for cost in sorted((run_seconds(c, requests) for c in cells for _ in range(seeds)), reverse=True):
        heapq.heappush(free_at, heapq.heappop(free_at) + cost)
    return max(free_at) + INTERVALS_S * len(cells)


# ---- running ------------------------------------------------------------------

_WORKER: dict = {}


def _load(config_path: str, requests: int, workload: str | None) -> None:
    """Per worker process: the config and the world a cell replays (crossfit_world.load_world), once."""
    from gateway.config.store import load_config
    from gateway.lab.experiments.crossfit_world import load_world

    cfg = load_config(config_path)
    _WORKER.update(cfg=cfg, world=load_world(cfg, requests, workload))  # run_seeded has built the estimators


def configured(cfg, changes) -> object:
    for section, values in changes:
        if section == "batching":
            if "rules" in values:
                from gateway.config.sections import BatchRule

                values = {**values, "rules": tuple(BatchRule(**r) for r in values["rules"])}
            cfg = with_batching(cfg, **values)
        elif section == "progressive":
            cfg = dataclasses.replace(cfg, progressive=dataclasses.replace(cfg.progressive, **values))
        else:  # a policy's own table
            cfg = cfg.with_options(section, **values)
    return cfg


def _identity(cell: Cell) -> dict:
    """The columns that say which cell a row is."""
    spec = cell.spec
    return {"system": cell.system, "label": cell.label, "policy": spec.policy,
            "w_quality": round(spec.weights[0], 4), "w_latency": round(spec.weights[1], 4),
            "w_cost": round(spec.weights[2], 4), "rate": spec.arrivals.rate, "arrivals": spec.arrivals.label(),
            "down": ",".join(spec.down), **cell.tags}


def run_seed(task: tuple[Cell, int]) -> tuple[dict, RequestArrays]:
    """One run of a cell on one arrival seed: its row of figures and its per-request outcomes. A world of
    several parts (a labelled file's folds) runs each part on its own arrivals (seed x parts + part) and
    pools their requests."""
    cell, seed = task
    world = _WORKER["world"]
    share = -(-cell.spec.requests // len(world))  # a part's share of the cell's requests
    results = [_run_part(cell, evalset, est, seed if len(world) == 1 else seed * len(world) + k, share)
               for k, (evalset, est) in enumerate(world)]
    outcomes = tuple(o for r in results for o in r.outcomes)
    first = results[0]
    batches = [b for r in results for b in r.batches]
    row = {**_identity(cell), "seed": seed, **summarise(outcomes, first.models),
           "batch_mean": sum(batches) / max(len(batches), 1), "swaps": sum(r.swaps for r in results),
           "swap_s": sum(r.swap_s for r in results)}
    if len(results) > 1:  # the parts ran side by side in virtual time: as if one after the other
        row["throughput"] = row["served"] / sum(_span(r.outcomes) for r in results)
    if cell.spec.replicas > 1:
        row["info_age_s"] = float(np.mean([r.info_age_s for r in results]))
    experts = float(np.mean([r.experts_per_step for r in results]))
    if experts == experts:  # a mixture-of-experts pool
        row["experts_per_step"] = experts
    return row, RequestArrays.of(outcomes, first.models)


def _span(outcomes) -> float:
    """First arrival to last answer of a run (as summarise's throughput counts it)."""
    served = [o.finished for o in outcomes if o.instance >= 0]
    start = min(o.arrival for o in outcomes)
    return max(served) - start if served else 0.0


def _run_part(cell: Cell, evalset, est, seed: int, requests: int):
    cfg = _WORKER["cfg"]
    if "instances" in cell.tags:  # a cell on part of the pool (the QoS sweep's N-instance pools)
        from gateway.lab.sim.evalset import subset

        cfg, evalset = subset(cfg, evalset, cell.tags["instances"].split(","))
    if "pool" in cell.tags:  # a cell on a pool made for it (the QLM sweep's multi-model W_A, ELDR's MoE pool)
        from gateway.lab.sim.pools import named

        cfg, evalset = named(cell.tags["pool"])(cfg, evalset)
    # A prefix-sharing cell borrows the held-out prompts round and round (sim/prefixed_cells.py).
    spec = dataclasses.replace(cell.spec, seed=seed, requests=cell.spec.requests if cell.spec.prefixed
                               else min(requests, len(evalset)))
    return run_cell(configured(cfg, cell.config_changes), evalset, spec, est)


def run_one(cell: Cell) -> dict:
    """One run of a cell on its own spec's seed: its row."""
    row, _ = run_seed((cell, cell.spec.seed))
    del row["seed"]
    return row


@dataclass(frozen=True)
class SweepResult:
    rows: list[dict]  # one per cell: each figure's mean over the seeds, headline ones with _lo/_hi
    seed_rows: list[dict]  # one per cell and seed
    pairs: list[dict]  # one per declared pair: A, B, and A - B with paired intervals
    arrays: list[list[RequestArrays]] = field(default_factory=list)  # per cell, per seed: each request's outcome


def run_sweep(cells: list[Cell], config_path: str, requests: int, workers: int = 2,
              workload: str | None = None, seeds: int | Sequence[int] = 1) -> list[dict]:
    """Every cell on its seeds: one row per cell, in order (see run_seeded)."""
    return run_seeded(cells, config_path, requests, workers=workers, workload=workload, seeds=seeds).rows


def run_seeded(cells: list[Cell], config_path: str, requests: int, *, seeds: int | Sequence[int] = 1,
               workers: int = 2, workload: str | None = None, pairs: Sequence[Pair] = (),
               progress: Callable[[int, int, Cell, int], None] | None = None) -> SweepResult:
    """Every cell on every seed (`seeds`: how many, from 0, or which), and the declared pairs compared.

    The estimators are built if needed and the evaluation set is computed (and
    cached) in this process before the workers start. `progress(done, total,
    cell, seed)` hears of each finished run.
    """
    from gateway.config.store import load_config
    from gateway.lab.training.build import ensure_built

    seeds = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seeds:
        raise ValueError("at least one seed")
    ensure_built(load_config(config_path))
    _load(config_path, requests, workload)
    tasks = [(i, s) for i in range(len(cells)) for s in seeds]
    tasks.sort(key=lambda t: -run_seconds(cells[t[0]], requests))  # longest first: no long run left for the end
    runs: dict[tuple[int, int], tuple[dict, RequestArrays]] = {}
    for done, ((i, s), outcome) in enumerate(_run_all(cells, tasks, config_path, requests, workload, workers), 1):
        runs[i, s] = outcome
        if progress:
            progress(done, len(tasks), cells[i], s)
    seed_rows = [[runs[i, s][0] for s in seeds] for i in range(len(cells))]
    arrays = [[runs[i, s][1] for s in seeds] for i in range(len(cells))]
    rows = [_cell_row(rs, arrs) for rs, arrs in zip(seed_rows, arrays, strict=True)]
    return SweepResult(rows, [r for rs in seed_rows for r in rs], [compare(p, rows, arrays) for p in pairs], arrays)


def _run_all(cells, tasks, config_path, requests, workload, workers) -> Iterator[tuple[tuple[int, int], tuple]]:
    """(task, outcome) for every task, as the runs finish."""
    if workers <= 1:
        for i, s in tasks:
            yield (i, s), run_seed((cells[i], s))
        return
    ctx = multiprocessing.get_context("spawn")  # no fork: FAISS and XGBoost keep thread pools
    with ctx.Pool(workers, initializer=_load, initargs=(config_path, requests, workload)) as pool:
        yield from pool.imap_unordered(_run_task, [((i, s), cells[i]) for i, s in tasks], chunksize=1)


def _run_task(task: tuple[tuple[int, int], Cell]) -> tuple[tuple[int, int], tuple[dict, RequestArrays]]:
    (i, seed), cell = task
    return (i, seed), run_seed((cell, seed))


def _cell_row(seed_rows: list[dict], arrays: list[RequestArrays]) -> dict:
    merged = mean_over_seeds([{k: v for k, v in r.items() if k != "seed"} for r in seed_rows])
    identity = _identity_keys(merged)
    row = {**{k: merged[k] for k in identity}, "seeds": len(seed_rows), **{k: merged[k] for k in merged
                                                                           if k not in identity}}
    return with_intervals(row, seed_rows, arrays)


# ---- paired comparisons ----------------------------------------------------------------------

def _matches(row: dict, side: dict) -> bool:
    return all(row.get(k) in v if isinstance(v, tuple) else row.get(k) == v for k, v in side.items())


def _pick(pair: Pair, side: dict, rows: list[dict]) -> int:
    found = [i for i, r in enumerate(rows) if _matches(r, side)]
    if not found:
        raise ValueError(f"pair {pair.name!r}: no cell has {side}")
    return max(found, key=lambda i: rows[i]["quality"])  # several: the best of the family


def compare(pair: Pair, rows: list[dict], arrays: list[list[RequestArrays]]) -> dict:
    """The pair's row: its two cells (rows[i], arrays[i]) and A - B with paired intervals."""
    a, b = _pick(pair, pair.a, rows), _pick(pair, pair.b, rows)
    ra, rb = rows[a], rows[b]
    if (ra["rate"], ra["arrivals"]) != (rb["rate"], rb["arrivals"]):
        raise ValueError(f"pair {pair.name!r} compares cells with different arrivals: requests do not pair")
    out = {"pair": pair.name, "rate": ra["rate"], "arrivals": ra["arrivals"], "seeds": ra["seeds"],
           "a": f"{ra['system']} {ra['label']}", "b": f"{rb['system']} {rb['label']}", **pair.at}
    for name, diff in paired_differences(arrays[a], arrays[b], pair.figures).items():
        out |= {f"a_{name}": ra[name], f"b_{name}": rb[name], f"{name}_diff": diff.mean,
                f"{name}_diff_lo": diff.lo, f"{name}_diff_hi": diff.hi}
    if pair.relative:
        for name, rel in paired_differences(arrays[a], arrays[b], pair.figures, relative=True).items():
            out |= {f"{name}_rel": rel.mean, f"{name}_rel_lo": rel.lo, f"{name}_rel_hi": rel.hi}
    return out


# ---- writing ---------------------------------------------------------------------------------

def write_rows(rows: list[dict], out_dir: Path, name: str) -> tuple[Path, Path]:
    """NAME.json (rows as they are) and NAME.csv (the tier mix flattened to one column per model)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps(rows, indent=1, default=float))
    _write_csv(csv_path, [_flat_mix(r) for r in rows])
    return json_path, csv_path


def write_sweep(result: SweepResult, out_dir: Path, name: str) -> list[Path]:
    """NAME.{json,csv}, NAME_pairs.{json,csv} if pairs were compared, and NAME_seeds.csv (headline figures only)."""
    paths = list(write_rows(result.rows, out_dir, name))
    if result.pairs:
        pairs_json = out_dir / f"{name}_pairs.json"
        pairs_json.write_text(json.dumps(result.pairs, indent=1, default=float))
        paths += [pairs_json, _write_csv(out_dir / f"{name}_pairs.csv", result.pairs)]
    # Every row's identity columns (cells may carry different tags), in first-seen order; blank where a row has none.
    identity = list(dict.fromkeys(k for r in result.seed_rows for k in _identity_keys(r)))
    keep = [*identity, *(k for k in ("seed", *HEADLINE) if k in result.seed_rows[0] and k not in identity)]
    paths.append(_write_csv(out_dir / f"{name}_seeds.csv", [{k: r.get(k, "") for k in keep} for r in result.seed_rows]))
    return paths


def _identity_keys(row: dict) -> list[str]:
    """The identity columns of a row: everything before its first figure."""
    keys = list(row)
    return keys[:keys.index("requests")] if "requests" in keys else keys


def _flat_mix(row: dict) -> dict:
    flat = {k: v for k, v in row.items() if k != "mix"}
    return flat | {f"mix_{m.split('/')[-1]}": s for m, s in row.get("mix", {}).items()}


def _write_csv(path: Path, rows: list[dict]) -> Path:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        # Six significant digits: costs are ~1e-5 USD, so fixed decimals would erase them.
        writer.writerows({k: (float(f"{v:.6g}") if isinstance(v, float) else v) for k, v in r.items()} for r in rows)
    return path

