"""What routing on the estimators buys, judged by the prompts' own labels: `routebalance train`'s routing report.

The estimates are out of fold (a workload file: repeated k-fold, every prompt predicted by estimators that
never saw it) or of a held-out split (the synthetic workload): (repeats, prompts, models) arrays, one row of
picks per repeat, and each prompt's figure is its mean over the repeats.

Each preset routes every prompt by Eq. 1 over the pool's models on an idle pool (latency: the tier's static
prior times the predicted length), and so do the quality:cost mixes of the router's trade-off curve (latency
weight 0). Each is scored with the prompts' own labels: mean quality, USD per 1,000 requests from the real
answer lengths (not clipped) at the config's prices, and idle latency (the prior times the real length).
Beside them: every single model, the per-prompt oracle (the cheapest model with the best label), the task
baseline where records carry a task (Eq. 1 on each task's mean labels: knowing the task and nothing else),
tier shares, the paired difference to the best single model with 95% bootstrap intervals over prompts, the
distance to the upper convex hull of the single models on the cost-quality plane (mixing two single models
at random reaches any point of it, so a router should lie above it), and which single model, if any,
dominates a preset (at least as often correct, as cheap and as fast).
"""

from __future__ import annotations

import numpy as np

from gateway.core.budget import predicted_cost
from gateway.estimators.crossfit import (
    MIXES,
    Pricing,
    eq1_picks,
    hull_quality,
    model_prices,
    pool_columns,
    upper_hull,
)
from gateway.lab.sim.stats import difference
from gateway.records import Record

PER = 1000  # requests a cost is given for


def pricing_of(records: list[Record], config, models: tuple[str, ...]) -> Pricing:
    """Prices, prompt lengths and each pool model's real answer cost per record (columns: `models`; a model
    the pool lacks is priced at 0 and never picked, see `routing_report`)."""
    _, price_in, price_out = model_prices(config.instances, models)
    input_len = np.array([r.input_len for r in records], dtype=np.float64)
    real = np.array([[r.models[m].output_length for m in models] for r in records], dtype=np.float64)
    return Pricing(price_in, price_out, input_len, predicted_cost(input_len[:, None], real, price_in, price_out))


def picks(quality: np.ndarray, length: np.ndarray, pricing: Pricing, cols: list[int], tpot_s: np.ndarray,
          weights: tuple[float, float, float]) -> np.ndarray:
    """(repeats, prompts) model columns Eq. 1 picks among the pool's columns."""
    rows = np.arange(quality.shape[1])
    sub = Pricing(pricing.price_in[cols], pricing.price_out[cols], pricing.input_len, pricing.cost[:, cols])
    return np.array(cols)[np.stack([eq1_picks(q[:, cols], ln[:, cols], sub, rows, weights, tpot_s)
                                    for q, ln in zip(quality, length, strict=True)])]


def routing_report(quality: np.ndarray, length: np.ndarray, records: list[Record], config,
                   models: tuple[str, ...], task_means: np.ndarray | None = None, seed: int = 0) -> dict | None:
    """Presets, mixes, single models, the oracle and the task baseline on `records` (None if the pool serves no
    labelled model). `quality` and `length`: (repeats, len(records), len(models)) estimates."""
    cols, pool = pool_columns(config.instances, models)
    if not cols or not records:
        return None
    n = len(records)
    labels = np.array([[r.models[m].score for m in models] for r in records], dtype=np.float64)
    pricing = pricing_of(records, config, models)
    tpot = np.array([i.tpot_prior_ms / 1000 for i in pool])
    tpot_of = np.zeros(len(models))
    tpot_of[cols] = tpot
    real_len = np.array([[r.models[m].output_length for m in models] for r in records], dtype=np.float64)
    rows = np.arange(n)

    def figures(chosen: np.ndarray) -> dict:
        """Per prompt, the mean over repeats of the chosen model's label, cost and idle latency."""
        chosen = np.atleast_2d(chosen)
        q = labels[rows, chosen].mean(axis=0)
        c = pricing.cost[rows, chosen].mean(axis=0) * PER
        s = (tpot_of[chosen] * real_len[rows, chosen]).mean(axis=0)
        return {"quality": float(q.mean()), "usd_per_1k": float(c.mean()), "idle_latency_s": float(s.mean()),
                "shares": {models[j]: float((chosen == j).mean()) for j in cols}, "_q": q, "_c": c}

    singles = {models[j]: figures(np.full(n, j)) for j in cols}
    best_name = max(singles, key=lambda m: (singles[m]["quality"], -singles[m]["usd_per_1k"]))
    best = singles[best_name]
    hull = upper_hull([(s["usd_per_1k"], s["quality"]) for s in singles.values()])
    sub = labels[:, cols]
    oracle_cost = np.where(np.isclose(sub, sub.max(axis=1, keepdims=True)), pricing.cost[:, cols], np.inf)
    oracle = figures(np.array(cols)[oracle_cost.argmin(axis=1)])

    def routed(estimate: np.ndarray, estimated_length: np.ndarray, weights) -> dict:
        f = figures(picks(estimate, estimated_length, pricing, cols, tpot, weights))
        dq = difference(f["_q"][None, :], best["_q"][None, :], seed=seed)
        dc = difference(f["_c"][None, :], best["_c"][None, :], seed=seed)
        f["vs_best"] = {"quality": [float(v) for v in (dq.mean, dq.lo, dq.hi)],
                        "usd_per_1k": [float(v) for v in (dc.mean, dc.lo, dc.hi)]}
        f["above_hull"] = float(f["quality"] - hull_quality(hull, f["usd_per_1k"]))
        f["dominated_by"] = [m for m, s in singles.items() if s["quality"] >= f["quality"]
                             and s["usd_per_1k"] <= f["usd_per_1k"] and s["idle_latency_s"] <= f["idle_latency_s"]]
        return f

    rows_of = {}
    for name in config.scheduler.presets:
        w = config.weights(name)
        rows_of[f"preset {name}"] = routed(quality, length, (w.quality, w.latency, w.cost))
    for w in MIXES:
        rows_of[f"mix {w[0]:g}:{w[2]:g}"] = routed(quality, length, w)
    if task_means is not None:
        for w in MIXES:
            rows_of[f"task {w[0]:g}:{w[2]:g}"] = routed(task_means, length, w)
    strip = lambda f: {k: v for k, v in f.items() if not k.startswith("_")}  # noqa: E731
    return {"prompts": n, "repeats": int(quality.shape[0]), "best_single": best_name,
            "singles": {m: strip(f) for m, f in singles.items()}, "oracle": strip(oracle),
            "routed": {name: strip(f) for name, f in rows_of.items()}}


def format_routing(report: dict, scope: str) -> list[str]:
    """The routing report as text lines; `scope` says which prompts it was measured on."""
    models = list(report["singles"])
    short = [m.rsplit("/", 1)[-1].removeprefix("Qwen2.5-").removesuffix("-Instruct") for m in models]
    lines = [f"Routing on {scope}, scored by their labels (idle pool; cost and latency from the real answer "
             f"lengths); difference to the best single model ({report['best_single']}) with 95% intervals; above "
             "hull: quality over the single models' cost-quality hull at that cost; mix q:c and task q:c: latency "
             "weight 0, task: each task's mean labels",
             f"  {'':<16} {'quality':>8} {'USD/1k':>8} {'idle s':>7}  {'share ' + ' / '.join(short):<28} "
             f"{'quality vs best':>26} {'USD/1k vs best':>26} {'above hull':>10}  dominated by"]

    def row(name: str, f: dict) -> str:
        shares = " / ".join(f"{f['shares'][m]:.2f}" for m in models)
        out = f"  {name:<16} {f['quality']:>8.3f} {f['usd_per_1k']:>8.4f} {f['idle_latency_s']:>7.2f}  {shares:<28}"
        if "vs_best" in f:
            q, c = f["vs_best"]["quality"], f["vs_best"]["usd_per_1k"]
            beaten = ", ".join(m.rsplit("/", 1)[-1] for m in f["dominated_by"]) or "-"
            out += (f" {q[0]:>+8.3f} [{q[1]:+.3f}, {q[2]:+.3f}] {c[0]:>+8.4f} [{c[1]:+.4f}, {c[2]:+.4f}]"
                    f" {f['above_hull']:>+10.3f}  {beaten}")
        return out

    for name, f in report["routed"].items():
        lines.append(row(name, f))
    for name, s in zip(models, short, strict=True):
        lines.append(row(f"always {s}", report["singles"][name]))
    lines.append(row("oracle", report["oracle"]))
    return lines
