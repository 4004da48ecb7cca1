"""Pipeline-mode model routers: one model name per request (None: no preference).

A router sees each request's usable candidate instances and answers with the
model of one of them, never a model the request cannot use, so the dispatcher
always has an instance to place it on. Estimates come in per instance column;
a model's prediction is the value at any of its instances.

The learned routers have their own modules and config tables: Avengers-Pro in
avengers.py (`[policies.avengers]`), BEST-Route in best_route.py
(`[policies.best_route]`). This module holds the interface, passthrough and
what they share.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

from gateway.core.budget import token_prices
from gateway.core.policy import LIGHT_COMPUTE_S
from gateway.core.request import Estimates, RouteRequest
from gateway.core.view import PoolView


class Router(Protocol):
    name: str
    needs_estimates: bool

    def route(self, batch: Sequence[RouteRequest], usable: Sequence[Sequence[int]], estimates: Estimates | None,
              view: PoolView) -> list[str | None]:
        """One model (or None) per request; `usable[r]` are request r's usable candidate instances."""
        ...

    def compute_s(self, batch_size: int) -> float:
        """Seconds the router's scoring of a batch costs the (simulated) scheduler worker."""
        ...


class Passthrough:
    """No model choice: the dispatcher works over all of the request's candidates."""

    name = "passthrough"
    needs_estimates = False

    def route(self, batch, usable, estimates, view) -> list[str | None]:
        return [None] * len(batch)

    def compute_s(self, batch_size: int) -> float:
        return LIGHT_COMPUTE_S


def model_prices(instances: Iterable) -> dict[str, tuple[float, float]]:
    """Model -> (USD per input token, USD per output token); a model served at several prices gets their mean."""
    seen: dict[str, list[tuple[float, float]]] = {}
    for inst in instances:
        seen.setdefault(inst.model, []).append(token_prices(inst))
    return {m: (sum(p[0] for p in ps) / len(ps), sum(p[1] for p in ps) / len(ps)) for m, ps in seen.items()}


def priced_label_columns(label_models: Sequence[str], prices: Mapping[str, tuple[float, float]]) -> list[int]:
    """Columns of the labelled models that also have a price: only these can be scored (others are never picked)."""
    return [m for m, name in enumerate(label_models) if name in prices]


def models_of(cands: Sequence[int], view: PoolView) -> set[str]:
    return {view.instances[i].model for i in cands}
