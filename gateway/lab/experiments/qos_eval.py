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

`bench_decisions` times a policy's decisions per request (the figure behind
its `compute_s`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from gateway.lab.experiments.sweeps import RB_WEIGHTS, Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import EvalSet
from gateway.lab.sim.pools import GAMMA_SHAPE, pool_names
from gateway.lab.sim.simulator import CellSpec

POOL_SIZES = (3, 6, 9, 12)
BOUNDS_MS = (30.0, 50.0, 80.0)  # L: below the 7B tier's lone TPOT (20.6 ms) x 1.5, above the 72B's (47.4 ms)
RATE_PER_INSTANCE = 1.5  # req/s per instance: the 13-instance pool at ~20 req/s, where the 72B tier queues
HEADLINE_N, HEADLINE_MS = 6, 50.0  # the paper's N = 6 and a bound the 72B tier meets only when lightly loaded
SYSTEMS = ("qos", "qos-rl", "round_robin", "shortest_queue", "quality_only", "uniform")


def rate_for(n: int, per_instance: float = RATE_PER_INSTANCE) -> float:
    return per_instance * n


def _cell(system: str, arrivals: ArrivalSpec, requests: int, bound_ms: float, names: tuple[str, ...]) -> Cell:
    tags = {"instances": ",".join(names), "n": len(names), "tpot_slo_ms": bound_ms}
    common = dict(arrivals=arrivals, requests=requests, tpot_slo_s=bound_ms / 1000)
    if system in ("qos", "qos-rl"):
        return Cell(system, system, CellSpec(system, **common), tags=tags)
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
