"""Cells whose prompts share prefixes: the pool's capacity on them, and the sweeps that compare prefix modes.

Rates are shares of the pool's capacity on the prompts of the cell: served
requests per second when far more arrives than is served, measured once per
source (and scale, and number of requests) with the engines caching and a
dispatcher that ignores the cache (shortest queue, the gateway's prefix
index off), and kept in `<models_dir>/sim/`. Every prefix mode of a sweep
runs at the same arrival rate, so they compare at equal offered load.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from gateway.lab.experiments.sweeps import Cell, run_seeded
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.prefixed_cells import PrefixSource
from gateway.lab.sim.simulator import CellSpec
from gateway.policies.prefix import within_model

PROBE_RATE = 400.0  # req/s offered when measuring capacity: far above what the pool serves on these prompts
PROBE_DISPATCHER = "passthrough+shortest_queue"


def probe_cell(source: PrefixSource, n: int) -> Cell:
    return Cell("passthrough", "capacity probe", CellSpec(PROBE_DISPATCHER, arrivals=ArrivalSpec(rate=PROBE_RATE),
                                                          requests=n, prefixed=source, prefix_cache="off"))


def capacity(config_path: str, source: PrefixSource, n: int) -> float:
    """The pool's capacity on `source`'s first n requests, req/s (measured on first use, then read back)."""
    from gateway.config.store import load_config

    cfg = load_config(config_path)
    path = Path(cfg.estimators.models_dir) / "sim" / "prefix-capacity.json"
    key = _key(cfg, source, n)
    known = json.loads(path.read_text()) if path.is_file() else {}
    if key not in known:
        row = run_seeded([probe_cell(source, n)], config_path, n).rows[0]
        known[key] = {"capacity": row["throughput"], "source": source.label(), "requests": n,
                      "dispatcher": PROBE_DISPATCHER, "offered": PROBE_RATE}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(known, indent=1))
    return float(known[key]["capacity"])


def _key(cfg, source: PrefixSource, n: int) -> str:
    """What the capacity depends on: the source, its scale or mix, how many requests, and the pool."""
    pool = json.dumps([(i.name, i.model, i.gpu, i.max_num_seqs, i.max_model_len, i.prefix_caching)
                       for i in cfg.instances])
    what = f"{source.kind}:{Path(source.path).name}:{source.scale}:{source.mix}:{n}:{pool}"
    return hashlib.sha256(what.encode()).hexdigest()[:16]


# ---- the sweep: RouteBalance with and without the cache term, against the cache-aware baselines -----------

LOADS = (0.3, 0.6, 0.9)
TRACE_REQUESTS = 2000  # the trace's first 2,000 rows (about 9 minutes of it); --requests changes it
PAIRED_FIGURES = ("ttft_mean", "ttft_p50", "ttft_p99", "e2e_p99", "quality", "cost_mean", "prefix_hit_rate")
RB = "routebalance"
RB_MODES = ("approximate", "events", "off")  # what the gateway knows of the engines' caches
BASELINES = ("cache_aware", "llmd", "session_affinity")  # each reads the approximate index
# Each baseline among the instances of the model RouteBalance names: the same model choice, so the same quality
# and cost as RouteBalance's, and only the placement among one model's instances differs.
WITHIN = tuple(entry.name for entry in within_model.ENTRIES)
COLD = "prefill priced cold"  # RouteBalance's prefill term with every prompt priced as if nothing were cached
END_TO_END_WEIGHT = 1.0  # [policies.routebalance] prefill_weight of the cell that prices end-to-end time alone
END_TO_END = f"prefill_weight={END_TO_END_WEIGHT:g}"
OWN_ONLY_WEIGHT = 0.0  # prefill_running_weight of the cell whose instances are ranked by the request's own latency
OWN_ONLY = f"prefill_running_weight={OWN_ONLY_WEIGHT:g}"
WIDE_TIES_TOLERANCE = 3.0  # tie_tolerance of the cell whose tier-mates tie within three times the heads' error
WIDE_TIES = f"tie_tolerance={WIDE_TIES_TOLERANCE:g}"


def sources(n: int) -> list[tuple[PrefixSource, int]]:
    """The sweep's prompt sources and how many requests each replays: the trace's first rows, and as many of
    the synthetic multi-turn mix."""
    return [(PrefixSource("trace"), n), (PrefixSource("synthetic"), n)]


def cells(n: int, capacities: dict[str, float], loads=LOADS) -> list[Cell]:
    """`capacities`: the pool's capacity on each source (its label), req/s."""
    out = []
    for source, requests in sources(n):
        for load in loads:
            rate = round(load * capacities[source.label()], 3)
            arr = ArrivalSpec(rate=rate)
            tags = {"prompts": source.label(), "load": load}
            for mode in RB_MODES:
                spec = CellSpec(RB, requests=requests, arrivals=arr, prefixed=source, prefix_cache=mode)
                out.append(Cell(RB, f"prefix_cache={mode}", spec, tags=tags))
            # The ablation: the prefill's load priced, the caches not looked at (every prompt priced cold).
            spec = CellSpec(RB, requests=requests, arrivals=arr, prefixed=source, prefix_cache="approximate")
            out.append(Cell(RB, COLD, spec, config_changes=(("routebalance", {"prefill_term": "cold"}),),
                            tags=tags))
            # The request's own prefill counted once: its end-to-end time alone, as Eq. 1 prices latency (the
            # default weighs its time to first token too).
            out.append(Cell(RB, END_TO_END, spec, config_changes=(
                ("routebalance", {"prefill_weight": END_TO_END_WEIGHT}),), tags=tags))
            # A model's instances ranked by the request's own latency alone, without the hold its prefill has on
            # the requests running there: what that hold adds to spreading a tier's load.
            out.append(Cell(RB, OWN_ONLY, spec, config_changes=(
                ("routebalance", {"prefill_running_weight": OWN_ONLY_WEIGHT}),), tags=tags))
            # A tier's instances tie within three times the heads' error: more of a prompt's turns stay where
            # it is cached, where the heads tell idle and lightly loaded instances apart.
            out.append(Cell(RB, WIDE_TIES, spec, config_changes=(
                ("routebalance", {"tie_tolerance": WIDE_TIES_TOLERANCE}),), tags=tags))
            for policy in (*BASELINES, *WITHIN):
                spec = CellSpec(policy, requests=requests, arrivals=arr, prefixed=source, prefix_cache="approximate")
                out.append(Cell(policy, policy, spec, tags=tags))
    return out


def pairs(cells_: list[Cell]) -> list:
    from gateway.lab.experiments.sweeps import Pair

    out = []
    for prompts, load in dict.fromkeys((c.tags["prompts"], c.tags["load"]) for c in cells_):
        where = {"prompts": prompts, "load": load}
        ours = {"system": RB, "label": "prefix_cache=approximate", **where}
        others = [("cache term off", {"system": RB, "label": "prefix_cache=off", **where}),
                  ("events", {"system": RB, "label": "prefix_cache=events", **where}),
                  ("the prefill priced cold", {"system": RB, "label": COLD, **where})]
        others += [(p, {"system": p, **where}) for p in (*BASELINES, *WITHIN)]
        out += [Pair(f"{prompts} at {load:g}: routebalance vs {name}", ours, side, PAIRED_FIGURES, relative=True,
                     at=where) for name, side in others]
        for variant in (END_TO_END, OWN_ONLY, WIDE_TIES):
            cell = {"system": RB, "label": variant, **where}
            out += [Pair(f"{prompts} at {load:g}: {variant} vs {name}", cell, side, PAIRED_FIGURES,
                         relative=True, at=where) for name, side in [("routebalance", ours), *others]
                    if name not in ("events", "the prefill priced cold", *WITHIN)]
    return out


def capacities(config_path: str, n: int) -> dict[str, float]:
    return {source.label(): capacity(config_path, source, requests) for source, requests in sources(n)}
