"""Budget arithmetic for one request on one instance (paper Eq. 2 and the max_tokens clamp).

Prices here are USD per token; the config gives USD per 1M tokens (`per_token`).
The relay's streaming early-stop and the dispatch clamp both judge with
`within_budget`, so the tokens the clamp allows are never cut off by the stop.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

Amount = float | np.ndarray  # one value, or one per candidate instance

# Prices like 0.38e-6 are not exact in binary: a cost that equals the budget on
# paper may come out a hair above it, and that rounding must not cost a token.
REL_TOL = 1e-9


def per_token(price_per_mtok: float) -> float:
    """USD per token from the config's USD per 1M tokens."""
    return price_per_mtok / 1e6


class Priced(Protocol):
    """What the budget arithmetic reads of an instance: its prices, USD per 1M tokens."""

    @property
    def price_input_per_mtok(self) -> float: ...

    @property
    def price_output_per_mtok(self) -> float: ...


def token_prices(instance: Priced) -> tuple[float, float]:
    """An instance's (prompt, answer) prices in USD per token."""
    return per_token(instance.price_input_per_mtok), per_token(instance.price_output_per_mtok)


def price_arrays(instances: Sequence[Priced]) -> tuple[np.ndarray, np.ndarray]:
    """The (prompt, answer) prices of each instance, USD per token, as arrays over the instances."""
    pairs = np.array([token_prices(i) for i in instances], dtype=np.float64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def predicted_cost(input_tokens: Amount, output_tokens: Amount, price_in: Amount, price_out: Amount) -> Any:
    """USD for a prompt and an answer of these sizes (elementwise over arrays of candidates)."""
    return input_tokens * price_in + output_tokens * price_out


def within_budget(cost_usd: Amount, budget_usd: float) -> Any:
    """Whether a cost fits the budget (elementwise over an array of costs)."""
    return cost_usd <= budget_usd * (1 + REL_TOL)


def clamp_max_tokens(budget_usd: float, input_tokens: int, price_in: float, price_out: float,
                     requested: int | None = None, n: int = 1, ceiling: int | None = None) -> int | None:
    """The max_tokens to dispatch with: the least of `requested`, what the budget buys after
    the input for each of the `n` answers, and `ceiling` (the most the instance accepts,
    max_model_len minus the prompt).

    `requested` None means the client set no limit. Returns None only when the
    budget cannot pay the input plus one output token per answer, or when nothing
    bounds it (no request, no ceiling, and output free or a budget too large to matter).
    """
    if not within_budget(predicted_cost(input_tokens, n, price_in, price_out), budget_usd):
        return None
    cap = max(ceiling, 1) if ceiling is not None else None  # a prompt past the context is the instance's to refuse
    limits = [v for v in (requested, cap) if v is not None]
    if price_out > 0:
        buys = (budget_usd * (1 + REL_TOL) - input_tokens * price_in) / (price_out * n)
        # Compared as floats: a budget of 1e303 USD buys more tokens than an int can be made of.
        if math.isfinite(buys) and (not limits or buys < min(limits)):
            limits.append(math.floor(buys))
    return min(limits) if limits else None
