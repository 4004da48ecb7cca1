"""The money of one request: its budget across attempts, and its key's spend.

Every attempt is paid for. One that reached its instance and failed costs its
prompt (the instance read it); one that answered costs what its usage says.
So a retry spends from what the first attempt left of the budget, and the
key is booked for both. Before each attempt the attempt's worst case (the
prompt plus the clamped max_tokens for each of the n answers; the whole
context for a prompt with images or audio, which the gateway cannot count) is
reserved against the key, so concurrent requests of one key cannot take it
past its limit together; an attempt whose real cost passes its reservation
(a prompt that tokenises longer than counted) overspends by that difference.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from gateway.api.errors import ApiError
from gateway.config.sections import ApiKey
from gateway.core.budget import predicted_cost, token_prices
from gateway.tenancy.spend.sqlite import Reservation, SpendStoreError

log = logging.getLogger("routebalance.accounting")


def spend_limit_error(key: ApiKey, reserve_usd: float | None = None, left_usd: float | None = None) -> ApiError:
    """402 for a key at its limit; with `reserve_usd`, for one whose remaining spend cannot hold an attempt's
    worst case, which the message says, with both amounts (the key is not at its limit: `keys list` shows
    money left)."""
    period = "period" if key.period == "total" else key.period
    if reserve_usd is None:
        return ApiError(402, f"the key {key.name!r} has reached its spend limit of {key.spend_limit_usd} USD "
                             f"for this {period}", None, "spend_limit_exceeded")
    left = "" if left_usd is None else f" ({left_usd:.8f} USD left of {key.spend_limit_usd} USD this {period})"
    return ApiError(402, f"the key {key.name!r} cannot reserve this request's worst case of {reserve_usd:.8f} USD "
                         f"within its spend limit{left}: an attempt holds what it could cost at most (its prompt and "
                         f"max_tokens of answer, or the instance's whole context for a prompt with images or audio) "
                         f"until its real cost is known", "max_tokens", "spend_limit_exceeded")


def store_error(e: SpendStoreError) -> ApiError:
    log.error("the spend ledger failed: %s", e)
    return ApiError(503, "the spend ledger is unavailable; requests of keys are refused until it is back",
                    None, "ledger_unavailable", headers={"Retry-After": "5"})


def worst_case_usd(instance, input_tokens: int, max_tokens: int | None, n: int, has_media: bool = False) -> float:
    """The most an attempt can cost: the prompt, and max_tokens (else all the context left) per answer.
    A prompt with images or audio may be far longer than its counted text: up to the whole context."""
    prompt = instance.max_model_len if has_media else input_tokens
    answer = max_tokens if max_tokens is not None else max(instance.max_model_len - input_tokens, 1)
    return float(predicted_cost(prompt, answer * n, *token_prices(instance)))


class KeyLedger(Protocol):
    """The spend ledger a request draws on: this process's own (tenancy/spend/sqlite.py), one shared by a host's
    workers (tenancy/spend/host.py) or one shared by replicas (tenancy/spend/redis.py)."""

    async def refresh(self, key: ApiKey, now: float) -> None: ...
    def remaining(self, key: ApiKey, now: float) -> float | None: ...
    async def acquire(self, key: ApiKey, amount_usd: float, now: float) -> Reservation | None: ...
    def settle(self, reservation: Reservation, cost_usd: float) -> None: ...
    def release(self, reservation: Reservation) -> None: ...
    async def aclose(self, timeout_s: float) -> None: ...
    @property
    def unwritten(self) -> int: ...


class RequestSpend:
    """What one request may still spend and what it has paid; `clock` gives epoch seconds
    (spend periods are calendar days and months)."""

    def __init__(self, budget_usd: float | None, key: ApiKey | None, ledger: KeyLedger | None,
                 clock: Callable[[], float]):
        self.budget_usd = budget_usd
        self.key = key if key is not None and ledger is not None else None
        self.ledger = ledger
        self.clock = clock
        self.paid_usd = 0.0

    async def load(self) -> None:
        """Read the key's spend before planning with it (a shared ledger asks its server)."""
        if self.key is not None and self.ledger is not None:
            try:
                await self.ledger.refresh(self.key, self.clock())
            except SpendStoreError as e:
                raise store_error(e) from None

    def key_remaining(self) -> float | None:
        if self.key is None or self.ledger is None:
            return None
        try:
            return self.ledger.remaining(self.key, self.clock())
        except SpendStoreError as e:
            raise store_error(e) from None

    def budget_left(self) -> float | None:
        """What the next attempt may cost: the request's budget less what it paid, capped by its key's remaining
        spend; None when neither bounds it."""
        bounds = [v for v in (self.own_left(), self.key_remaining()) if v is not None]
        return min(bounds) if bounds else None

    def own_left(self) -> float | None:
        return None if self.budget_usd is None else max(self.budget_usd - self.paid_usd, 0.0)

    def limited_by_key(self) -> bool:
        """The key's remaining spend, not the request's budget, is what binds."""
        key_left, own = self.key_remaining(), self.own_left()
        return key_left is not None and (own is None or key_left < own)

    def refusal(self) -> ApiError:
        """Why no attempt could be paid for."""
        if self.key is not None and self.limited_by_key():
            return spend_limit_error(self.key)
        return ApiError(402, "the budget cannot pay for this prompt on any remaining candidate",
                        "routing.budget_usd", "insufficient_budget")

    async def hold(self, worst_usd: float) -> Reservation | None:
        """A reservation of one attempt's worst case against the key (several may be in flight at once: progressive
        mode's calls), to be given to `pay_held`; None without a key; 402 if the key cannot cover it."""
        if self.key is None or self.ledger is None:
            return None
        try:
            held = await self.ledger.acquire(self.key, worst_usd, self.clock())
        except SpendStoreError as e:
            raise store_error(e) from None
        if held is None:
            raise spend_limit_error(self.key, worst_usd, self.key_remaining())
        return held

    def pay_held(self, held: Reservation | None, cost_usd: float) -> None:
        """A call over `held` is over and cost this much: the request and its key are charged once."""
        self.paid_usd += cost_usd
        if held is not None and self.ledger is not None:
            if cost_usd == 0:  # it never reached an instance, or was refused: nothing to book
                self.ledger.release(held)
                return
            try:
                self.ledger.settle(held, cost_usd)
            except SpendStoreError as e:  # kept in memory by the ledger, written with the next booking
                log.error("booking %.10f USD for key %s failed (kept, retried with the next): %s",
                          cost_usd, held.key, e)
