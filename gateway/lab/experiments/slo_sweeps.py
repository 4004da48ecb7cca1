"""The SLO sweeps: QLM (papers/qlm-queue-management.txt section 8) against FCFS, EDF and vLLM's own queue.

    routebalance sim --sweep qlm

Workloads, all with gamma-bursty arrivals (shape 0.5) and the paper's mix of
SLO classes: half the requests interactive (25 s end to end, streamed), half
batch jobs (5 minutes, not streamed: a batch client reads the whole answer):
- W_B, one model: every request names the 7B tier (five instances), as in
  the paper's single-model workload, at three loads up to overload;
- W_C, mega prompts: W_B at 30 req/s where 5% of the requests are mega
  prompts (3,000 prompt tokens, 1,000 answer tokens) whose KV cache crowds
  an instance; here the ablation switches off each QLM operation in turn;
- auto: requests name the routing alias over the whole 13-instance pool, so
  QLM also chooses the model (the best one that still meets the SLO).
Systems: `qlm`, `edf` (deadline order on the same machinery), RouteBalance
(uniform weights, first come first served at the gateway) and passthrough
round robin (vLLM's own FCFS queue behind a plain balancer).

    routebalance sim --sweep qlm_multi

W_A, multi-model (pools.py): four GPUs time-share five models, one loaded at
a time, with the same SLO mix at 6 req/s; the tail models take 5%, 15% or
30% of the requests. The simulated GPUs swap models (engine/shared_gpu.py);
QLM plans around the swaps and warm-starts the models next in its queues.
The ablation adds warm start to the other operations. Beside vLLM's own FCFS
(each GPU swaps whenever its next request is of another model), the
swap-aware FCFS an operator of such GPUs would configure (`swap_aware_fcfs`:
a GPU keeps its model while that model has requests, up to a batch, then
swaps to the oldest waiting request's model). W_C on W_A: the paper's W_C,
W_A (middle tail share) with the mega prompts of `qlm`'s W_C.

    routebalance sim --sweep qlm_cap

QLM's pulling cap (`slowdown`: an instance takes requests while its decode
step stays within this x a lone step) on W_B at 40 req/s and W_C: how much
throughput the cap costs, and what attainment it buys.

    routebalance sim --sweep qlm_trace

`qlm`'s cells where its claims are (W_B at 40 req/s, W_C with the ablation,
auto) with the Azure LLM inference trace's arrivals (arrivals.py) at the same
rates: the same prompts, SLO mix and systems, only the arrival times differ.

    routebalance sim --sweep qlm_multi_trace

`qlm_multi`'s W_A and W_C on W_A at the middle tail share, likewise on the trace's arrivals.

    routebalance sim --sweep qlm_heads

QLM planning with its completion-time estimator fed by the TPOT heads
(`step_curve = "heads"`: a line fitted through the heads' answers,
policies/qlm/heads_curve.py) against the engine's own curve, on W_B at its
three rates and W_C: what a learnt estimate costs QLM where the exact one is
at hand.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.core.slo import BATCH_SLO_S
from gateway.lab.experiments.sweeps import RB_WEIGHTS, Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.pools import W_A_POPULAR, W_A_TAIL
from gateway.lab.sim.simulator import CellSpec

SLO_MIX = ((25.0, 0.5), (300.0, 0.5))  # (seconds, share): interactive and batch
STREAM_BELOW_S = BATCH_SLO_S  # batch jobs do not stream
ONE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
W_B_RATES = (20.0, 30.0, 40.0)
W_C_RATE = 30.0
AUTO_RATE = 30.0
MEGA_SHARE = 0.05
ABLATION = (("no pulling", {"pulling": False}), ("no eviction", {"eviction": False}),
            ("no state swap", {"state_swap": False}), ("no grouping", {"grouping": False}))
SLO_PAIRED = ("slo_attainment", "e2e_mean", "quality")
# W_A (pools.py): requests name one of the pool's models, the tail models taking a share of them. 6 req/s is
# about what the four GPUs serve when they swap once per stretch of a model (W_B runs 20-40 req/s on five
# GPUs that never swap).
W_A_TAIL_SHARES = (0.05, 0.15, 0.3)
W_A_RATE = 6.0
W_A_ABLATION = (("no warm start", {"warm_start": False}), *ABLATION)
W_A, W_C_ON_W_A = "W_A multi-model", "W_C on W_A (mega prompts)"
SWAP_AWARE = "swap-aware FCFS"
TRACE_W_B_RATES = (W_B_RATES[-1],)  # the trace sweep's W_B: the overload, where the systems differ


def w_a_mix(tail: float) -> tuple[tuple[str, float], ...]:
    """Each request's model: the popular ones share 1 - tail equally, the tail ones share `tail`."""
    return (tuple((name, (1 - tail) / len(W_A_POPULAR)) for name, _ in W_A_POPULAR)
            + tuple((name, tail / len(W_A_TAIL)) for name, _ in W_A_TAIL))


def _spec(policy: str, rate: float, n: int, model: str | None, mega: float,
          models: tuple[tuple[str, float], ...] = (), kind: str = "gamma") -> CellSpec:
    return CellSpec(policy, RB_WEIGHTS["uniform"], ArrivalSpec(kind, rate, shape=0.5), n, slos=SLO_MIX,
                    stream_below_s=STREAM_BELOW_S, model=model, mega_share=mega, models=models)


def _systems(workload: str, rate: float, n: int, model: str | None, mega: float,
             models: tuple[tuple[str, float], ...] = (), tags: dict | None = None, kind: str = "gamma") -> list[Cell]:
    tags = {"workload": workload, **(tags or {})}

    def spec(policy: str) -> CellSpec:
        return _spec(policy, rate, n, model, mega, models, kind)

    return [Cell("qlm", "qlm", spec("qlm"), tags=tags), Cell("edf", "edf", spec("edf"), tags=tags),
            Cell("routebalance", "uniform (FCFS)", spec("routebalance"), tags=tags),
            Cell("passthrough", "round_robin (vLLM FCFS)", spec("passthrough+round_robin"), tags=tags)]


def qlm(n: int, kind: str = "gamma", w_b_rates: Sequence[float] = W_B_RATES) -> list[Cell]:
    """W_B at `w_b_rates`, W_C with the ablation, and auto, on arrivals of `kind` (gamma: shape 0.5)."""
    cells = [c for rate in w_b_rates for c in _systems("W_B one model", rate, n, ONE_MODEL, 0.0, kind=kind)]
    cells += _systems("W_C mega prompts", W_C_RATE, n, ONE_MODEL, MEGA_SHARE, kind=kind)
    cells += [Cell("qlm", f"qlm, {label}", _spec("qlm", W_C_RATE, n, ONE_MODEL, MEGA_SHARE, kind=kind),
                   (("qlm", changes),), {"workload": "W_C mega prompts"}) for label, changes in ABLATION]
    return cells + _systems("auto", AUTO_RATE, n, None, 0.0, kind=kind)


def qlm_trace(n: int) -> list[Cell]:
    return qlm(n, "azure", TRACE_W_B_RATES)


HEADS = "qlm, TPOT heads"


def qlm_heads(n: int) -> list[Cell]:
    """QLM planning with the engine's own step-time curve against the curve read from the TPOT heads
    (`step_curve`), on W_B at its three rates and on W_C: what the estimator's error costs."""
    cells = []
    for workload, rate, mega in [*(("W_B one model", r, 0.0) for r in W_B_RATES),
                                 ("W_C mega prompts", W_C_RATE, MEGA_SHARE)]:
        tags = {"workload": workload}
        spec = _spec("qlm", rate, n, ONE_MODEL, mega)
        cells += [Cell("qlm", "qlm", spec, tags=tags),
                  Cell("qlm", HEADS, spec, (("qlm", {"step_curve": "heads"}),), tags)]
    return cells


def qlm_heads_pairs(cells: Sequence[Cell]) -> list[Pair]:
    pairs = []
    for workload, rate in dict.fromkeys((c.tags["workload"], c.spec.arrivals.rate) for c in cells):
        at = {"workload": workload, "rate": rate}
        pairs.append(Pair(f"TPOT heads vs engine curve, {workload} @{rate:g}", {"label": HEADS, **at},
                          {"label": "qlm", **at}, SLO_PAIRED))
    return pairs


def qlm_pairs(cells: Sequence[Cell]) -> list[Pair]:
    pairs = []
    for workload, rate in dict.fromkeys((c.tags["workload"], c.spec.arrivals.rate) for c in cells):
        at = {"workload": workload, "rate": rate}
        for other in ("edf", "uniform (FCFS)", "round_robin (vLLM FCFS)"):
            pairs.append(Pair(f"qlm vs {other}, {workload} @{rate:g}", {"label": "qlm", **at}, {"label": other, **at},
                              SLO_PAIRED))
    at = {"workload": "W_C mega prompts", "rate": W_C_RATE}
    pairs += [Pair(f"qlm vs qlm {label}, W_C", {"label": "qlm", **at}, {"label": f"qlm, {label}", **at}, SLO_PAIRED)
              for label, _ in ABLATION]
    return pairs


CAP_SLOWDOWNS = (1.5, 2.0, 3.0, 4.0)


def qlm_cap(n: int) -> list[Cell]:
    return [Cell("qlm", f"qlm, slowdown {sd:g}", _spec("qlm", rate, n, ONE_MODEL, mega), (("qlm", {"slowdown": sd}),),
                 {"workload": workload})
            for workload, rate, mega in (("W_B one model", W_B_RATES[-1], 0.0), ("W_C mega prompts", W_C_RATE,
                                                                                   MEGA_SHARE))
            for sd in CAP_SLOWDOWNS]


def qlm_cap_pairs(cells: Sequence[Cell]) -> list[Pair]:
    """Each cap against the default (2), per workload."""
    pairs = []
    for workload, rate in dict.fromkeys((c.tags["workload"], c.spec.arrivals.rate) for c in cells):
        at = {"workload": workload, "rate": rate}
        pairs += [Pair(f"slowdown {sd:g} vs 2, {workload}", {"label": f"qlm, slowdown {sd:g}", **at},
                       {"label": "qlm, slowdown 2", **at}, SLO_PAIRED) for sd in CAP_SLOWDOWNS if sd != 2.0]
    return pairs


def _multi(workload: str, tail: float, n: int, mega: float = 0.0, kind: str = "gamma") -> list[Cell]:
    """The four systems and the swap-aware FCFS on W_A at this tail share."""
    tags = {"workload": workload, "pool": "W_A", "tail": tail}
    return [*_systems(workload, W_A_RATE, n, None, mega, w_a_mix(tail), tags, kind),
            Cell("swap_aware_fcfs", SWAP_AWARE,
                 _spec("swap_aware_fcfs", W_A_RATE, n, None, mega, w_a_mix(tail), kind), tags=tags)]


def qlm_multi(n: int) -> list[Cell]:
    """W_A: the systems at each tail share, and the ablation (warm start too) at the middle one; the paper's W_C
    (W_A with mega prompts) at the middle one."""
    cells = [c for tail in W_A_TAIL_SHARES for c in _multi(W_A, tail, n)]
    middle = W_A_TAIL_SHARES[1]
    tags = {"workload": W_A, "pool": "W_A", "tail": middle}
    cells += [Cell("qlm", f"qlm, {label}", _spec("qlm", W_A_RATE, n, None, 0.0, w_a_mix(middle)), (("qlm", changes),),
                   tags) for label, changes in W_A_ABLATION]
    return cells + _multi(W_C_ON_W_A, middle, n, MEGA_SHARE)


def qlm_multi_trace(n: int) -> list[Cell]:
    """W_A and the paper's W_C on it, at the middle tail share, with the Azure trace's arrivals."""
    middle = W_A_TAIL_SHARES[1]
    return _multi(W_A, middle, n, kind="azure") + _multi(W_C_ON_W_A, middle, n, MEGA_SHARE, kind="azure")


def qlm_multi_pairs(cells: Sequence[Cell]) -> list[Pair]:
    pairs = []
    for workload, tail in dict.fromkeys((c.tags["workload"], c.tags["tail"]) for c in cells):
        at = {"workload": workload, "tail": tail}
        name = "W_A" if workload == W_A else "W_C on W_A"
        pairs += [Pair(f"qlm vs {other}, {name} tail {tail:g}", {"label": "qlm", **at}, {"label": other, **at},
                       SLO_PAIRED)
                  for other in ("edf", "uniform (FCFS)", "round_robin (vLLM FCFS)", SWAP_AWARE)]
        pairs.append(Pair(f"{SWAP_AWARE} vs round_robin (vLLM FCFS), {name} tail {tail:g}",
                          {"label": SWAP_AWARE, **at}, {"label": "round_robin (vLLM FCFS)", **at}, SLO_PAIRED))
    at = {"workload": W_A, "tail": W_A_TAIL_SHARES[1]}
    labels = {c.label for c in cells}
    return pairs + [Pair(f"qlm vs qlm {label}, W_A", {"label": "qlm", **at}, {"label": f"qlm, {label}", **at},
                         SLO_PAIRED) for label, _ in W_A_ABLATION if f"qlm, {label}" in labels]
