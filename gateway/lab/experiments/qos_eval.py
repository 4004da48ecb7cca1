"""The QoS routing paper's comparison (papers/qos-aware-edge-routing.txt, section VI) as simulator cells.

`qos` and `qos-rl` against the paper's baselines on this pool: round robin
and shortest queue (`passthrough+<dispatcher>`), a quality-only router (the
paper's BERT router: RouteBalance at weights (1, 0, 0), which sends each
prompt to the model of best predicted quality), and RouteBalance's uniform
preset; on Poisson and gamma-bursty arrivals, several bounds L, and pools of
N = 3..12 instances.

Pools of N instances (`pool_names`): the paper's experts are several
models of similar size on similar GPUs; this pool has four tiers. A pool of
N takes one instance of each model in turn, in config order (72B, 14B, 7B,
3B, then 72B again, ...), skipping a model whose instances are all taken: N =
3 is one 72B, one 14B and one 7B; from N = 4 every tier is in, and the mix
approaches the full pool's as N grows. The cells carry the names, comma-joined, in
`tags["instances"]`, and the sweep runner runs them on `evalset.subset`'s config
and evaluation set of that pool (the evaluation set's per-instance columns
cut to match).

Arrival rates scale with N (`RATE_PER_INSTANCE` per instance), so each pool
is as loaded as the next and the smallest is not simply swamped; the paper
keeps lambda fixed while N grows (its Fig. 11), which `rate_for` can do too.

`qos_trace` (`routebalance sim --sweep qos_trace`): the N = 6 cells, every
bound, with the Azure LLM inference trace's arrivals (arrivals.py) at the
same rate as the Poisson and gamma cells.

`qos_fair` (`routebalance sim --sweep qos_fair`): the comparison the paper
makes, on its kind of pool and on ours. Its headline is over "Baseline RL"
(expert-level features, completed-QoS reward; gateway/lab/training/
qos_baseline.py), on similar experts; so: `qos`, `qos-rl` (the shipped actor,
cloned from `qos`), `qos-rl-scratch` (SAC from a random actor) and
`baseline-rl` beside the heuristic baselines, at N = 6 on the qos-similar
pool (six like 7B-class instances, lab/sim/pools.py; 24 req/s, where L
binds) and on the four-tier pool (9 req/s), at the paper's default L = 30
ms and the headline 50 ms. Baseline RL runs twice: as trained, the drop
action open, and trained and run with it masked (`baseline-rl-nodrop`). The
trained actors are read from FAIR_ACTORS (paths and options; `actors=` takes
others) and run in the `qos-rl` policy, whose ONNX loader they fit. Pool
kinds are tagged `pool_kind`. `qos_fair_trace` (`--sweep qos_fair_trace`): the same at the headline
L with the Azure trace's arrivals.

`bench_decisions` times a policy's decisions per request (the figure behind
its `compute_s`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from gateway.lab.experiments.sweeps import RB_WEIGHTS, Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import EvalSet
from gateway.lab.sim.pools import GAMMA_SHAPE, QOS_SIMILAR_ANSWERS, pool_names
from gateway.lab.sim.simulator import CellSpec

POOL_SIZES = (3, 6, 9, 12)
BOUNDS_MS = (30.0, 50.0, 80.0)  # L: below the 7B tier's lone TPOT (20.6 ms) x 1.5, above the 72B's (47.4 ms)
RATE_PER_INSTANCE = 1.5  # req/s per instance: the 13-instance pool at ~20 req/s, where the 72B tier queues
HEADLINE_N, HEADLINE_MS = 6, 50.0  # the paper's N = 6 and a bound the 72B tier meets only when lightly loaded
SYSTEMS = ("qos", "qos-rl", "round_robin", "shortest_queue", "quality_only", "uniform")
# The actors `qos_fair` runs beside the shipped one (written by `routebalance train-policy qos-rl --out ...`,
# docs/results/qos.md says with which budget).
# A system: its [policies.qos_rl] options. The no-drop Baseline RL was trained with the drop action masked,
# and runs so.
FAIR_ACTORS: dict[str, dict] = {
    "qos-rl-scratch": {"actor": "loadtest/results/qos_rl_scratch/actor.onnx"},
    "baseline-rl": {"actor": "loadtest/results/qos_baseline_rl/actor.onnx"},
    "baseline-rl-nodrop": {"actor": "loadtest/results/qos_baseline_rl_nodrop/actor.onnx", "drop": False}}
FAIR_SYSTEMS = ("qos", "qos-rl", "qos-rl-scratch", "baseline-rl", "baseline-rl-nodrop", "round_robin",
                "shortest_queue", "quality_only", "uniform")
FAIR_BOUNDS_MS = (30.0, 50.0)  # the paper's default L, and this study's headline
FAIR_POOLS = ("four tiers", "similar")
# Arrivals per instance: the four-tier pool's as in `qos_cells`; the like 7B-class experts take 4 req/s each
# before L = 30 ms binds (at 1.5, every system's time per token is ~23 ms and QoS is only quality).
FAIR_RATE_PER_INSTANCE = {"similar": 4.0, "four tiers": RATE_PER_INSTANCE}
LEARNED = ("qos", "qos-rl", *FAIR_ACTORS)
BASELINES_RL = ("baseline-rl", "baseline-rl-nodrop")


def rate_for(n: int, per_instance: float = RATE_PER_INSTANCE) -> float:
    return per_instance * n


def _cell(system: str, arrivals: ArrivalSpec, requests: int, bound_ms: float, names: tuple[str, ...],
          tags: dict | None = None, actors: dict[str, dict] | None = None) -> Cell:
    tags = tags or {"instances": ",".join(names), "n": len(names), "tpot_slo_ms": bound_ms}
    common: dict[str, Any] = dict(arrivals=arrivals, requests=requests, tpot_slo_s=bound_ms / 1000)
    if system in ("qos", "qos-rl"):
        return Cell(system, system, CellSpec(system, **common), tags=tags)
    if actors and system in actors:  # another actor in the qos-rl policy
        return Cell(system, system, CellSpec("qos-rl", **common), (("qos_rl", actors[system]),),
                    tags={**tags, "actor": actors[system]["actor"]})
    if system in ("round_robin", "shortest_queue"):
        return Cell("passthrough", system, CellSpec(f"passthrough+{system}", **common), tags=tags)
    weights = RB_WEIGHTS["q=1" if system == "quality_only" else "uniform"]
    label = "quality only (1, 0, 0)" if system == "quality_only" else "uniform"
    return Cell("routebalance", label, CellSpec("routebalance", weights, **common), tags=tags)


def qos_cells(requests: int, cfg=None, sizes: Sequence[int] = POOL_SIZES, bounds_ms: Sequence[float] = BOUNDS_MS,
              systems: Sequence[str] = SYSTEMS, kinds: Sequence[str] = ("poisson", "gamma")) -> list[Cell]:
    """Every system at every N (at the headline bound) and every bound (at the headline N), on arrivals of
    each of `kinds` (gamma's shape GAMMA_SHAPE) at RATE_PER_INSTANCE x N. `cfg`: whose instances the pools
    are drawn from (default: the packaged config's 13)."""
    if cfg is None:
        from gateway.config.store import default_config_path, load_config

        cfg = load_config(default_config_path())
    cells = []
    settings = {(n, HEADLINE_MS) for n in sizes} | {(HEADLINE_N, b) for b in bounds_ms}
    for n, bound in sorted(settings):
        names = pool_names(cfg.instances, n)
        for kind in kinds:
            arr = ArrivalSpec(kind, rate_for(n), shape=GAMMA_SHAPE)
            cells += [_cell(s, arr, requests, bound, names) for s in systems]
    return cells


def qos_trace(requests: int) -> list[Cell]:
    return qos_cells(requests, sizes=(HEADLINE_N,), kinds=("azure",))


def qos_fair(requests: int, cfg=None, actors: dict[str, dict] | None = None,
             bounds_ms: Sequence[float] = FAIR_BOUNDS_MS, systems: Sequence[str] = FAIR_SYSTEMS,
             pools: Sequence[str] = FAIR_POOLS, kind: str = "poisson") -> list[Cell]:
    """Every system on the qos-similar pool and on the four-tier pool of HEADLINE_N, arrivals of `kind` at
    FAIR_RATE_PER_INSTANCE x N, at each bound (module docstring)."""
    if cfg is None:
        from gateway.config.store import default_config_path, load_config

        cfg = load_config(default_config_path())
    actors = FAIR_ACTORS if actors is None else actors
    names = pool_names(cfg.instances, HEADLINE_N)
    similar_sources = [next(i.name for i in cfg.instances if i.model == m) for m in dict.fromkeys(QOS_SIMILAR_ANSWERS)]
    cells = []
    for pool in pools:
        arr = ArrivalSpec(kind, rate_for(HEADLINE_N, FAIR_RATE_PER_INSTANCE[pool]))
        for bound in bounds_ms:
            # Every cell carries `instances` (write_sweep's per-seed file takes the first row's columns): a
            # similar-pool cell names the instances whose answers its experts give, which hold the columns
            # qos_similar reads, before its `pool` replaces them.
            place = ({"instances": ",".join(similar_sources), "pool": "qos-similar"} if pool == "similar"
                     else {"instances": ",".join(names)})
            tags = {**place, "pool_kind": pool, "n": HEADLINE_N, "tpot_slo_ms": bound}
            cells += [_cell(s, arr, requests, bound, names, tags, actors) for s in systems]
    return cells


def qos_fair_trace(requests: int) -> list[Cell]:
    """The fair comparison at the headline bound with the Azure trace's arrivals."""
    return qos_fair(requests, bounds_ms=(HEADLINE_MS,), kind="azure")


def fair_pairs(cells: Sequence[Cell]) -> list[Pair]:
    """Per pool and bound: each QoS policy against Baseline RL (relative too, as the paper reports it) and
    against every heuristic baseline; the two qos-rl actors against the heuristic they are measured by."""
    settings = dict.fromkeys((c.tags["pool_kind"], c.tags["tpot_slo_ms"]) for c in cells)
    present = {c.system if c.system in LEARNED else c.label for c in cells}
    pairs = []
    for pool, bound in settings:
        at = {"pool_kind": pool, "tpot_slo_ms": bound}

        def side(name: str, at: dict = at) -> dict:
            return {"system" if name in LEARNED else "label": name, **at}

        where = f"{pool}, L={bound:g} ms"
        for mine in ("qos", "qos-rl", "qos-rl-scratch"):
            if mine not in present:
                continue
            for other in (*BASELINES_RL, "round_robin", "shortest_queue", "quality only (1, 0, 0)", "uniform"):
                if other in present:
                    pairs.append(Pair(f"{mine} vs {other}, {where}", side(mine), side(other), ("qos", "quality"),
                                      relative=other in BASELINES_RL))
        for mine in ("qos-rl", "qos-rl-scratch"):
            if mine in present and "qos" in present:
                pairs.append(Pair(f"{mine} vs qos, {where}", side(mine), side("qos"), ("qos", "quality")))
        for base in BASELINES_RL:
            if base in present and "shortest_queue" in present:
                pairs.append(Pair(f"{base} vs shortest_queue, {where}", side(base), side("shortest_queue"),
                                  ("qos", "quality")))
    return pairs


def qos_pairs(cells: Sequence[Cell]) -> list[Pair]:
    """qos and qos-rl against each baseline, and against each other, per setting (QoS paired request by request)."""
    settings = dict.fromkeys((c.tags["n"], c.tags["tpot_slo_ms"], c.spec.arrivals.label()) for c in cells)
    labels = {c.system if c.system in ("qos", "qos-rl") else c.label: c for c in cells}
    pairs = []
    for n, bound, arrivals in settings:
        at = {"n": n, "tpot_slo_ms": bound, "arrivals": arrivals}
        for mine in ("qos", "qos-rl"):
            if mine not in labels:
                continue
            for other in ("round_robin", "shortest_queue", "quality only (1, 0, 0)", "uniform"):
                if other in labels:
                    pairs.append(Pair(f"{mine} vs {other}, N={n}, L={bound:g} ms, {arrivals}",
                                      {"system": mine, **at}, {"label": other, **at}, ("qos", "quality")))
        if "qos" in labels and "qos-rl" in labels:
            pairs.append(Pair(f"qos-rl vs qos, N={n}, L={bound:g} ms, {arrivals}", {"system": "qos-rl", **at},
                              {"system": "qos", **at}, ("qos", "quality")))
    return pairs


def bench_decisions(policy, cfg, evalset: EvalSet, tracked: int = 60, batches: int = 200, batch_size: int = 1,
                    seed: int = 0) -> dict:
    """Seconds per request of `policy.assign` with `tracked` requests of its own in flight over the pool
    (the hooks' state a busy pool gives it), on real estimates: {"per_request_s", "p99_s", ...}."""
    from gateway.core.pool_state import PoolState
    from gateway.core.request import Completion, DispatchPlan, Estimates, RouteRequest, Ticket

    everyone = tuple(range(len(cfg.instances)))
    rng = np.random.default_rng(seed)
    rows = rng.integers(0, len(evalset), batches * batch_size + tracked)

    def request(r: int) -> RouteRequest:
        return RouteRequest(everyone, evalset.prompts[r], int(evalset.prompt_tokens[r]), 1024, RB_WEIGHTS["uniform"],
                            policy=policy.name, tpot_slo_s=HEADLINE_MS / 1000)

    def estimates(rs) -> Estimates:
        return Estimates(evalset.quality[rs], evalset.length[rs], evalset.embeddings[rs])

    pool_state = PoolState()
    view = pool_state.snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
    warm = [request(int(r)) for r in rows[:tracked]]
    for k, (req, d) in enumerate(zip(warm, policy.assign(warm, estimates(rows[:tracked]), view), strict=True)):
        if d.ranked:  # in flight and streaming: dispatched, half its answer back
            ticket = Ticket(req, "", True, cfg, arrived=0.0)
            policy.on_dispatch(ticket, DispatchPlan(d.ranked[0], 1024, False), 0.0)
            policy.on_progress(ticket, int(evalset.length[rows[k], d.ranked[0]] // 2), 1.0)
    times = []
    for b in range(batches):
        rs = rows[tracked + b * batch_size: tracked + (b + 1) * batch_size]
        batch = [request(int(r)) for r in rs]
        view = pool_state.snapshot(cfg.instances, 1.0, cfg.telemetry.stale_after_s)
        start = time.perf_counter()
        decided = policy.assign(batch, estimates(rs), view)
        times.append((time.perf_counter() - start) / len(batch))
        for req, d in zip(batch, decided, strict=True):  # out again, so every batch sees the same load
            policy.on_complete(Ticket(req, "", True, cfg), Completion(bool(d.ranked), None), 1.0)
    t = np.array(times[len(times) // 10:])  # the first tenth warms up
    return {"policy": policy.name, "tracked": tracked, "batch_size": batch_size, "per_request_s": float(t.mean()),
            "p50_s": float(np.median(t)), "p99_s": float(np.quantile(t, 0.99))}
