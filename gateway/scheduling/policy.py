"""The one interface every routing policy implements, and the data it works on.

A policy gets a batch of requests, the batch's estimates and a view of the
pool, and returns one Decision per request. It does no I/O and reads no
clock: the shell builds the view, so the live server and the simulator drive
the same code. A policy may update the view as it assigns (dead reckoning),
so later requests of the batch see the work the earlier ones added.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request waiting for its instance, with its routing controls resolved."""

    candidates: tuple[int, ...]  # indices into PoolView.instances this request may use
    prompt_text: str  # what the estimators see
    input_tokens: int  # counted (or estimated) prompt tokens, for the cost estimate
    max_tokens: int | None  # what the client asked for
    weights: tuple[float, float, float]  # Eq. 1 weights: quality, latency, cost (sum 1)
    budget_usd: float | None = None
    policy: str = "routebalance"  # a key of policies.POLICIES, or "<router>+<dispatcher>"


@dataclass(frozen=True, slots=True)
class Estimates:
    """Per-request, per-instance predictions for a batch (instance columns, not model columns)."""

    quality: np.ndarray  # (n, I) predicted quality in [0, 1] of the instance's model
    length: np.ndarray  # (n, I) predicted answer tokens of the instance's model
    embeddings: np.ndarray | None = None  # (n, d) L2-normalised prompt embeddings


# Columns of PoolView.state: the instance half of latency.FEATURES.
RUNNING, WAITING, KV_USAGE, DECODE_RATE, IN_FLIGHT, PENDING_PREFILL, PENDING_DECODE = range(7)


@dataclass(slots=True)
class PoolView:
    """What the scheduler knows of the pool at one instant, as per-instance arrays.

    `state` is a working copy: policies add each dispatch to it (dead
    reckoning), so the next request of the batch sees the work the earlier
    ones added.
    """

    instances: tuple  # config.Instance, in config order
    available: np.ndarray  # bool: not known to be down
    state: np.ndarray  # (I, 7) float: the columns above, best known (last scrape + own accounting)
    max_num_seqs: np.ndarray
    price_in: np.ndarray  # USD per input token
    price_out: np.ndarray  # USD per output token
    tpot_prior_s: np.ndarray  # the tier's low-load seconds per output token
    tiers: tuple[str, ...]  # latency.tier_key of each instance

    @property
    def active(self) -> np.ndarray:
        """Requests on each instance, running or waiting."""
        return self.state[:, RUNNING] + self.state[:, WAITING]

    @property
    def pending_decode(self) -> np.ndarray:
        """Answer tokens still to generate on each instance."""
        return self.state[:, PENDING_DECODE]

    def usable(self, candidates: Sequence[int]) -> list[int]:
        """Candidates that are available, or all of them if none is (better to try than to refuse)."""
        up = [i for i in candidates if self.available[i]]
        return up or list(candidates)

    def dispatched(self, i: int, tokens: float, input_tokens: float = 0.0) -> None:
        """Dead reckoning: instance i got one more request of `tokens` predicted answer tokens."""
        s = self.state[i]
        # A request queues behind others already waiting (no free KV), or when every slot runs.
        s[RUNNING if s[RUNNING] < self.max_num_seqs[i] and s[WAITING] == 0 else WAITING] += 1
        s[IN_FLIGHT] += 1
        s[PENDING_PREFILL] += input_tokens
        s[PENDING_DECODE] += tokens


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes: `ranked[0]`, then the rest in order if it fails before its first byte."""

    ranked: tuple[int, ...]
    quality: float | None = None  # predictions for ranked[0], reported in headers and metrics
    cost_usd: float | None = None
    latency_s: float | None = None
    tokens: float | None = None
    refused: str | None = None  # why no candidate can serve it (the client gets HTTP 402)


class Policy(Protocol):
    name: str
    needs_estimates: bool  # the shell runs the estimators for batches this policy is in

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        """One Decision per request, its instances taken from that request's candidates."""
        ...
