"""What the prefix baselines share: ranking with seeded random ties, and the prefix a candidate holds."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from gateway.core.request import RouteRequest
from gateway.core.view import PoolView


def ranked(cands: Sequence[int], rng: np.random.Generator, *keys: np.ndarray) -> list[int]:
    """`cands` sorted by `keys` (the first is the primary, each ascending), ties in a random order.

    Ties go at random, not by index, so an idle pool or a fresh start does not
    herd every decision onto the lowest-numbered instance.
    """
    if len(cands) < 2:
        return list(cands)
    tie = rng.random(len(cands))
    order = np.lexsort((tie, *reversed(keys)))  # lexsort's last key is the primary one
    return [cands[k] for k in order]


def cached_tokens(view: PoolView, req: RouteRequest, idx: np.ndarray) -> np.ndarray | None:
    """Per candidate in `idx`, the prompt tokens it is believed to hold cached; None when the gateway looks at no
    prefixes ([scheduler] prefix_cache = "off")."""
    if not view.knows_prefixes:
        return None
    return view.cached_tokens(req.prefix, req.input_tokens)[idx]


def match_share(cached: np.ndarray | None, input_tokens: int, n: int) -> np.ndarray:
    """Share of the prompt each of `n` candidates holds cached, in [0, 1] (zeros when nothing is known)."""
    if cached is None or input_tokens <= 0:
        return np.zeros(n)
    return np.clip(cached / input_tokens, 0.0, 1.0)
