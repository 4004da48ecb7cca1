"""What a cell measured, from its outcomes: quality, latency, throughput, cost, mix, budgets, residual.

Pure functions over outcome records, so a simulated cell and a live run
(loadtest/live_check.py builds the same records from real answers) are
summarised by the same code.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 95, 99)


def summarise(outcomes: Sequence, models: Sequence[str]) -> dict[str, float | dict]:
    """One flat row of figures for a cell (times in seconds, cost in USD per request).

    - quality: mean judged quality over every request (a refused one scores 0);
    - e2e / ttft: from arrival, over the requests that were served;
    - throughput: served requests over the span from the first arrival to the last answer;
    - residual: arrival to dispatch (batch wait + scheduler compute), the time a
      request spends in the gateway rather than on its instance;
    - budget_exhaustion: share of budgeted requests refused or cut short by their budget.
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
        "residual_mean": _mean(residual),
        "budget_exhaustion": (sum(1 for o in budgeted if o.instance < 0 or o.budget_cut) / len(budgeted)
                              if budgeted else 0.0),
        "mix": {m: mix.get(m, 0) / len(outcomes) for m in dict.fromkeys(models)},
    }
    for p in PERCENTILES:
        row[f"e2e_p{p}"] = _pct(e2e, p)
        row[f"ttft_p{p}"] = _pct(ttft, p)
        row[f"residual_p{p}"] = _pct(residual, p)
    return row


def _mean(x: np.ndarray) -> float:
    return float(x.mean()) if len(x) else math.nan


def _pct(x: np.ndarray, p: float) -> float:
    return float(np.percentile(x, p)) if len(x) else math.nan
