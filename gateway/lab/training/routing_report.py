"""What routing on the estimators buys on held-out prompts, judged by their labels: `routebalance train`'s
routing report.

Each preset routes every held-out prompt by Eq. 1 over the pool's models on an idle pool (latency: the
tier's static prior times the predicted length), and is scored with the prompts' own labels: mean quality,
and USD per 1,000 requests from the real answer lengths (not clipped) at the config's prices. Beside the
presets: every single model, the per-prompt oracle (the cheapest model with the best label), each preset's
tier shares, its paired difference to the best single model with 95% bootstrap intervals, and its distance
to the upper convex hull of the single models on the cost-quality plane (mixing two single models at
random reaches any point of that hull, so a router should lie above it).
"""

from __future__ import annotations

import numpy as np

from gateway.core.budget import predicted_cost, price_arrays
from gateway.core.scoring import eq1
from gateway.estimators.knn import KnnEstimate
from gateway.lab.sim.stats import difference
from gateway.records import Record

PER = 1000  # requests a cost is given for


def pool_columns(config, models: tuple[str, ...]) -> tuple[list[int], list]:
    """The estimate's columns the pool serves, and one instance of each (the first in the config)."""
    first = {i.model: i for i in reversed(config.instances)}
    cols = [j for j, m in enumerate(models) if m in first]
    return cols, [first[models[j]] for j in cols]


def picks(est: KnnEstimate, test: list[Record], config, weights: tuple[float, float, float]) -> np.ndarray:
    """The model column Eq. 1 picks for each prompt at these weights."""
    cols, pool = pool_columns(config, est.models)
    price_in, price_out = price_arrays(pool)
    tpot = np.array([i.tpot_prior_ms / 1000 for i in pool])
    out = np.empty(len(test), dtype=np.int64)
    for r, record in enumerate(test):
        length = est.length[r, cols]
        cost = predicted_cost(record.input_len, length, price_in, price_out)
        out[r] = cols[int(np.argmax(eq1(weights, est.quality[r, cols], cost, tpot * length)))]
    return out


def upper_hull(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The upper convex hull of (cost, quality) points, cheapest first, rising in quality."""
    hull: list[tuple[float, float]] = []
    for p in sorted(points):
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            if (x2 - x1) * (p[1] - y1) - (y2 - y1) * (p[0] - x1) >= 0:  # hull[-1] is on or under the chord
                hull.pop()
            else:
                break
        if not hull or p[1] > hull[-1][1]:
            hull.append(p)
    return hull


def hull_quality(hull: list[tuple[float, float]], cost: float) -> float:
    """The quality the hull reaches at `cost` (its best point past its most expensive one)."""
    if cost <= hull[0][0]:
        return hull[0][1]
    for (x1, y1), (x2, y2) in zip(hull, hull[1:], strict=False):
        if x1 <= cost <= x2:
            return y1 + (y2 - y1) * (cost - x1) / (x2 - x1)
    return hull[-1][1]


def routing_report(est: KnnEstimate, test: list[Record], config, seed: int = 0) -> dict | None:
    """Presets, single models and the oracle on the held-out prompts (None if the pool serves no labelled
    model)."""
    cols, pool = pool_columns(config, est.models)
    if not cols or not test:
        return None
    rows = np.arange(len(test))
    quality = np.array([[r.models[m].score for m in est.models] for r in test])
    price_in, price_out = price_arrays(pool)
    prices = {est.models[j]: (price_in[k], price_out[k]) for k, j in enumerate(cols)}
    cost = np.zeros_like(quality)
    for j in cols:
        p_in, p_out = prices[est.models[j]]
        cost[:, j] = [predicted_cost(r.input_len, r.models[est.models[j]].output_length, p_in, p_out) for r in test]

    def figures(chosen: np.ndarray) -> dict:
        q, c = quality[rows, chosen], cost[rows, chosen]
        return {"quality": float(q.mean()), "usd_per_1k": float(c.mean() * PER),
                "shares": {est.models[j]: float((chosen == j).mean()) for j in cols}, "_q": q, "_c": c}

    singles = {est.models[j]: figures(np.full(len(test), j)) for j in cols}
    best_name = max(singles, key=lambda m: (singles[m]["quality"], -singles[m]["usd_per_1k"]))
    best = singles[best_name]
    hull = upper_hull([(float(s["usd_per_1k"]), float(s["quality"])) for s in singles.values()])
    sub = quality[:, cols]
    top = sub.max(axis=1, keepdims=True)
    oracle_cost = np.where(np.isclose(sub, top), cost[:, cols], np.inf)
    oracle = figures(np.array(cols)[oracle_cost.argmin(axis=1)])
    presets = {}
    for name in config.scheduler.presets:
        w = config.weights(name)
        f = figures(picks(est, test, config, (w.quality, w.latency, w.cost)))
        dq = difference(f["_q"][None, :], best["_q"][None, :], seed=seed)
        dc = difference(f["_c"][None, :] * PER, best["_c"][None, :] * PER, seed=seed)
        f["vs_best"] = {"quality": [float(dq.mean), float(dq.lo), float(dq.hi)],
                        "usd_per_1k": [float(dc.mean), float(dc.lo), float(dc.hi)]}
        f["above_hull"] = float(f["quality"] - hull_quality(hull, f["usd_per_1k"]))
        presets[name] = f
    strip = lambda f: {k: v for k, v in f.items() if not k.startswith("_")}  # noqa: E731
    return {"prompts": len(test), "best_single": best_name, "singles": {m: strip(f) for m, f in singles.items()},
            "oracle": strip(oracle), "presets": {n: strip(f) for n, f in presets.items()}}


def format_routing(report: dict) -> list[str]:
    """The routing report as text lines."""
    models = list(report["singles"])
    short = [m.rsplit("/", 1)[-1].removeprefix("Qwen2.5-").removesuffix("-Instruct") for m in models]
    lines = [f"Routing on {report['prompts']} held-out prompts, scored by their labels (idle pool; cost from the "
             f"real answer lengths); difference to the best single model ({report['best_single']}) with 95% "
             "intervals; above hull: quality over the single models' cost-quality hull at that cost",
             f"  {'':<16} {'quality':>8} {'USD/1k':>8}  {'share ' + ' / '.join(short):<28} "
             f"{'quality vs best':>26} {'USD/1k vs best':>26} {'above hull':>10}"]

    def row(name: str, f: dict) -> str:
        shares = " / ".join(f"{f['shares'][m]:.2f}" for m in models)
        out = f"  {name:<16} {f['quality']:>8.3f} {f['usd_per_1k']:>8.4f}  {shares:<28}"
        if "vs_best" in f:
            q, c = f["vs_best"]["quality"], f["vs_best"]["usd_per_1k"]
            out += (f" {q[0]:>+8.3f} [{q[1]:+.3f}, {q[2]:+.3f}] {c[0]:>+8.4f} [{c[1]:+.4f}, {c[2]:+.4f}]"
                    f" {f['above_hull']:>+10.3f}")
        return out

    for name, f in report["presets"].items():
        lines.append(row(f"preset {name}", f))
    for name, s in zip(models, short, strict=True):
        lines.append(row(f"always {s}", report["singles"][name]))
    lines.append(row("oracle", report["oracle"]))
    return lines
