"""The scheduling loop, once: batch forming, deciding, dispatch plans, the pool ledger.

The live server (gateway/scheduler.py: real time, sockets, a worker thread)
and the simulator (gateway/sim/simulator.py: virtual time, the engine model)
are two thin drivers of this object. A driver calls, in this order:

    submit(ticket, now)                     a request arrives (False: the queue is full)
    limit(cfg, now), fire_at(...)           when the next batch may fire
    take(cfg, limit, now)                   form the batch (the default policy's `order`)
    view(cfg, now); decide(...)             estimate once, admit and assign per policy
    settle(tickets, outcomes, now)          book each decided request on its first dispatch plan
    plans(ticket, now) / dispatched(...)    the ranked attempts, each with its budget clamp
    progress / first_token / complete       what came back; the ledger and the policy hear it

No clock is read and nothing here does I/O; estimating is a function the
driver passes in (the real estimators live, cached estimates simulated).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gateway.scheduling.batcher import BatchLimit, BatchQueue, batch_limit, busy_share
from gateway.scheduling.budget import clamp_max_tokens, per_token
from gateway.scheduling.ledger import PoolLedger
from gateway.scheduling.policies import registry
from gateway.scheduling.policies.base import Policy
from gateway.scheduling.request import Completion, Decision, DispatchPlan, Estimates, Refusal, Ticket
from gateway.scheduling.view import PoolView

EstimateFn = Callable[[Sequence[Ticket]], Estimates]  # the batch's tickets that need estimates -> their rows
Outcome = Decision | Exception  # what `decide` gives each ticket: a decision, or why its batch could not decide it


class PolicySet:
    """The policy objects of one config, each built on first use (a reload builds new ones)."""

    def __init__(self, config, estimators=None):
        self.config = config
        self.estimators = estimators
        self._built: dict[str, Policy | Refusal] = {}

    def built(self, name: str) -> bool:
        return name in self._built

    def get(self, name: str) -> Policy | Refusal:
        """The policy, or the Refusal its requests get when it cannot run."""
        found = self._built.get(name)
        if found is None:
            found = self._built[name] = self._build(name)
        return found

    def _build(self, name: str) -> Policy | Refusal:
        if registry.entry(name).needs_estimates and self.estimators is None:
            return Refusal(503, f"policy {name!r} needs the estimators, which are not built: run `routebalance train`",
                           "policy_unavailable")
        try:
            return registry.build(name, self.config, self.estimators)
        except ValueError as e:
            return Refusal(503, f"policy {name!r} is unavailable: {e}", "policy_unavailable")


class SchedulingLoop:
    """Requests from arrival to completion, for one process (live) or one cell (simulated)."""

    def __init__(self, ledger: PoolLedger, max_queue: int, resolve: Callable[[Any, str], tuple[int, ...]],
                 estimators=None):
        self.ledger = ledger
        self.queue: BatchQueue[Ticket] = BatchQueue(max_queue)
        self.resolve = resolve  # (config, model) -> candidate instance indices; raises if the model is gone
        self.estimators = estimators
        self.held: list[Ticket] = []  # decided, kept in the gateway by their policy's `hold`
        self._policies: PolicySet | None = None

    def policies(self, cfg) -> PolicySet:
        if self._policies is None or self._policies.config is not cfg:
            self._policies = PolicySet(cfg, self.estimators)
        return self._policies

    # ---- arrivals ------------------------------------------------------------
    def submit(self, ticket: Ticket, now: float) -> bool:
        """Queue a request for the next batch; False (nothing queued) if the queue is full."""
        ticket.arrived = now
        return self.queue.push(ticket, now)

    def withdraw(self, ticket: Ticket, now: float) -> None:
        """The client left before its request was dispatched: forget it wherever it is."""
        self.queue.remove(ticket)
        if ticket in self.held:
            self.held.remove(ticket)
        self.complete(ticket, Completion(False, None), now)

    # ---- batch forming -----------------------------------------------------------
    def limit(self, cfg, now: float) -> BatchLimit | None:
        """The window rule's (size, window) for the pool's state now; None in eager mode."""
        if cfg.batching.mode != "window":
            return None
        waiting = self.ledger.waiting(cfg.instances, now, cfg.telemetry.stale_after_s)
        return batch_limit(cfg.batching.rules, busy_share(waiting))

    def fire_at(self, limit: BatchLimit | None, now: float) -> float | None:
        """When the next batch may fire (now or later); None if nothing waits."""
        if not self.queue:
            return None
        if limit is None or self.queue.ready(limit, now):
            return now
        return self.queue.closes_at(limit)

    def take(self, cfg, limit: BatchLimit | None, now: float) -> tuple[list[Ticket], list[tuple[Ticket, Exception]]]:
        """The next batch, in the default policy's order, and the requests that failed to re-resolve
        their candidates under this config (their model left the pool with a reload)."""
        size = limit.size if limit is not None else max(rule.size for rule in cfg.batching.rules)
        default = self.policies(cfg).get(cfg.scheduler.policy)
        order = None
        if isinstance(default, Policy) and default.overrides("order"):
            view = self.view(cfg, now)

            def order(waiting: list[Ticket]) -> Sequence[Ticket]:
                return default.order(waiting, view, now)
        batch, failed = [], []
        for _, ticket in self.queue.take(size, order):
            try:
                self._current_candidates(cfg, ticket)
            except Exception as e:  # whatever the resolver raised goes back to that request alone
                failed.append((ticket, e))
                continue
            batch.append(ticket)
        return batch, failed

    def _current_candidates(self, cfg, ticket: Ticket) -> None:
        if ticket.config is not cfg:
            ticket.request = dataclasses.replace(ticket.request, candidates=self.resolve(cfg, ticket.model))
            ticket.config = cfg

    def view(self, cfg, now: float) -> PoolView:
        """A working copy of what the ledger knows of the pool now."""
        return self.ledger.snapshot(cfg.instances, now, cfg.telemetry.stale_after_s)

    # ---- deciding (live: in the worker thread) -----------------------------------
    def decide(self, cfg, batch: Sequence[Ticket], view: PoolView, estimate: EstimateFn) -> list[Decision]:
        """One Decision per ticket: admitted, estimated once for the whole batch, assigned by its policy.

        Policies run one after another on the same view, so each sees what the
        others dispatched. A policy that cannot run refuses only its own requests."""
        policies = self.policies(cfg)
        out: dict[int, Decision] = {}
        groups: dict[str, list[int]] = {}
        for k, ticket in enumerate(batch):
            policy = policies.get(ticket.request.policy)
            refused = policy if isinstance(policy, Refusal) else policy.admit(ticket.request, view)
            if refused is not None:
                out[k] = Decision((), refused=refused)
                continue
            ticket.decided_by = policy
            groups.setdefault(ticket.request.policy, []).append(k)
        wanted = [k for rows in groups.values() if batch[rows[0]].decided_by.needs_estimates for k in rows]
        estimates = estimate([batch[k] for k in wanted]) if wanted else None
        row_of = {k: j for j, k in enumerate(wanted)}
        for rows in groups.values():
            policy = batch[rows[0]].decided_by
            est = (estimates.rows([row_of[k] for k in rows])
                   if estimates is not None and policy.needs_estimates else None)
            for k, d in zip(rows, policy.assign([batch[k].request for k in rows], est, view), strict=True):
                out[k] = d
        return [out[k] for k in range(len(batch))]

    # ---- booking -------------------------------------------------------------
    def settle(self, batch: Sequence[Ticket], decisions: Sequence[Decision], now: float) -> list[Ticket]:
        """Record each decision; book the request on its first dispatch plan so the next
        batch's view counts it. Returns the tickets ready to dispatch (not held, not refused)."""
        ready = []
        for ticket, d in zip(batch, decisions, strict=True):
            ticket.decision = d
            if not d.ranked:
                continue
            if ticket.decided_by.overrides("hold") and ticket.decided_by.hold(ticket, self.view(ticket.config, now)):
                self.held.append(ticket)
                continue
            self._book_first(ticket, now)
            ready.append(ticket)
        return ready

    def release_held(self, now: float) -> list[Ticket]:
        """The held requests whose policy lets them go now, booked and ready to dispatch."""
        ready = []
        for ticket in list(self.held):
            if not ticket.decided_by.hold(ticket, self.view(ticket.config, now)):
                self.held.remove(ticket)
                self._book_first(ticket, now)
                ready.append(ticket)
        return ready

    def _book_first(self, ticket: Ticket, now: float) -> None:
        first = next(self.plans(ticket, now), None)
        if first is not None:
            self._book(ticket, first.instance, now)

    def plans(self, ticket: Ticket, now: float) -> Iterator[DispatchPlan]:
        """The attempts for a decided request, best first: its ranked instances (those the
        ledger knows to be down last), each with max_tokens clamped to what the budget buys
        there; an instance whose prices leave nothing for an answer is skipped."""
        cfg, req = ticket.config, ticket.request
        ranked = ticket.decision.ranked if ticket.decision else ()
        up = [i for i in ranked if self.ledger.of(cfg.instances[i].name).down_until <= now]
        for i in up + [i for i in ranked if i not in up]:
            inst = cfg.instances[i]
            max_tokens = req.max_tokens
            if req.budget_usd is not None:
                max_tokens = clamp_max_tokens(req.budget_usd, req.input_tokens, per_token(inst.price_input_per_mtok),
                                              per_token(inst.price_output_per_mtok), req.max_tokens)
                if max_tokens is None:
                    continue
            yield DispatchPlan(i, max_tokens, max_tokens != req.max_tokens)

    def dispatched(self, ticket: Ticket, plan: DispatchPlan, now: float) -> None:
        """An attempt goes out on `plan`: the request's booking moves there if it was elsewhere."""
        self._book(ticket, plan.instance, now)
        if ticket.decided_by is not None:
            ticket.decided_by.on_dispatch(ticket, plan, now)

    def _book(self, ticket: Ticket, i: int, now: float) -> None:
        name = ticket.config.instances[i].name
        if ticket.booked_on == name:
            return
        self._unbook(ticket)
        tokens = ticket.decision.tokens if ticket.decision and ticket.decision.tokens else 0.0
        self.ledger.of(name).dispatched(ticket, ticket.request.input_tokens, tokens, now, ticket.streaming)
        ticket.booked_on = name

    def _unbook(self, ticket: Ticket) -> None:
        if ticket.booked_on is not None:
            self.ledger.of(ticket.booked_on).done(ticket)
            ticket.booked_on = None

    # ---- what comes back -------------------------------------------------------------
    def progress(self, ticket: Ticket, tokens: int) -> None:
        """`tokens` answer tokens of the request have streamed back so far."""
        if ticket.booked_on is not None:
            self.ledger.of(ticket.booked_on).streamed(ticket, tokens)

    def first_token(self, ticket: Ticket, now: float) -> None:
        if ticket.decided_by is not None:
            ticket.decided_by.on_first_token(ticket, now)

    def complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        """The request is over: out of the ledger, and its policy hears how it went (once)."""
        self._unbook(ticket)
        policy, ticket.decided_by = ticket.decided_by, None
        if policy is not None:
            policy.on_complete(ticket, completion, now)
