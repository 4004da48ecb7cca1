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
The ablation adds warm start to the other operations.

    routebalance sim --sweep qlm_cap

QLM's pulling cap (`slowdown`: an instance takes requests while its decode
step stays within this x a lone step) on W_B at 40 req/s and W_C: how much
throughput the cap costs, and what attainment it buys.
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


def w_a_mix(tail: float) -> tuple[tuple[str, float], ...]:
    """Each request's model: the popular ones share 1 - tail equally, the tail ones share `tail`."""
    return (tuple((name, (1 - tail) / len(W_A_POPULAR)) for name, _ in W_A_POPULAR)
            + tuple((name, tail / len(W_A_TAIL)) for name, _ in W_A_TAIL))


def _spec(policy: str, rate: float, n: int, model: str | None, mega: float,
          models: tuple[tuple[str, float], ...] = ()) -> CellSpec:
    return CellSpec(policy, RB_WEIGHTS["uniform"], ArrivalSpec("gamma", rate, shape=0.5), n, slos=SLO_MIX,
                    stream_below_s=STREAM_BELOW_S, model=model, mega_share=mega, models=models)


def _systems(workload: str, rate: float, n: int, model: str | None, mega: float,
             models: tuple[tuple[str, float], ...] = (), tags: dict | None = None) -> list[Cell]:
    tags = {"workload": workload, **(tags or {})}
    return [Cell("qlm", "qlm", _spec("qlm", rate, n, model, mega, models), tags=tags),
            Cell("edf", "edf", _spec("edf", rate, n, model, mega, models), tags=tags),
            Cell("routebalance", "uniform (FCFS)", _spec("routebalance", rate, n, model, mega, models), tags=tags),
            Cell("passthrough", "round_robin (vLLM FCFS)",
                 _spec("passthrough+round_robin", rate, n, model, mega, models), tags=tags)]


def qlm(n: int) -> list[Cell]:
    cells = [c for rate in W_B_RATES for c in _systems("W_B one model", rate, n, ONE_MODEL, 0.0)]
    cells += _systems("W_C mega prompts", W_C_RATE, n, ONE_MODEL, MEGA_SHARE)
    cells += [Cell("qlm", f"qlm, {label}", _spec("qlm", W_C_RATE, n, ONE_MODEL, MEGA_SHARE), (("qlm", changes),),
                   {"workload": "W_C mega prompts"}) for label, changes in ABLATION]
    return cells + _systems("auto", AUTO_RATE, n, None, 0.0)


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


def qlm_multi(n: int) -> list[Cell]:
    """W_A: the four systems at each tail share, and the ablation (warm start too) at the middle one."""
    cells = [c for tail in W_A_TAIL_SHARES
             for c in _systems("W_A multi-model", W_A_RATE, n, None, 0.0, w_a_mix(tail), {"pool": "W_A", "tail": tail})]
    middle = W_A_TAIL_SHARES[1]
    tags = {"workload": "W_A multi-model", "pool": "W_A", "tail": middle}
    return cells + [Cell("qlm", f"qlm, {label}", _spec("qlm", W_A_RATE, n, None, 0.0, w_a_mix(middle)),
                         (("qlm", changes),), tags) for label, changes in W_A_ABLATION]


def qlm_multi_pairs(cells: Sequence[Cell]) -> list[Pair]:
    pairs = []
    for tail in W_A_TAIL_SHARES:
        at = {"workload": "W_A multi-model", "tail": tail}
        pairs += [Pair(f"qlm vs {other}, W_A tail {tail:g}", {"label": "qlm", **at}, {"label": other, **at},
                       SLO_PAIRED)
                  for other in ("edf", "uniform (FCFS)", "round_robin (vLLM FCFS)")]
    at = {"workload": "W_A multi-model", "tail": W_A_TAIL_SHARES[1]}
    return pairs + [Pair(f"qlm vs qlm {label}, W_A", {"label": "qlm", **at}, {"label": f"qlm, {label}", **at},
                         SLO_PAIRED) for label, _ in W_A_ABLATION]
