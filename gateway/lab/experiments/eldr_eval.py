"""ELDR's comparison (papers/eldr-expert-locality-routing.txt, "Main Results" and "Design Validation") as
simulator cells: `routebalance sim --sweep eldr`. Every figure is from the simulated world.

The pool is the mixture-of-experts example (sim/pools.py `moe`: eight
Qwen3-30B-A3B instances, gateway/examples/moe.toml), every request naming
the routing alias. Its experts have preferences within each kind: each kind
has four subdomains, fixed by a hash of the prompt's text, so neither the
kind label nor the prompt's meaning reveals them (engine/moe.py). Systems,
all on the same pool:

- eldr: ELDR at the paper's tau = 0.1 on the MiniLM embedding (what the live
  gateway can compute);
- eldr count-idf: ELDR on the paper's signature, count-IDF of the simulated
  prefill's expert activations (pool "moe/count-idf", sim/moe_signatures.py);
- domain oracle: the paper's Domain baseline, ELDR's band over balanced
  centroids of the true kind (pool "moe/domain");
- plain k-means: ELDR on the embedding with plain (unbalanced) k-means
  centroids, the paper's vanilla K-means;
- the load balancers: round robin, join the shortest queue, power of two
  choices and random (`passthrough+<dispatcher>`).

The paper's figure is the median time per output token (TPOT, the decode
part: first token to last over the tokens after the first), with the tail
(p99) and end-to-end latency beside it.

- Load curve: every system at RATES (Poisson arrivals).
- Locality band (paper Fig. 16): both ELDR signatures at TAUS at TAU_RATE,
  and plain k-means at tau = 0 (a plain nearest-cluster router). The
  earlier sweep's taus 0.05, 0.3 and 1.0 (1.0 is join the shortest queue)
  and the shifted mix (`moe-shift`, still a pool) are left out: they do not
  serve the comparison of signatures and baselines.
- The kind-only world (pool `moe-kind`: within-kind structure off, the world
  of the earlier results): both signatures, the domain oracle and join the
  shortest queue at TAU_RATE, to show what the hidden subdomains change.

Pairs: request by request on the same prompts and arrivals, TPOT and E2E
relative (A / B - 1) with paired 95% intervals (eldr_pairs).

`python -m gateway.lab.experiments.eldr_eval` writes the signatures' quality
(the paper's rho, sim/moe_signatures.py) in both worlds to
loadtest/results/eldr_signatures.csv.
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

from gateway.lab.experiments.sweeps import Cell, Pair
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.simulator import CellSpec

RATES = (16, 24, 32, 40)  # req/s over the 8 instances: 2 to 5 per instance (the paper: 20-100 over 16)
TAUS = (0.0, 0.2, 0.5)  # beside TAU
TAU = 0.1  # the paper's default, and [policies.eldr]'s
TAU_RATE = 24
BALANCERS = ("round_robin", "shortest_queue", "power_of_two", "random")
POOL, KIND_ONLY = "moe", "moe-kind"
WORLDS = {POOL: "kind+subdomain", KIND_ONLY: "kind only"}
EMBEDDING, COUNT_IDF, DOMAIN, KMEANS = "eldr", "eldr count-idf", "domain oracle", "plain k-means"
FIGURES = ("decode_tpot_p50", "decode_tpot_p99", "e2e_mean")


def _cell(label: str, system: str, policy: str, rate: float, n: int, world: str, signature: str | None,
          tau: float | None, changes: tuple = ()) -> Cell:
    pool = world if signature in (None, "embedding") else f"{world}/{signature}"
    return Cell(system, label, CellSpec(policy, arrivals=ArrivalSpec(rate=rate), requests=n), changes,
                {"pool": pool, "world": WORLDS[world], "signature": signature, "tau": tau})


def _eldr(rate: float, n: int, tau: float = TAU, world: str = POOL, signature: str = "embedding") -> Cell:
    label = EMBEDDING if signature == "embedding" else COUNT_IDF
    return _cell(label, "eldr", "eldr", rate, n, world, signature, tau, (("eldr", {"tau": tau}),))


def _domain(rate: float, n: int, world: str = POOL) -> Cell:
    return _cell(DOMAIN, "domain-oracle", "eldr", rate, n, world, "domain", TAU, (("eldr", {"tau": TAU}),))


def _kmeans(rate: float, n: int, tau: float = TAU) -> Cell:
    label = KMEANS if tau == TAU else f"{KMEANS}, tau={tau:g}"
    return _cell(label, "kmeans", "eldr", rate, n, POOL, "embedding", tau, (("eldr", {"tau": tau, "balanced": False}),))


def _balancer(dispatcher: str, rate: float, n: int, world: str = POOL) -> Cell:
    return _cell(dispatcher, "passthrough", f"passthrough+{dispatcher}", rate, n, world, None, None)


def eldr_cells(n: int, rates: Sequence[float] = RATES, taus: Sequence[float] = TAUS) -> list[Cell]:
    cells = []
    for rate in rates:
        cells += [_eldr(rate, n), _eldr(rate, n, signature="count-idf"), _domain(rate, n), _kmeans(rate, n)]
        cells += [_balancer(d, rate, n) for d in BALANCERS]
    for tau in taus:
        cells += [_eldr(TAU_RATE, n, tau), _eldr(TAU_RATE, n, tau, signature="count-idf")]
    cells.append(_kmeans(TAU_RATE, n, 0.0))
    cells += [_eldr(TAU_RATE, n, world=KIND_ONLY), _eldr(TAU_RATE, n, world=KIND_ONLY, signature="count-idf"),
              _domain(TAU_RATE, n, KIND_ONLY), _balancer("shortest_queue", TAU_RATE, n, KIND_ONLY)]
    return cells


def _side(label: str, rate: float, world: str = POOL, tau: float | None = TAU) -> dict:
    side = {"label": label, "rate": rate, "world": WORLDS[world]}
    return side if label in BALANCERS else {**side, "tau": tau}


def eldr_pairs(cells: Sequence[Cell]) -> list[Pair]:
    present = {(c.label, c.spec.arrivals.rate, c.tags["world"], c.tags["tau"]) for c in cells}

    def pair(name: str, a: dict, b: dict) -> list[Pair]:
        have = all((s["label"], s["rate"], s["world"], s.get("tau")) in present for s in (a, b))
        return [Pair(name, a, b, FIGURES, True)] if have else []

    pairs = []
    for rate in sorted({c.spec.arrivals.rate for c in cells}):
        for d in BALANCERS:
            pairs += pair(f"eldr vs {d} @{rate:g}", _side(EMBEDDING, rate), _side(d, rate))
            pairs += pair(f"eldr count-idf vs {d} @{rate:g}", _side(COUNT_IDF, rate), _side(d, rate))
        pairs += pair(f"eldr count-idf vs eldr @{rate:g}", _side(COUNT_IDF, rate), _side(EMBEDDING, rate))
        pairs += pair(f"eldr count-idf vs domain oracle @{rate:g}", _side(COUNT_IDF, rate), _side(DOMAIN, rate))
        pairs += pair(f"eldr vs domain oracle @{rate:g}", _side(EMBEDDING, rate), _side(DOMAIN, rate))
        pairs += pair(f"domain oracle vs shortest_queue @{rate:g}", _side(DOMAIN, rate), _side("shortest_queue", rate))
        pairs += pair(f"plain k-means vs eldr @{rate:g}", _side(KMEANS, rate), _side(EMBEDDING, rate))
    jsq = _side("shortest_queue", TAU_RATE)
    for tau in sorted({c.tags["tau"] for c in cells if c.system == "eldr" and c.tags["tau"] != TAU}):
        pairs += pair(f"eldr tau={tau:g} vs shortest_queue, moe @{TAU_RATE:g}",
                      _side(EMBEDDING, TAU_RATE, tau=tau), jsq)
        pairs += pair(f"eldr count-idf tau={tau:g} vs shortest_queue, moe @{TAU_RATE:g}",
                      _side(COUNT_IDF, TAU_RATE, tau=tau), jsq)
    pairs += pair(f"plain k-means tau=0 vs shortest_queue, moe @{TAU_RATE:g}",
                  _side(f"{KMEANS}, tau=0", TAU_RATE, tau=0.0), jsq)
    kind_jsq = _side("shortest_queue", TAU_RATE, KIND_ONLY)
    for label in (EMBEDDING, COUNT_IDF, DOMAIN):
        pairs += pair(f"{label} vs shortest_queue, moe-kind @{TAU_RATE:g}", _side(label, TAU_RATE, KIND_ONLY), kind_jsq)
    pairs += pair(f"eldr count-idf vs eldr, moe-kind @{TAU_RATE:g}", _side(COUNT_IDF, TAU_RATE, KIND_ONLY),
                  _side(EMBEDDING, TAU_RATE, KIND_ONLY))
    pairs += pair(f"eldr vs domain oracle, moe-kind @{TAU_RATE:g}", _side(EMBEDDING, TAU_RATE, KIND_ONLY),
                  _side(DOMAIN, TAU_RATE, KIND_ONLY))
    return pairs


def main(argv: Sequence[str] | None = None) -> int:
    """The signatures' rank correlation with decode experts, per world, as a CSV."""
    from gateway.config.store import load_config
    from gateway.lab.experiments.crossfit_world import load_world
    from gateway.lab.sim.moe_signatures import signature_quality
    from gateway.lab.sim.pools import named

    p = argparse.ArgumentParser(description="the ELDR signatures' rank correlation with decode experts")
    p.add_argument("--config", default="config.toml")
    p.add_argument("--prompts", type=int, default=400)
    p.add_argument("--out", default="loadtest/results/eldr_signatures.csv")
    args = p.parse_args(argv)
    base = load_config(args.config)
    evalset = load_world(base, 2500)[0][0]
    rows = []
    for world in (POOL, KIND_ONLY):
        cfg, ev = named(world)(base, evalset)
        rows += [{"pool": world, "world": WORLDS[world], **row} for row in signature_quality(cfg, ev, args.prompts)]
    with Path(args.out).open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    for row in rows:
        print(row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
