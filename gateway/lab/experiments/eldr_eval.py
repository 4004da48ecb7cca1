"""ELDR's comparison (papers/eldr-expert-locality-routing.txt, "Main Results" and "Design Validation") as
simulator cells: `routebalance sim --sweep eldr`.

The pool is the mixture-of-experts example (sim/pools.py `moe`: eight
Qwen3-30B-A3B instances, gateway/examples/moe.toml), every request naming
the routing alias. Systems: `eldr` at the paper's tau = 0.1, and the load
balancers the paper compares against, on the same pool: round robin, join
the shortest queue and power of two choices (`passthrough+<dispatcher>`).
The paper's figure is the median time per output token (TPOT, the decode
part: first token to last over the tokens after the first), with the tail
(p99) and end-to-end latency beside it.

- Load curve: every system at RATES (Poisson arrivals).
- Locality band (paper Fig. 16): eldr at every tau of TAUS at TAU_RATE, on
  the pool's usual mix and on `moe-shift`, where half the traffic is one kind
  (code) the centroids were not fitted for; the load balancers there too.

Pairs: eldr against each load balancer at each rate, and each tau against
join-the-shortest-queue on both mixes; request by request on the same
prompts and arrivals, TPOT and E2E relative (A / B - 1) with paired 95%
intervals.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments.sweeps import Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.simulator import CellSpec

RATES = (8, 16, 24, 32, 40)  # req/s over the 8 instances: 1 to 5 per instance (the paper: 20-100 over 16)
TAUS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0)
TAU = 0.1  # the paper's default, and [policies.eldr]'s
TAU_RATE = 24
BALANCERS = ("round_robin", "shortest_queue", "power_of_two")
POOLS = ("moe", "moe-shift")
FIGURES = ("decode_tpot_p50", "decode_tpot_p99", "e2e_mean")


def _eldr(rate: float, n: int, tau: float, pool: str) -> Cell:
    return Cell("eldr", "eldr", CellSpec("eldr", arrivals=ArrivalSpec(rate=rate), requests=n),
                (("eldr", {"tau": tau}),), {"pool": pool, "tau": tau})


def _balancer(dispatcher: str, rate: float, n: int, pool: str) -> Cell:
    return Cell("passthrough", dispatcher, CellSpec(f"passthrough+{dispatcher}", arrivals=ArrivalSpec(rate=rate),
                                                    requests=n), (), {"pool": pool, "tau": None})


def eldr_cells(n: int, rates: Sequence[float] = RATES, taus: Sequence[float] = TAUS) -> list[Cell]:
    cells: dict[tuple, Cell] = {}

    def add(cell: Cell) -> None:
        cells.setdefault((cell.label, cell.spec.arrivals.rate, cell.tags["pool"], str(cell.tags["tau"])), cell)

    for rate in rates:
        add(_eldr(rate, n, TAU, "moe"))
        for d in BALANCERS:
            add(_balancer(d, rate, n, "moe"))
    for pool in POOLS:
        for tau in taus:
            add(_eldr(TAU_RATE, n, tau, pool))
        for d in BALANCERS:
            add(_balancer(d, TAU_RATE, n, pool))
    return list(cells.values())


def eldr_pairs(cells: Sequence[Cell]) -> list[Pair]:
    def eldr(rate, pool, tau):
        return {"system": "eldr", "rate": rate, "pool": pool, "tau": tau}

    def balancer(d, rate, pool):
        return {"system": "passthrough", "label": d, "rate": rate, "pool": pool}

    pairs = []
    for rate in sorted({c.spec.arrivals.rate for c in cells if c.tags["pool"] == "moe" and c.tags["tau"] == TAU}):
        pairs += [Pair(f"eldr vs {d} @{rate:g}", eldr(rate, "moe", TAU), balancer(d, rate, "moe"), FIGURES, True)
                  for d in BALANCERS]
    for pool in POOLS:
        for tau in sorted({c.tags["tau"] for c in cells if c.system == "eldr" and c.tags["pool"] == pool
                           and c.spec.arrivals.rate == TAU_RATE}):
            if pool == "moe" and tau == TAU:
                continue  # the load curve's pair
            pairs.append(Pair(f"eldr tau={tau:g} vs shortest_queue, {pool} @{TAU_RATE:g}", eldr(TAU_RATE, pool, tau),
                              balancer("shortest_queue", TAU_RATE, pool), FIGURES, True))
    return pairs
