"""Every named sweep of `routebalance sim --sweep NAME`: its cells and its paired comparisons."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from gateway.lab.experiments import (
    avengers_labelled,
    best_route_labelled,
    eldr_eval,
    labelled_sweep,
    prefix_sweeps,
    progressive_eval,
    qos_eval,
    slo_sweeps,
    sweeps,
)
from gateway.lab.experiments.sweeps import Cell, Pair

SWEEPS: dict[str, Callable[[int], list[Cell]]] = {
    "frontier": sweeps.frontier, "arms": sweeps.arms, "budget": sweeps.budget, "batching": sweeps.batching,
    "robustness": sweeps.robustness, "qlm": slo_sweeps.qlm, "qlm_cap": slo_sweeps.qlm_cap,
    "qlm_multi": slo_sweeps.qlm_multi, "qos": qos_eval.qos_cells, "staleness": sweeps.staleness,
    "eldr": eldr_eval.eldr_cells, "progressive": progressive_eval.progressive_cells,
    "qlm_trace": slo_sweeps.qlm_trace, "qlm_heads": slo_sweeps.qlm_heads, "qos_trace": qos_eval.qos_trace,
    "qos_fair": qos_eval.qos_fair, "qos_fair_trace": qos_eval.qos_fair_trace,
    "qlm_multi_trace": slo_sweeps.qlm_multi_trace,
    "best_route": sweeps.best_route_cells}
PAIRS: dict[str, Callable[[Sequence[Cell]], list[Pair]]] = {
    "frontier": sweeps.frontier_pairs, "arms": sweeps.arms_pairs, "budget": sweeps.budget_pairs,
    "batching": sweeps.batching_pairs, "robustness": sweeps.robustness_pairs, "qlm": slo_sweeps.qlm_pairs,
    "qlm_cap": slo_sweeps.qlm_cap_pairs, "qlm_multi": slo_sweeps.qlm_multi_pairs, "qos": qos_eval.qos_pairs,
    "staleness": sweeps.staleness_pairs, "eldr": eldr_eval.eldr_pairs,
    "progressive": progressive_eval.progressive_pairs, "qlm_trace": slo_sweeps.qlm_pairs,
    "qlm_heads": slo_sweeps.qlm_heads_pairs,
    "qos_trace": qos_eval.qos_pairs, "qos_fair": qos_eval.fair_pairs,
    "qos_fair_trace": qos_eval.fair_pairs, "qlm_multi_trace": slo_sweeps.qlm_multi_pairs,
    "best_route": sweeps.best_route_pairs}
# Held-out prompts per cell when `--requests` is not given (the others: 2500).
REQUESTS: dict[str, int] = {"staleness": sweeps.STALENESS_REQUESTS, "progressive": progressive_eval.REQUESTS}

# Sweeps on a labelled file (`--workload`), whose rates are shares of the pool's capacity on that file: the
# cells at a measured capacity, their pairs, and the cell that measures it.
ON_CAPACITY: dict[str, tuple[Callable[[int, float], list[Cell]], Callable[[Sequence[Cell]], list[Pair]],
                             Callable[[int], Cell]]] = {
    "labelled": (labelled_sweep.cells, labelled_sweep.pairs, labelled_sweep.capacity_cell),
    "best_route_labelled": (best_route_labelled.cells, best_route_labelled.pairs, labelled_sweep.capacity_cell),
    "avengers_labelled": (avengers_labelled.cells, avengers_labelled.pairs, labelled_sweep.capacity_cell)}
# Sweeps on prompts that share prefixes: their rates are shares of the pool's capacity on each source.
PREFIX_SWEEPS = {"prefix": (prefix_sweeps.cells, prefix_sweeps.pairs, prefix_sweeps.capacities)}
REQUESTS["prefix"] = prefix_sweeps.TRACE_REQUESTS
REQUESTS["labelled"] = labelled_sweep.REQUESTS
REQUESTS["best_route_labelled"] = best_route_labelled.REQUESTS
REQUESTS["avengers_labelled"] = avengers_labelled.REQUESTS
