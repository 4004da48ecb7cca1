"""Learning from traffic, replayed: `routebalance learning-curve`.

The labelled prompts of a workload file arrive one by one in a seeded order, as traffic. Each is routed by
Eq. 1 at fixed weights (latency weight 0, an idle pool) on the estimators of the moment, and scored by its
own labels before anything is learned from it: a prompt is never routed by estimators that saw it. The
model that answered gives one quality label (its real label, as a client's feedback would) and one answer
length, at that model only; every `refresh_every` prompts the estimators are refitted on what traffic gave
so far (estimators/refit.py's traffic fit, exactly as a refresh in the gateway does). A model with
fewer than `min_labels` labels is routed on the pessimistic prior and explored on `explore_share` of
the prompts (offered at the best quality, the least-labelled first: serving/explore.py's rule).

Starts: "none" (no labels at all: every model is explored until its labels come) and "synthetic" (the
built synthetic estimators' labelled rows as the base, the traffic labels folded in). With `added`, one
model joins the pool after `added_at` prompts, unlabelled, and its share of the picks is followed.

The level to reach is the offline one: the same weights on estimators trained on all the labels, out of
fold (`routebalance train --workload`'s report). Figures per block of prompts, the mean over seeds with a
95% interval across seeds (t-distribution).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gateway.estimators.crossfit import Pricing, eq1_picks
from gateway.estimators.refit import BuiltEstimate, RefitSettings, TrafficFit, TrafficLabels, fit_traffic
from gateway.records import MAX_OUTPUT_TOKENS
from gateway.serving.explore import least_labelled

PRIOR_LENGTH = 300.0  # tokens: a model no label speaks for yet (nothing built, no traffic)


@dataclass(frozen=True, slots=True)
class CurveSpec:
    weights: tuple[float, float, float] = (0.8, 0.0, 0.2)
    refresh_every: int = 50
    explore_share: float = 0.1
    min_labels: int = 20
    added: str | None = None  # a model that joins the pool late, unlabelled
    added_at: int = 0


@dataclass(frozen=True, slots=True)
class TrafficReplay:
    """One seed's run: per prompt in arrival order, its pick, the pick's label and cost, whether it explored."""

    order: np.ndarray
    picks: np.ndarray
    quality: np.ndarray
    cost: np.ndarray
    explored: np.ndarray


def replay(x: np.ndarray, labels: np.ndarray, lengths: np.ndarray, pricing: Pricing, models: tuple[str, ...],
           built: BuiltEstimate | None, built_models: tuple[str, ...], spec: CurveSpec, seed: int) -> TrafficReplay:
    """Route every prompt once, in a seeded order, learning from each after it is scored (module doc).
    `built`: the built estimators' estimate over `built_models` (the first of `models`), or None."""
    rng = np.random.default_rng(seed)
    n, m = labels.shape
    order = rng.permutation(n)
    clipped = np.minimum(lengths, MAX_OUTPUT_TOKENS).astype(np.float64)
    settings = RefitSettings(min_labels=spec.min_labels)
    q_rows: list[tuple[int, int, float]] = []  # (prompt row, model column, value)
    l_rows: list[tuple[int, int, float]] = []
    fit = TrafficFit(None, None, None, None)
    picks = np.empty(n, np.int64)
    explored = np.zeros(n, bool)
    for k, row in enumerate(order):
        if k % spec.refresh_every == 0:
            fit = fit_traffic(built, built_models, _traffic(x, q_rows), _traffic(x, l_rows), models, settings)
        present = [j for j, name in enumerate(models) if name != spec.added or k >= spec.added_at]
        quality, length = _estimate(x[row:row + 1], models, built, built_models, fit)
        headed = set(built_models) | set(fit.headed)
        unknown = [j for j in present if models[j] not in headed]
        known = [j for j in present if models[j] in headed]
        quality[0, unknown] = quality[0, known].min() if known else 0.5
        if unknown and rng.random() < spec.explore_share:  # the gateway's rule (serving/explore.py)
            quality[0, least_labelled({j: sum(c == j for _, c, _ in q_rows) for j in unknown}, rng)] = 1.0
            explored[k] = True
        sub = Pricing(pricing.price_in[present], pricing.price_out[present], pricing.input_len,
                      pricing.cost[:, present])
        chosen = eq1_picks(quality[:, present], length[:, present], sub, np.array([row]), spec.weights)
        pick = present[int(chosen[0])]
        picks[k] = pick
        q_rows.append((row, pick, float(labels[row, pick])))
        l_rows.append((row, pick, float(clipped[row, pick])))
    return TrafficReplay(order, picks, labels[order, picks], pricing.cost[order, picks], explored)


def _traffic(x: np.ndarray, rows: list[tuple[int, int, float]]) -> TrafficLabels:
    if not rows:
        return TrafficLabels.empty(x.shape[1])
    r = np.array([a for a, _, _ in rows])
    return TrafficLabels(x[r], np.array([c for _, c, _ in rows]), np.array([v for _, _, v in rows], np.float64),
                         np.ones(len(rows)), np.zeros(len(rows), bool), r.astype(str).astype(object))


def _estimate(x: np.ndarray, models: tuple[str, ...], built: BuiltEstimate | None, built_models: tuple[str, ...],
              fit: TrafficFit) -> tuple[np.ndarray, np.ndarray]:
    """(quality, length) over `models` for the prompts x: built, then the traffic fit; NaN quality and the prior
    length for a model neither speaks for (the caller fills its quality)."""
    quality = np.full((len(x), len(models)), np.nan)
    length = np.full((len(x), len(models)), PRIOR_LENGTH)
    if built is not None:
        quality[:, :len(built_models)], length[:, :len(built_models)] = built(x)
    fit.apply(x, models, quality, length)
    return quality, length


def blocks(values: np.ndarray, size: int) -> np.ndarray:
    """(seeds, n) per-prompt values -> (seeds, blocks) block means (the last, partial block dropped)."""
    whole = values.shape[1] // size
    return values[:, :whole * size].reshape(values.shape[0], whole, size).mean(axis=2)


def interval(per_seed: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mean over seeds (axis 0) and a 95% t-interval across them."""
    from scipy.stats import t

    s = per_seed.shape[0]
    mean = per_seed.mean(axis=0)
    if s < 2:
        return mean, mean, mean
    half = t.ppf(0.975, s - 1) * per_seed.std(axis=0, ddof=1) / np.sqrt(s)
    return mean, mean - half, mean + half


def run(config, workload: str, seeds: int, spec: CurveSpec, starts: tuple[str, ...], out_dir=None,
        block: int = 100) -> str:
    """TrafficReplay `workload` from each start on `seeds` seeds; the per-block table as text, and, with `out_dir`,
    learning_curve.csv and learning_curve.png there."""
    from pathlib import Path

    from gateway.lab.training.build import built_estimators, checked_workload
    from gateway.lab.training.routing_report import pricing_of
    from gateway.records import read_jsonl

    records = read_jsonl(workload)
    models = checked_workload(records, config, workload)
    if spec.added is not None and spec.added not in models:
        raise ValueError(f"--added {spec.added!r} is not a model of {workload}: {', '.join(models)}")
    estimators = built_estimators(config)
    x = estimators.embedder.embed([r.prompt for r in records])
    labels = np.array([[r.models[m].score for m in models] for r in records], dtype=np.float64)
    lengths = np.array([[r.models[m].output_length for m in models] for r in records], dtype=np.float64)
    pricing = pricing_of(records, config, models)
    rows, lines = [], [f"{len(records)} prompts of {workload} replayed as traffic, {seeds} seeds, weights "
                       f"{spec.weights} (quality, latency, cost), refit every {spec.refresh_every}, explore share "
                       f"{spec.explore_share}; per block of {block} prompts, in arrival order: mean correct and USD "
                       f"per 1k requests [95% interval over seeds]" + (f"; {spec.added} joins after {spec.added_at}"
                                                                        if spec.added else "")]
    for start in starts:
        built, built_models = None, ()
        if start == "synthetic":
            built_models = tuple(estimators.knn.models)
            if built_models != tuple(models[:len(built_models)]):
                raise ValueError(f"the built estimators label {built_models}, the file {models}: the synthetic "
                                 "start needs the same models first")
            built = estimators.built_estimate
        runs = [replay(x, labels, lengths, pricing, models, built, built_models, spec, seed) for seed in range(seeds)]
        quality = interval(blocks(np.stack([r.quality for r in runs]), block))
        cost = interval(blocks(np.stack([r.cost for r in runs]) * 1000, block))
        share = None
        if spec.added:  # a share's interval stays within [0, 1]
            mean, lo, hi = interval(blocks(np.stack([r.picks == models.index(spec.added) for r in runs]).astype(float),
                                           block))
            share = (mean, np.clip(lo, 0, 1), np.clip(hi, 0, 1))
        lines.append(f"start: {start}")
        for b in range(len(quality[0])):
            row = {"start": start, "block": b, "prompts_seen": b * block, "quality": quality[0][b],
                   "quality_lo": quality[1][b], "quality_hi": quality[2][b], "usd_per_1k": cost[0][b],
                   "usd_per_1k_lo": cost[1][b], "usd_per_1k_hi": cost[2][b]}
            text = (f"  prompts {b * block:>4}-{(b + 1) * block - 1:<4} correct {quality[0][b]:.3f} "
                    f"[{quality[1][b]:.3f}, {quality[2][b]:.3f}]  USD/1k {cost[0][b]:.4f} "
                    f"[{cost[1][b]:.4f}, {cost[2][b]:.4f}]")
            if share is not None:
                row |= {"added_share": share[0][b], "added_share_lo": share[1][b], "added_share_hi": share[2][b]}
                text += f"  {spec.added} share {share[0][b]:.2f} [{share[1][b]:.2f}, {share[2][b]:.2f}]"
            rows.append(row)
            lines.append(text)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = "learning_curve" + ("_added" if spec.added else "")
        columns = list(rows[0])
        (out / f"{name}.csv").write_text(",".join(columns) + "\n" + "".join(
            ",".join(f"{r.get(c, '')}" for c in columns) + "\n" for r in rows))
        _plot(rows, starts, spec, out / f"{name}.png")
        lines.append(f"written: {out / name}.csv, .png")
    return "\n".join(lines)


def _plot(rows: list[dict], starts: tuple[str, ...], spec: CurveSpec, path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = 3 if spec.added else 2
    fig, axes = plt.subplots(1, panels, figsize=(4.2 * panels, 3.4))
    for start in starts:
        mine = [r for r in rows if r["start"] == start]
        seen = [r["prompts_seen"] for r in mine]
        for ax, key in zip(axes, ("quality", "usd_per_1k", "added_share"), strict=False):
            if key not in mine[0]:
                continue
            ax.plot(seen, [r[key] for r in mine], marker="o", label=f"from {start}")
            if f"{key}_lo" in mine[0]:
                ax.fill_between(seen, [r[f"{key}_lo"] for r in mine], [r[f"{key}_hi"] for r in mine], alpha=0.2)
    for ax, title in zip(axes, ("mean correct", "USD per 1k requests", f"share of {spec.added}"), strict=False):
        ax.set_title(title)
        ax.set_xlabel("prompts served before the block")
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
