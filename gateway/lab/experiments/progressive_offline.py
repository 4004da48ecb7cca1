"""Progressive mode (PICE) offline: the figures the progressive study's docs quote that no sweep column holds.

On the held-out prompts the study's cells replay (`routebalance sim --sweep progressive`,
progressive_eval.py: REQUESTS prompts; its seeds move the arrivals only, so the plans are the same for
each), for the fallback rule as configured ("default")
and without its length test ("any length", `min_answer_tokens = 0`, as the study's "progressive, any
length" cell sets it), with the very plans the simulator makes (sim/progressive.py `plan_all`):

- sketched: share of the prompts the rule sketches (mode "progressive"; `progressive_share` in progressive.csv);
- ineq2_of_sketched, ineq2_of_all: share of the sketched prompts, and of all prompts, for which PICE's
  inequality (2) holds at p = 1 with an empty edge queue and no network delay,
  f(|r_i|) + c f(l_i) <= f(l_i), f(n) = n x the 72B engine's lone-step decode time (its `tpot_s`): |r_i| the
  plan's sketch tokens, l_i the 72B's predicted answer length (what the rule reads), c the larger lone-step
  decode time of the point's candidate models over the 72B's (conservative: every point is expanded on
  all of them). A prompt the rule does not sketch is judged on the sketch the any-length rule would write;
  one with no plan under either rule (code, short facts, too few points) counts as not holding;
- quality_random: a cell's `quality` with each point's expansion picked uniformly at random among its
  candidates (an expectation: the mean of their labels), a fallback scoring its named model's label as
  in the simulator; quality_oracle and quality (Eq. 3 confidence, sim/progressive.py `kept`) on the same
  path, so the three picks compare in one file (with every call served, as in the study's cells, these
  are the sweep's own `quality_oracle` and `quality`).

One row per rule, each figure with its 95% bootstrap interval over the prompts (sim/stats.py, as the sweeps
compute them).

    python -m gateway.lab.experiments.progressive_offline [--out loadtest/results/progressive_offline.csv]
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from gateway.config.store import load_config, resolve_config_path
from gateway.lab.emulator.settings import engine_for
from gateway.lab.experiments.progressive_eval import REQUESTS, progressive_cells
from gateway.lab.experiments.sweeps import configured
from gateway.lab.sim.evalset import load_evalset
from gateway.lab.sim.progressive import PROGRESSIVE, kept, plan_all
from gateway.lab.sim.simulator import megas
from gateway.lab.sim.stats import bootstrap_many
from gateway.lab.workload.progressive import expansion_tokens

RULES = {"default": "progressive", "any length": "progressive, any length"}  # rule -> the study's cell label
FIGURES = ("sketched", "ineq2_of_sketched", "ineq2_of_all", "quality_random", "quality_oracle", "quality")


def rule_cells(n: int) -> dict:
    """The study's two progressive cells naming the 72B (the rate does not enter the plan)."""
    cells = {c.label: c for c in progressive_cells(n, rates=(1.0,)) if c.spec.arrivals.rate == 1.0}
    return {rule: cells[label] for rule, label in RULES.items()}


def _plans(cfg, ev, cell):
    """The cell's plans, as the simulator makes them (Simulation.__init__)."""
    spec = dataclasses.replace(cell.spec, requests=len(ev))
    if megas(spec, len(ev)).any():  # the only seeded input of the plan; progressive cells carry none
        raise ValueError("progressive cells carry no mega prompts")
    cfg = configured(cfg, cell.config_changes)
    return plan_all(ev.prompts, ev.prompt_tokens, ev.label_length, ev.length, cfg.instances,
                    cfg.progressive.limits(), cfg.progressive.rule())


def per_request(cfg, ev, cells: dict) -> tuple[dict[str, dict[str, np.ndarray]], float]:
    """Per rule, each figure's per-request values (NaN: not counted), and c."""
    plans = {rule: _plans(cfg, ev, cell) for rule, cell in cells.items()}
    would = plans["any length"].plans  # the sketch a prompt would get were its length not tested
    first = plans["default"]
    column = {}
    for k, inst in enumerate(cfg.instances):
        column.setdefault(inst.model, k)
    tpot = {inst.model: engine_for(cfg, inst).tpot_s for inst in cfg.instances}
    c = max(tpot[m] for m in first.small) / tpot[first.large]
    large = column[first.large]
    out = {}
    for rule, p in plans.items():
        holds = np.zeros(len(ev), dtype=bool)  # on the rule's own sketch, else on the one it would be
        for r, plan in {**would, **p.plans}.items():
            holds[r] = plan.sketch_tokens + c * ev.length[r, large] <= ev.length[r, large]  # f linear: tpot cancels
        sketched = np.array([m == PROGRESSIVE for m in p.modes])
        whole = ev.label_score[:, column[cells[rule].spec.model]]  # a fallback: its named model's label
        q = {name: whole.copy() for name in ("quality_random", "quality_oracle", "quality")}
        for r, plan in p.plans.items():
            picks = {name: [] for name in q}
            for point in range(1, plan.points + 1):
                served = [(e, SimpleNamespace(quality=float(ev.label_score[r, column[e.model]]),
                                              completion_tokens=min(
                                                  expansion_tokens(int(ev.label_length[r, column[e.model]]),
                                                                   plan.points), p.limits.expansion_max_tokens)))
                          for e in plan.expansions if e.point == point]
                labels = [o.quality for _, o in served]
                picks["quality_random"].append(np.mean(labels))
                picks["quality_oracle"].append(max(labels))
                picks["quality"].append(labels[kept(plan, point, served, p.limits)])
            for name in q:
                q[name][r] = np.mean(picks[name])
        out[rule] = {"sketched": sketched.astype(float), "ineq2_of_sketched": np.where(sketched, holds, np.nan),
                     "ineq2_of_all": holds.astype(float), **q}
    return out, c


def offline_rows(cfg, ev, n: int | None = None) -> list[dict]:
    """One row per rule: each figure, with `_lo`/`_hi` its interval over the prompts."""
    ev = ev.take(n or len(ev))
    cells = rule_cells(len(ev))
    values, c = per_request(cfg, ev, cells)
    rows = []
    for rule in cells:
        intervals = bootstrap_many({f: (values[rule][f][None, :], "mean") for f in FIGURES})
        row: dict = {"rule": rule, "requests": len(ev), "c": round(c, 4)}
        for f in FIGURES:
            row[f] = float(np.nanmean(values[rule][f]))
            row[f"{f}_lo"], row[f"{f}_hi"] = intervals[f].lo, intervals[f].hi
        rows.append(row)
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=None, help="config TOML (default: as `routebalance sim`)")
    ap.add_argument("--requests", type=int, default=REQUESTS, help=f"held-out prompts (default {REQUESTS})")
    ap.add_argument("--out", default="loadtest/results/progressive_offline.csv", help="the CSV written")
    args = ap.parse_args(argv)
    if args.requests < 1:
        raise SystemExit("--requests must be at least 1")
    cfg = load_config(resolve_config_path(args.config))
    rows = offline_rows(cfg, load_evalset(cfg, args.requests))
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows({k: f"{v:.6g}" if isinstance(v, float) else v for k, v in row.items()} for row in rows)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
