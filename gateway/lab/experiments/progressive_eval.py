"""PICE's comparison (papers/pice-progressive-inference.txt, Table III) as simulator cells:
`routebalance sim --sweep progressive`.

On the default pool (the 72B tier sketches; 3B and 7B expand, sim/progressive.py):

- cloud-only: every request names the 72B (the paper's Cloud-only), routed
  by RouteBalance among its instances;
- progressive: every request asks for progressive mode and names the 72B, so
  a request the fallback rule sends back is the cloud-only one; a sketched
  one's `quality` is the labels of the expansions the gateway's confidence
  (Eq. 3, on the emulator's noisy, per-model-biased logprobs) kept, and its
  `quality_oracle` the labels an oracle pick would keep (sim/progressive.py),
  against the cloud-only cell's `quality`, the 72B's labels on the same prompts;
- routing: RouteBalance over the whole pool at uniform weights (the paper's
  Routing baseline: each request to one model), for reference;
- progressive + routing: progressive mode without a named model, so the
  fallbacks are routed by RouteBalance;
- progressive, any length: progressive naming the 72B with the length rule
  off (`min_answer_tokens = 0`), so short answers are sketched too: the
  paper's gains assume long answers (about 500 tokens; the 72B's labelled
  answers here average 194).

Load curve: every system at RATES (Poisson). Throughput (the paper's
figure): every system under a burst of BURST_RATE, far past what the 72B
tier drains, where served requests over the span is the system's capacity.

Pairs: progressive against cloud-only and against routing at each rate,
request by request (quality, E2E mean and p90, TTFT, cost; relative too): the
quality difference against cloud-only is the confidence pick's labels minus the
72B's, with a paired interval.
"""

from __future__ import annotations

from collections.abc import Sequence

from gateway.lab.experiments.sweeps import BIGGEST, RB_WEIGHTS, Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.simulator import CellSpec

RATES = (0.5, 1.0, 1.5, 2.0, 3.0)
BURST_RATE = 20.0
SYSTEMS = ("cloud-only", "progressive", "routing", "progressive + routing", "progressive, any length")
FIGURES = ("quality", "e2e_mean", "e2e_p90", "ttft_mean", "cost_mean")
REQUESTS = 600  # held-out prompts per cell (1,000 before issue 27; 600: five seeds in about 13 CPU-minutes)


def _cell(system: str, rate: float, n: int) -> Cell:
    model = None if "routing" in system else BIGGEST
    spec = CellSpec("routebalance", RB_WEIGHTS["uniform"], ArrivalSpec(rate=rate), n, model=model,
                    progressive=system.startswith("progressive"))
    changes = (("progressive", {"min_answer_tokens": 0}),) if system.endswith("any length") else ()
    return Cell("progressive" if spec.progressive else "routebalance", system, spec, changes,
                tags={"load": "burst" if rate == BURST_RATE else "curve"})


def progressive_cells(n: int, rates: Sequence[float] = RATES) -> list[Cell]:
    return [_cell(system, rate, n) for rate in dict.fromkeys((*rates, BURST_RATE)) for system in SYSTEMS]


def progressive_pairs(cells: Sequence[Cell]) -> list[Pair]:
    pairs = []
    for rate in sorted({c.spec.arrivals.rate for c in cells}):
        for base in ("cloud-only", "routing"):
            pairs.append(Pair(f"progressive vs {base} @{rate:g}", {"label": "progressive", "rate": rate},
                              {"label": base, "rate": rate}, FIGURES, True))
        pairs += [Pair(f"progressive + routing vs routing @{rate:g}", {"label": "progressive + routing", "rate": rate},
                       {"label": "routing", "rate": rate}, FIGURES, True),
                  Pair(f"progressive, any length vs cloud-only @{rate:g}",
                       {"label": "progressive, any length", "rate": rate}, {"label": "cloud-only", "rate": rate},
                       FIGURES, True)]
    return pairs
