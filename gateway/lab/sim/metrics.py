"""What a cell measured, from its outcomes: quality, latency, throughput, cost, mix, budgets, residual.

Pure functions over outcome records, so a simulated cell and a live run
(loadtest/live_check.py builds the same records from real answers) are
summarised by the same code. A cell run on several arrival seeds is reported
as the mean over its seeds of each figure, with a bootstrap interval for the
headline ones (stats.py), from compact per-request arrays of each run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gateway.core.slo import slo_met, time_per_token
from gateway.lab.sim.stats import Interval, bootstrap_many, bootstrap_mean, differences

PERCENTILES = (50, 95, 99)


def summarise(outcomes: Sequence, models: Sequence[str]) -> dict[str, float | dict]:
    """One flat row of figures for a cell (times in seconds, cost in USD per request).

    - quality: mean judged quality over every request (a refused one scores 0);
    - e2e / ttft: from arrival, over the requests that were served;
    - throughput: served requests over the span from the first arrival to the last answer;
    - residual: arrival to dispatch (batch wait + scheduler compute), the time a
      request spends in the gateway rather than on its instance;
    - budget_exhaustion: share of budgeted requests refused or cut short by their budget;
    - refused: share of requests refused (answered with an error, never served);
    - slo_attainment: share of the requests with an end-to-end SLO that were served within it
      (a refused one misses), and the same per SLO class (slo_by_class); NaN without SLOs;
    - tpot_mean: the QoS paper's time per output token (e2e over answer tokens), served requests;
    - decode_tpot_mean / _p50 / _p99: time per output token while decoding (first token to last, over the
      tokens after the first; vLLM's and ELDR's TPOT), over the served requests of two tokens or more;
    - qos: mean over every request of quality x [time per token <= its bound] (QoS paper Eq. 1;
      refused: 0); NaN when no request has a bound;
    - prefix_hit_rate: share of all prompt tokens the instances found in their prefix caches;
    - progressive cells only: progressive_share (requests served progressively), quality_oracle (quality
      if the expansions' models decide it, sim/progressive.py) and fallback_<reason> (share routed
      normally for that reason).
    """
    served = [o for o in outcomes if o.instance >= 0]
    if not outcomes:
        raise ValueError("no outcomes to summarise")
    e2e = np.array([o.finished - o.arrival for o in served])
    ttft = np.array([o.first_token - o.arrival for o in served if not math.isnan(o.first_token)])
    residual = np.array([o.dispatched - o.arrival for o in served])
    start = min(o.arrival for o in outcomes)
    end = max(o.finished for o in served) if served else start
    mix = Counter(models[o.instance] for o in served)
    budgeted = [o for o in outcomes if o.budget_usd is not None]
    row: dict[str, float | dict] = {
        "requests": len(outcomes),
        "served": len(served),
        "quality": float(np.mean([o.quality for o in outcomes])),
        "e2e_mean": _mean(e2e),
        "ttft_mean": _mean(ttft),
        "throughput": len(served) / (end - start) if end > start else 0.0,
        "cost_mean": float(np.mean([o.cost_usd for o in outcomes])),
        "prefix_hit_rate": (sum(o.cached_tokens for o in outcomes) / max(sum(o.prompt_tokens for o in outcomes), 1)),
        "residual_mean": _mean(residual),
        "budget_exhaustion": (sum(1 for o in budgeted if o.instance < 0 or o.budget_cut) / len(budgeted)
                              if budgeted else 0.0),
        "refused": 1.0 - len(served) / len(outcomes),
        "mix": {m: mix.get(m, 0) / len(outcomes) for m in dict.fromkeys(models)},
    }
    arrays = RequestArrays.of(outcomes, models)
    row["slo_attainment"] = _nanmean(arrays.slo_ok)
    row["slo_by_class"] = {c: _nanmean(arrays.slo_ok[arrays.slo_class == k]) for k, c in enumerate(arrays.classes)}
    row["tpot_mean"] = _nanmean(arrays.tpot)
    row["decode_tpot_mean"] = _nanmean(arrays.decode_tpot)
    decoded = arrays.decode_tpot[~np.isnan(arrays.decode_tpot)]
    row["decode_tpot_p50"] = _pct(decoded, 50)
    row["decode_tpot_p99"] = _pct(decoded, 99)
    row["qos"] = _nanmean(arrays.qos)
    for p in PERCENTILES:
        row[f"e2e_p{p}"] = _pct(e2e, p)
        row[f"ttft_p{p}"] = _pct(ttft, p)
        row[f"residual_p{p}"] = _pct(residual, p)
    row["e2e_p90"] = _pct(e2e, 90)
    modes = Counter(o.mode for o in outcomes)
    if set(modes) != {"normal"}:  # progressive cells (sim/progressive.py)
        row["progressive_share"] = modes["progressive"] / len(outcomes)
        row["quality_oracle"] = float(np.mean([o.quality if math.isnan(o.quality_oracle) else o.quality_oracle
                                              for o in outcomes]))
        row |= {f"fallback_{m}": c / len(outcomes) for m, c in sorted(modes.items()) if m != "progressive"}
    return row


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else math.nan


def _nanmean(x: np.ndarray) -> float:
    return float(np.nanmean(x)) if len(x) and not np.isnan(x).all() else math.nan


def _pct(x: np.ndarray, p: float) -> float:
    return float(np.percentile(x, p)) if len(x) else math.nan


# ---- several seeds of one cell ------------------------------------------------------

# The figures reported with a 95% interval (`<name>_lo`, `<name>_hi`) when a cell runs on several seeds.
# SLO figures get one only in cells whose requests carry SLOs.
HEADLINE = ("quality", "e2e_mean", "e2e_p99", "ttft_mean", "ttft_p50", "ttft_p99", "cost_mean", "throughput",
            "budget_exhaustion", "refused", "slo_attainment", "qos", "tpot_mean", "decode_tpot_p50", "decode_tpot_p99",
            "prefix_hit_rate")
PAIRED = ("quality", "e2e_mean")  # the figures a paired comparison of two cells reports


@dataclass(frozen=True, slots=True)
class RequestArrays:
    """One run's outcomes, one entry per request in request order: what a sweep keeps of each seed.

    NaN marks a figure a request does not have (no E2E when refused, no TTFT without a first token).
    """

    quality: np.ndarray  # judged quality of what was served (0 if refused or cut short by its budget)
    e2e: np.ndarray  # s, arrival to last token
    ttft: np.ndarray  # s, arrival to first token
    cost: np.ndarray  # USD
    tier: np.ndarray  # int8: index in `tiers` of the model that served it, -1 if refused
    tiers: tuple[str, ...]  # the pool's models, in config order, each once
    budgeted: np.ndarray  # bool: it carried a budget
    budget_cut: np.ndarray  # bool: its budget ended the answer early
    slo_ok: np.ndarray  # 1 served within its end-to-end SLO, 0 not (late or refused), NaN without an SLO
    slo_class: np.ndarray  # int8: index in `classes` of its SLO class
    classes: tuple[str, ...]  # the SLO classes of the run, in order of first appearance
    tpot: np.ndarray  # s per answer token, arrival to last token (NaN if refused)
    qos: np.ndarray  # quality x [tpot <= its bound] (0 if refused), NaN without a bound
    decode_tpot: np.ndarray  # s per answer token after the first, first token to last (NaN: refused, < 2 tokens)
    # cached prompt tokens over the run's mean prompt tokens: its mean is the run's prefix hit rate
    cached_share: np.ndarray

    @classmethod
    def of(cls, outcomes: Sequence, models: Sequence[str]) -> RequestArrays:
        tiers = tuple(dict.fromkeys(models))
        tier_of_instance = np.array([tiers.index(m) for m in models] + [-1], dtype=np.int8)  # [-1]: refused
        instance = np.array([o.instance for o in outcomes])
        served = instance >= 0
        arrival = np.array([o.arrival for o in outcomes])
        finished = np.array([o.finished for o in outcomes])
        e2e = np.where(served, finished - arrival, np.nan)
        tokens = np.array([o.completion_tokens for o in outcomes])
        tpot = np.where(served, [time_per_token(e, t) for e, t in zip(e2e, tokens, strict=True)], np.nan)
        slo = np.array([np.nan if o.slo_s is None else o.slo_s for o in outcomes], dtype=float)
        bound = np.array([np.nan if o.tpot_slo_s is None else o.tpot_slo_s for o in outcomes], dtype=float)
        quality = np.array([o.quality for o in outcomes], dtype=float)
        first = np.array([o.first_token for o in outcomes], dtype=float)
        decoding = served & (tokens > 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            decode_tpot = np.where(decoding, (finished - first) / np.maximum(tokens - 1, 1), np.nan)
        classes = tuple(dict.fromkeys(o.slo_class for o in outcomes))
        return cls(
            quality=quality,
            e2e=e2e,
            ttft=np.where(served, np.array([o.first_token for o in outcomes]) - arrival, np.nan),
            cost=np.array([o.cost_usd for o in outcomes], dtype=float),
            tier=tier_of_instance[instance],
            tiers=tiers,
            budgeted=np.array([o.budget_usd is not None for o in outcomes]),
            budget_cut=np.array([o.budget_cut for o in outcomes]),
            slo_ok=np.where(np.isnan(slo), np.nan,
                            (served & slo_met(np.nan_to_num(e2e, nan=np.inf), slo)).astype(float)),
            slo_class=np.array([classes.index(o.slo_class) for o in outcomes], dtype=np.int8),
            classes=classes,
            tpot=tpot,
            qos=np.where(np.isnan(bound), np.nan,
                         np.where(served & slo_met(np.nan_to_num(tpot, nan=np.inf), bound), quality, 0.0)),
            decode_tpot=decode_tpot,
            cached_share=np.array([o.cached_tokens for o in outcomes], dtype=float)
            / max(float(np.mean([o.prompt_tokens for o in outcomes])), 1.0),
        )

    @property
    def refused(self) -> np.ndarray:
        return (self.tier < 0).astype(float)

    @property
    def budget_exhausted(self) -> np.ndarray:
        """1 if refused or cut short by its budget, 0 if not; NaN for a request without a budget."""
        return np.where(self.budgeted, ((self.tier < 0) | self.budget_cut).astype(float), np.nan)


def request_figures(runs: Sequence[RequestArrays]) -> dict[str, tuple[np.ndarray, str | float]]:
    """The headline figures read per request, as summarise reads them: name -> ((seeds x requests), statistic)."""
    def stacked(of) -> np.ndarray:
        return np.stack([of(r) for r in runs])

    exhausted = stacked(lambda r: r.budget_exhausted)
    if np.isnan(exhausted).all():
        exhausted = np.zeros_like(exhausted)  # no budgets: summarise reports 0, and so does its interval
    e2e, ttft = stacked(lambda r: r.e2e), stacked(lambda r: r.ttft)
    figures = {"quality": (stacked(lambda r: r.quality), "mean"), "e2e_mean": (e2e, "mean"), "e2e_p90": (e2e, 90.0),
               "e2e_p99": (e2e, 99.0), "ttft_mean": (ttft, "mean"), "ttft_p50": (ttft, 50.0),
               "ttft_p99": (ttft, 99.0), "prefix_hit_rate": (stacked(lambda r: r.cached_share), "mean"),
               "cost_mean": (stacked(lambda r: r.cost), "mean"),
               "budget_exhaustion": (exhausted, "mean"), "refused": (stacked(lambda r: r.refused), "mean"),
               "tpot_mean": (stacked(lambda r: r.tpot), "mean")}
    decode = stacked(lambda r: r.decode_tpot)
    if not np.isnan(decode).all():  # some answer has two tokens or more
        figures |= {"decode_tpot_mean": (decode, "mean"), "decode_tpot_p50": (decode, 50.0),
                    "decode_tpot_p99": (decode, 99.0)}
    for name in ("slo_ok", "qos"):  # only where requests carry the SLO
        values = stacked(lambda r, name=name: getattr(r, name))
        if not np.isnan(values).all():
            figures["slo_attainment" if name == "slo_ok" else name] = (values, "mean")
    return figures


def mean_over_seeds(rows: Sequence[dict]) -> dict:
    """One row from a cell's per-seed rows: each number averaged, the tier mix per model; the rest as it is."""
    out: dict = {}
    for key, first in rows[0].items():
        values = [r[key] for r in rows]
        if isinstance(first, dict):
            out[key] = {k: float(np.mean([v[k] for v in values])) for k in first}
        elif all(v == first for v in values) or isinstance(first, str | bool) or first is None:
            out[key] = first  # what the cell is (its rate, weights, labels), or a figure every seed agrees on
        else:
            out[key] = float(np.mean(values))
    return out


def with_intervals(row: dict, seed_rows: Sequence[dict], runs: Sequence[RequestArrays], **kw) -> dict:
    """`row` with `<name>_lo` and `<name>_hi` after each headline figure (keywords: stats.bootstrap_many's)."""
    intervals = bootstrap_many(request_figures(runs), **kw)
    # Throughput is a figure of a whole run: its interval comes from the seeds alone.
    intervals["throughput"] = bootstrap_mean(np.array([[r["throughput"]] for r in seed_rows]), **kw)
    out = {}
    for key, value in row.items():
        out[key] = value
        if key in intervals:
            out[f"{key}_lo"], out[f"{key}_hi"] = _bounds(value, intervals[key])
    return out


def _bounds(value: float, interval: Interval) -> tuple[float, float]:
    """The interval around the row's own figure (the two agree up to rounding; the row's is the reported one)."""
    if math.isnan(interval.lo):
        return interval.lo, interval.hi
    return min(interval.lo, value), max(interval.hi, value)


def paired_differences(runs_a: Sequence[RequestArrays], runs_b: Sequence[RequestArrays],
                       figures: Sequence[str] = PAIRED, **kw) -> dict[str, Interval]:
    """Cell A minus cell B for each of `figures`, on the same seeds and prompts, with paired intervals."""
    a, b = request_figures(runs_a), request_figures(runs_b)
    return differences({k: a[k] for k in figures}, {k: b[k] for k in figures}, **kw)
