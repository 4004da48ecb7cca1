"""What flows through the scheduling loop: requests, their estimates, decisions and outcomes.

Plain data, no behaviour: the loop (core/loop.py) moves a Ticket from
arrival to completion, a policy turns a batch of RouteRequests (and, if it
asks for them, their Estimates) into Decisions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gateway.core.settings import CoreConfig


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """One request waiting for its instance, with its routing controls resolved."""

    candidates: tuple[int, ...]  # indices into the config's instances this request may use
    prompt_text: str  # what the estimators see
    input_tokens: int  # counted (or estimated) prompt tokens, for the cost estimate
    max_tokens: int | None  # what the client asked for
    weights: tuple[float, float, float]  # Eq. 1 weights: quality, latency, cost (sum 1)
    budget_usd: float | None = None  # the request's own budget, or its key's remaining spend if smaller
    policy: str = "routebalance"  # a registered policy's name
    n: int = 1  # answers generated per request (OpenAI's n, or best_of): each is paid for
    slo_s: float | None = None  # end-to-end SLO, seconds from arrival to the answer's end (None: none)
    tpot_slo_s: float | None = None  # bound on the time per output token (end-to-end / answer tokens)
    slo_class: str = "none"  # the class slo_s falls in (core/slo.py), for metrics and grouping
    to_max_tokens: bool = False  # the answer runs to max_tokens (vLLM's ignore_eos, no stop strings)
    explore: bool = True  # may be sent to a model without labels to learn about it (its key learns)
    # Chained hashes of the prompt's full token blocks (core/prefix.py), salted per key where asked; empty when
    # the gateway does not look at prefixes (prefix_cache "off", a policy that reads no cache, no tokenizer).
    prefix: tuple[int, ...] = ()
    session: str | None = None  # the conversation it belongs to, where the client says (OpenAI's `user`)


@dataclass(frozen=True, slots=True)
class Estimates:
    """Per-request, per-instance predictions for a batch (instance columns, not model columns)."""

    quality: np.ndarray  # (n, I) predicted quality in [0, 1] of the instance's model
    length: np.ndarray  # (n, I) predicted answer tokens of the instance's model
    embeddings: np.ndarray | None = None  # (n, d) L2-normalised prompt embeddings

    def rows(self, rows: list[int]) -> Estimates:
        """The estimates of these requests of the batch, in this order."""
        if rows == list(range(len(self.quality))):
            return self
        idx = np.array(rows, dtype=np.int64)
        return Estimates(self.quality[idx], self.length[idx], None if self.embeddings is None else self.embeddings[idx])

    def bounded(self, requests: Sequence[RouteRequest]) -> Estimates:
        """The lengths as the requests bound them: cut at max_tokens (an answer cannot run past it), and
        max_tokens itself for an answer that runs to it (`to_max_tokens`)."""
        limits = np.array([np.inf if r.max_tokens is None else r.max_tokens for r in requests], dtype=np.float64)
        if np.isinf(limits).all():
            return self
        length = np.minimum(self.length, limits[:, None])
        exact = [k for k, r in enumerate(requests) if r.to_max_tokens and r.max_tokens is not None]
        length[exact] = limits[exact, None]
        return Estimates(self.quality, length, self.embeddings)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a request is not served, as the client will hear it."""

    status: int  # HTTP status: 402 budget, 503 policy unavailable, ...
    message: str
    reason: str  # short label for metrics: "budget", "policy_unavailable", ...
    param: str | None = None
    code: str | None = None
    final: bool = False  # an immediate retry cannot change it (told to clients as "do not retry")


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request goes: `ranked[0]`, then the rest in order if it fails before its first byte."""

    ranked: tuple[int, ...]
    quality: float | None = None  # predictions for ranked[0], reported in headers and metrics
    cost_usd: float | None = None
    latency_s: float | None = None
    tokens: float | None = None  # the answer ranked[0] is predicted to give, within the request's max_tokens
    answer_tokens: float | None = None  # the estimators' whole answer on ranked[0]'s model, max_tokens aside
    cached_tokens: float | None = None  # prompt tokens ranked[0] is predicted to hold cached (None: not known)
    refused: Refusal | None = None
    detail: Any = None  # what the deciding policy keeps of its decision for its later hooks


@dataclass(frozen=True, slots=True)
class DispatchPlan:
    """One attempt: the instance, and the max_tokens to send it (the budget's clamp applied)."""

    instance: int  # index into the ticket's config's instances
    max_tokens: int | None
    clamped: bool  # the budget lowered max_tokens below what the client asked


@dataclass(frozen=True, slots=True)
class Completion:
    """How a request ended, for policies that learn (on_complete)."""

    ok: bool
    instance: int | None  # where it was served (None: never dispatched)
    completion_tokens: int = 0


@dataclass(eq=False, slots=True)
class Ticket:
    """One request from arrival to completion; also its key in the pool state.

    `model` is what the client asked for, so the candidates can be found again
    if the config is reloaded while the request waits; `config` is the config
    whose instance indices the candidates (and, once decided, the decision)
    use. `handle` is the driver's own (a future live, a request index in the
    simulator).
    """

    request: RouteRequest
    model: str
    streaming: bool
    config: CoreConfig = field(repr=False)
    arrived: float = 0.0
    handle: Any = field(default=None, repr=False)
    decision: Decision | None = None
    decided_by: Any = field(default=None, repr=False)  # the policy object that decided it (it hears the hooks)
    booked_on: str | None = None  # the instance it is entered under in the pool state
    plan: DispatchPlan | None = None  # the plan it was booked on (its first attempt's, if nothing changed)
    first_token_at: float | None = None  # when its first answer token came back (a stream's client saw it)
    evictions: int = 0  # times a policy aborted its attempt and held it again
    estimated_by: int | None = None  # the version of the estimators whose estimates decided it (a header says)
    explored: bool = False  # its estimates offered it a model without labels, to explore (serving/explore.py)

    @property
    def evictable(self) -> bool:
        """Its client has seen no byte of the answer, so an abort and a second attempt stay invisible;
        a budgeted request is never evicted (its aborted attempt would eat its budget)."""
        return not (self.streaming and self.first_token_at is not None) and self.request.budget_usd is None
