"""BEST-Route's routing alone on a labelled file, cross-fitted: what it picks at each threshold of the
RouteBalance paper's grid, and the quality and cost of those picks against every single model.

The simulator's real-label world (labelled_sweep.py) runs BEST-Route at t = 0.5 only, under load. This
replays the routing decision without the pool, over the whole grid, on the same folds (crossfit_world:
five folds by prompt, seed 0): each fold's prompts are scored by a BEST-Route scorer fitted on the other
folds, with the full pool usable. A pick's quality is the file's own score of that model's answer and its
cost the real (unclipped) answer's at the pool's prices; a row's quality is what the simulator reports for
the same picks at any load (it adds queueing, not quality). The scorer, as in the simulator, reads answer
lengths clipped at 1,024 tokens.

    python -m gateway.lab.experiments.best_route_offline --workload FILE --out loadtest/results
"""

from __future__ import annotations

import argparse
import csv
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gateway.config.store import load_config, resolve_config_path
from gateway.estimators.bundle import Estimators
from gateway.estimators.crossfit import folds
from gateway.lab.experiments.crossfit_world import FOLD_SEED, FOLDS
from gateway.lab.experiments.sweeps import BEST_ROUTE_THRESHOLDS
from gateway.lab.sim.stats import bootstrap_mean, difference
from gateway.lab.training.build import checked_workload, label_arrays
from gateway.lab.training.routing_report import pricing_of
from gateway.learning.labels import prompt_hash
from gateway.policies.pipeline.best_route import BestRoute, MatchScorer
from gateway.policies.pipeline.routers import model_prices
from gateway.records import read_jsonl


def crossfit_picks(x: np.ndarray, quality: np.ndarray, length: np.ndarray, input_tokens: np.ndarray,
                   models: Sequence[str], prices, groups: np.ndarray,
                   thresholds: Sequence[float] = BEST_ROUTE_THRESHOLDS) -> dict[float, np.ndarray]:
    """Threshold -> (n,) the model column BEST-Route picks for each prompt, scored by a scorer that never saw it."""
    picks = {t: np.full(len(x), -1) for t in thresholds}
    usable = set(models)
    for test in folds(len(x), FOLDS, FOLD_SEED, groups=groups):
        train = np.setdiff1d(np.arange(len(x)), test)
        scorer = MatchScorer.fit(x[train], quality[train], length[train], input_tokens[train], models, prices)
        p = scorer.predict(x[test])
        for t in thresholds:
            router = BestRoute(scorer, t)
            picks[t][test] = [models.index(router.pick(p[j], float(input_tokens[r]), usable) or "")
                              for j, r in enumerate(test)]
    return picks


def rows(picks: dict[float, np.ndarray], quality: np.ndarray, cost: np.ndarray,
         models: Sequence[str]) -> list[dict]:
    """One row per threshold: tier shares, quality and cost (95% intervals over prompts), and the paired quality
    difference with each single model; then one row per single model."""
    n = np.arange(len(quality))
    short = [m.split("/")[-1] for m in models]
    out = []
    for t, col in picks.items():
        q, c = quality[n, col], cost[n, col]
        row: dict = {"threshold": t, "prompts": len(q)}
        row |= {f"mix_{name}": float(np.mean(col == k)) for k, name in enumerate(short)}
        for figure, values in (("quality", q), ("cost_mean", c)):
            iv = bootstrap_mean(values)
            row |= {figure: iv.mean, f"{figure}_lo": iv.lo, f"{figure}_hi": iv.hi}
        for k, name in enumerate(short):
            iv = difference(q, quality[:, k])
            row |= {f"quality_vs_{name}": iv.mean, f"quality_vs_{name}_lo": iv.lo, f"quality_vs_{name}_hi": iv.hi}
        out.append(row)
    for k, name in enumerate(short):
        iv = bootstrap_mean(quality[:, k])
        out.append({"threshold": f"always {name}", "prompts": len(quality), "quality": iv.mean,
                    "quality_lo": iv.lo, "quality_hi": iv.hi, "cost_mean": float(cost[:, k].mean())})
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", required=True, help="labelled JSONL (e.g. the real-label file)")
    ap.add_argument("--config", default=None, help="config TOML (default: as `routebalance sim`)")
    ap.add_argument("--out", default="loadtest/results", help="where best_route_offline.csv is written")
    args = ap.parse_args(argv)
    cfg = load_config(resolve_config_path(args.config))
    records = read_jsonl(args.workload)
    models = checked_workload(records, cfg, args.workload)
    quality, length = label_arrays(records, models)
    x = Estimators.load(cfg).embedder.embed([r.prompt for r in records])
    inputs = np.array([r.input_len for r in records], dtype=np.float32)
    groups = np.array([prompt_hash(r.prompt) for r in records])
    picks = crossfit_picks(x, quality, length, inputs, models, model_prices(cfg.instances), groups)
    table = rows(picks, quality, pricing_of(records, cfg, models).cost, models)
    path = Path(args.out) / "best_route_offline.csv"
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in table for k in row))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, keys)
        writer.writeheader()
        writer.writerows(table)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
