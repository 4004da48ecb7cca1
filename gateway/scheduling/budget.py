"""Budget arithmetic for one request on one instance (paper Eq. 2 and the max_tokens clamp).

Prices here are USD per token; the config gives USD per 1M tokens (`per_token`).
The relay's streaming early-stop and the dispatch clamp both judge with
`within_budget`, so the tokens the clamp allows are never cut off by the stop.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

Amount = float | np.ndarray  # one value, or one per candidate instance

# Prices like 0.38e-6 are not exact in binary: a cost that equals the budget on
# paper may come out a hair above it, and that rounding must not cost a token.
REL_TOL = 1e-9


def per_token(price_per_mtok: float) -> float:
    """USD per token from the config's USD per 1M tokens."""
    return price_per_mtok / 1e6


def predicted_cost(input_tokens: Amount, output_tokens: Amount, price_in: Amount, price_out: Amount) -> Any:
    """USD for a prompt and an answer of these sizes (elementwise over arrays of candidates)."""
    return input_tokens * price_in + output_tokens * price_out


def within_budget(cost_usd: Amount, budget_usd: float) -> Any:
    """Whether a cost fits the budget (elementwise over an array of costs)."""
    return cost_usd <= budget_usd * (1 + REL_TOL)


def clamp_max_tokens(budget_usd: float, input_tokens: int, price_in: float, price_out: float,
                     requested: int | None = None) -> int | None:
    """The max_tokens to dispatch with: min(requested, what the budget buys after the input).

    `requested` None means the client set no limit. Returns None when the budget
    cannot pay the input plus one output token. Free output (price_out == 0) is
    not bounded by the budget, so `requested` comes back unchanged, None
    included: where output may be free, tell the two Nones apart by checking
    payability first (the scheduler's Eq. 2 filter does).
    """
    if price_out <= 0:
        return requested if within_budget(input_tokens * price_in, budget_usd) else None
    affordable = math.floor((budget_usd * (1 + REL_TOL) - input_tokens * price_in) / price_out)
    if affordable < 1:
        return None
    return affordable if requested is None else min(requested, affordable)
