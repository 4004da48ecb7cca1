"""The scheduling loop, once: batch forming, deciding, dispatch plans, the pool state.

The live server (gateway/serving/driver.py: real time, sockets, a worker thread)
and the simulator (gateway/lab/sim/simulator.py: virtual time, the engine model)
are two thin drivers of this object. A driver calls, in this order:

    submit(ticket, now)                     a request arrives (False: the queue is full)
    limit(cfg, now), fire_at(...)           when the next batch may fire
    take(cfg, limit, now)                   form the batch (the default policy's `order`)
    view(cfg, now); decide(...)             estimate once, admit and assign per policy
    settle(batch, decided, now)             book each decided request on its first dispatch plan
    release_held(now)                       held requests whose policy lets them go
    plan(ticket, i, now, budget)            each ranked attempt in its turn, with its budget clamp
    dispatched / attempt_failed|succeeded   an attempt goes out, and how the instance did
    progress / first_token / complete       what came back; the pool state and the policy hear it
    evictions(cfg, now); requeue(ticket)    requests a policy evicts: aborted, then held again

`decide` touches no ticket (live it runs in a worker thread while the event
loop may withdraw a ticket whose client left); everything else runs on the
driver's own thread. A policy's hook that raises costs only its own requests
(a refusal with status 500) or, for `order` and the lifecycle events, is
logged and passed over: a plug-in cannot stop the loop.

No clock is read and nothing here does I/O; estimating is a function the
driver passes in (the real estimators live, cached estimates simulated).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gateway.core.batcher import BatchLimit, BatchQueue, batch_limit, busy_share
from gateway.core.budget import clamp_max_tokens, token_prices
from gateway.core.policy import Policy, PolicyCatalog
from gateway.core.pool_state import PoolState
from gateway.core.request import Completion, Decision, DispatchPlan, Estimates, Refusal, Ticket
from gateway.core.settings import CoreConfig
from gateway.core.view import PoolView

log = logging.getLogger("routebalance.scheduling")

# The batch's tickets that need estimates, and for each whether its policy is content with its candidates'
# priors (Policy.prompt_blind: nothing to embed) -> their rows.
EstimateFn = Callable[[Sequence[Ticket], Sequence[bool]], Estimates]
Decided = tuple[Decision, Policy | None]  # a ticket's decision and the policy that made it (None: none could)


def _policy_error(hook: str, e: Exception) -> Refusal:
    return Refusal(500, f"the routing policy failed in `{hook}`: {e.__class__.__name__}", "policy_error")


class PolicySet:
    """The policy objects of one config, each built on first use (a reload builds new ones)."""

    def __init__(self, catalog: PolicyCatalog, config: CoreConfig, estimators=None):
        self.catalog = catalog
        self.config = config
        self.estimators = estimators
        self._built: dict[str, Policy | Refusal] = {}

    def built(self, name: str) -> bool:
        return name in self._built

    def active(self) -> list[Policy]:
        """The policies built so far (the ones that have decided requests)."""
        return [p for p in self._built.values() if isinstance(p, Policy)]

    def get(self, name: str) -> Policy | Refusal:
        """The policy, or the Refusal its requests get when it cannot run."""
        found = self._built.get(name)
        if found is None:
            found = self._built[name] = self._build(name)
        return found

    def _build(self, name: str) -> Policy | Refusal:
        if self.catalog.entry(name).needs_estimates and self.estimators is None:
            return Refusal(503, f"policy {name!r} needs the estimators, which are not built: run `routebalance train`",
                           "policy_unavailable", final=True)
        try:
            return self.catalog.build(name, self.config, self.estimators)
        except Exception as e:  # a plug-in's constructor may raise anything: its requests are refused
            return Refusal(503, f"policy {name!r} is unavailable: {e}", "policy_unavailable", final=True)


class SchedulingLoop:
    """Requests from arrival to completion, for one process (live) or one cell (simulated)."""

    def __init__(self, catalog: PolicyCatalog, pool_state: PoolState, max_queue: int,
                 resolve: Callable[[CoreConfig, str], tuple[int, ...]], estimators=None):
        self.catalog = catalog  # the registry the policies are built from (gateway/policies/registry.py)
        self.pool_state = pool_state
        self.queue: BatchQueue[Ticket] = BatchQueue(max_queue)
        self.resolve = resolve  # (config, model) -> candidate instance indices; raises if the model is gone
        self.estimators = estimators
        self.held: list[Ticket] = []  # decided, kept in the gateway by their policy's `hold`
        self._policies: PolicySet | None = None

    def policies(self, cfg: CoreConfig) -> PolicySet:
        if self._policies is None or self._policies.config is not cfg:
            self._policies = PolicySet(self.catalog, cfg, self.estimators)
        return self._policies

    # ---- arrivals ------------------------------------------------------------
    def submit(self, ticket: Ticket, now: float) -> bool:
        """Queue a request for the next batch; False (nothing queued) if the queue is full."""
        ticket.arrived = now
        return self.queue.push(ticket, now)

    def abandoned(self, ticket: Ticket, policy: Policy | None, now: float) -> None:
        """A request whose batch was decided after its client left (or its wait ran out): never
        settled, so its deciding policy hears now that it is over (it may keep state from `assign`)."""
        ticket.decided_by = policy
        self.complete(ticket, Completion(False, None), now)

    def withdraw(self, ticket: Ticket, now: float) -> None:
        """The request will not be dispatched (its client left, or its batch failed): forget it wherever it is."""
        self.queue.remove(ticket)
        if ticket in self.held:
            self.held.remove(ticket)
        self.complete(ticket, Completion(False, None), now)

    # ---- batch forming -----------------------------------------------------------
    def limit(self, cfg: CoreConfig, now: float) -> BatchLimit | None:
        """The window rule's (size, window) for the pool's state now; None in eager mode."""
        if cfg.batching.mode != "window":
            return None
        waiting = self.pool_state.waiting(cfg.instances, now, cfg.telemetry.stale_after_s)
        return batch_limit(cfg.batching.rules, busy_share(waiting))

    def fire_at(self, limit: BatchLimit | None, now: float) -> float | None:
        """When the next batch may fire (now or later); None if nothing waits."""
        if not self.queue:
            return None
        if limit is None or self.queue.ready(limit, now):
            return now
        return self.queue.closes_at(limit)

    def take(self, cfg: CoreConfig, limit: BatchLimit | None,
             now: float) -> tuple[list[Ticket], list[tuple[Ticket, Exception]]]:
        """The next batch (never empty while requests wait), in the default policy's order, and the
        requests that failed to re-resolve their candidates under this config (their model left
        the pool with a reload)."""
        size = limit.size if limit is not None else max(rule.size for rule in cfg.batching.rules)
        default = self.policies(cfg).get(cfg.scheduler.policy)
        order = None
        if isinstance(default, Policy) and default.overrides("order"):
            view = self.view(cfg, now)

            def order(waiting: list[Ticket]) -> Sequence[Ticket]:
                try:
                    return default.order(waiting, view, now)
                except Exception:
                    log.exception("policy %s failed in `order`; this batch is taken first come, first served",
                                  cfg.scheduler.policy)
                    return waiting
        batch, failed = [], []
        for _, ticket in self.queue.take(size, order):
            try:
                self._current_candidates(cfg, ticket)
            except Exception as e:  # whatever the resolver raised goes back to that request alone
                failed.append((ticket, e))
                continue
            batch.append(ticket)
        return batch, failed

    def _current_candidates(self, cfg: CoreConfig, ticket: Ticket) -> None:
        if ticket.config is not cfg:
            ticket.request = dataclasses.replace(ticket.request, candidates=self.resolve(cfg, ticket.model))
            ticket.config = cfg

    def view(self, cfg: CoreConfig, now: float) -> PoolView:
        """A working copy of what the pool state knows of the pool now."""
        return self.pool_state.snapshot(cfg.instances, now, cfg.telemetry.stale_after_s, cfg.scheduler)

    # ---- deciding (live: in the worker thread) -----------------------------------
    def decide(self, cfg: CoreConfig, batch: Sequence[Ticket], view: PoolView, estimate: EstimateFn) -> list[Decided]:
        """A decision per ticket: admitted, estimated once for the whole batch, assigned by its policy.

        Policies run one after another on the same view, so each sees what the
        others dispatched. A policy that cannot run, or whose hook raises,
        refuses only its own requests. Reads the tickets, never writes them."""
        policies = self.policies(cfg)
        out: dict[int, Decided] = {}
        groups: dict[str, tuple[Policy, list[int]]] = {}
        for k, ticket in enumerate(batch):
            policy = policies.get(ticket.request.policy)
            if isinstance(policy, Refusal):
                out[k] = (Decision((), refused=policy), None)
                continue
            try:
                refused = policy.admit(ticket.request, view)
            except Exception as e:
                log.exception("policy %s failed in `admit`", ticket.request.policy)
                refused = _policy_error("admit", e)
            if refused is not None:
                out[k] = (Decision((), refused=refused), policy)
                continue
            groups.setdefault(ticket.request.policy, (policy, []))[1].append(k)
        needing = [(policy, k) for policy, rows in groups.values() if policy.needs_estimates for k in rows]
        wanted = [k for _, k in needing]
        blind = [policy.prompt_blind(batch[k].request, view) for policy, k in needing]
        whole = estimate([batch[k] for k in wanted], blind) if wanted else None
        # every policy sees lengths within what the request allows; the decision keeps the whole answer's too
        estimates = whole.bounded([batch[k].request for k in wanted]) if whole is not None else None
        row_of = {k: j for j, k in enumerate(wanted)}
        for name, (policy, rows) in groups.items():
            est = (estimates.rows([row_of[k] for k in rows])
                   if estimates is not None and policy.needs_estimates else None)
            try:
                decisions = policy.assign([batch[k].request for k in rows], est, view)
                if len(decisions) != len(rows):
                    raise ValueError(f"assign gave {len(decisions)} decisions for {len(rows)} requests")
            except Exception as e:
                log.exception("policy %s failed in `assign`", name)
                decisions = [Decision((), refused=_policy_error("assign", e))] * len(rows)
            for k, d in zip(rows, decisions, strict=True):
                d = _checked(d, batch[k])
                if whole is not None and k in row_of and d.ranked:
                    d = dataclasses.replace(d, answer_tokens=float(whole.length[row_of[k], d.ranked[0]]))
                out[k] = (d, policy)
        return [out[k] for k in range(len(batch))]

    # ---- booking -------------------------------------------------------------
    def settle(self, batch: Sequence[Ticket], decided: Sequence[Decided], now: float) -> list[Ticket]:
        """Record each decision; book the request on its first dispatch plan so the next
        batch's view counts it. Returns the tickets to hand back now: ready to dispatch, or
        refused (`ticket.decision.refused`); the held ones come later from `release_held`."""
        out = []
        views: dict[int, PoolView] = {}  # for `hold`: one per config, dead-reckoned as requests are booked
        for ticket, (d, policy) in zip(batch, decided, strict=True):
            ticket.decision, ticket.decided_by = d, policy
            if d.refused is None and policy is not None and policy.overrides("hold"):
                if self._held(ticket, self._view_of(views, ticket, now)):
                    self.held.append(ticket)
                    continue
            if ticket.decision.refused is None:
                self._book_first(ticket, now, views.get(id(ticket.config)))
            out.append(ticket)
        return out

    def release_held(self, now: float) -> list[Ticket]:
        """The held requests whose policy lets them go now, booked: ready to dispatch (or refused)."""
        out = []
        views: dict[int, PoolView] = {}  # one per config, dead-reckoned as requests go
        for ticket in list(self.held):
            view = self._view_of(views, ticket, now)
            if self._held(ticket, view):
                continue
            self.held.remove(ticket)
            if ticket.decision is not None and ticket.decision.refused is None:
                self._book_first(ticket, now, view)
            out.append(ticket)
        return out

    def _view_of(self, views: dict[int, PoolView], ticket: Ticket, now: float) -> PoolView:
        """The round's working view of the ticket's config (made on first use)."""
        view = views.get(id(ticket.config))
        if view is None:
            view = views[id(ticket.config)] = self.view(ticket.config, now)
        return view

    def _held(self, ticket: Ticket, view: PoolView) -> bool:
        """Does the ticket's policy keep it in the gateway now? A policy that places it anew
        changes its decision; one that fails refuses it."""
        try:
            verdict = ticket.decided_by.hold(ticket, view)
        except Exception as e:
            log.exception("policy %s failed in `hold`", ticket.request.policy)
            ticket.decision = Decision((), refused=_policy_error("hold", e))
            return False
        if isinstance(verdict, Decision):
            ticket.decision = _checked(verdict, ticket)
            return False
        return bool(verdict)

    # ---- eviction --------------------------------------------------------------
    def evictions(self, cfg: CoreConfig, now: float) -> list[Ticket]:
        """Dispatched requests the policies of `cfg` want aborted and held again (see `Policy.evict`):
        only ones booked, of that policy, whose client has seen no byte of the answer."""
        out: list[Ticket] = []
        view = None
        for policy in self.policies(cfg).active():
            if not policy.overrides("evict"):
                continue
            view = view or self.view(cfg, now)
            try:
                victims = policy.evict(view, now)
            except Exception:
                log.exception("policy %s failed in `evict`", policy.name)
                continue
            out += [t for t in victims if t.booked_on is not None and t.decided_by is policy and t.evictable
                    and t not in out]
        return out

    def requeue(self, ticket: Ticket, now: float) -> None:
        """An evicted request's attempt was aborted: out of the pool state, held again in the gateway."""
        self._unbook(ticket)
        ticket.evictions += 1
        self.held.append(ticket)

    def _book_first(self, ticket: Ticket, now: float, view: PoolView | None = None) -> None:
        """Book the request on its first dispatch plan (and on `view`, a working copy other requests
        of the same round are judged on)."""
        first = ticket.plan = next(self.plans(ticket, now), None)
        if first is not None:
            # The working copy first: it reads the live index, which the booking records the prompt in.
            if view is not None and ticket.decision is not None:
                view.dispatched(first.instance, ticket.decision.tokens or 0.0, ticket.request.input_tokens,
                                ticket.request.prefix)
            self._book(ticket, first.instance, now)

    def plans(self, ticket: Ticket, now: float) -> Iterator[DispatchPlan]:
        """The attempts for a decided request, best first, with its own budget (see `plan`)."""
        for i in ticket.decision.ranked if ticket.decision else ():
            plan = self.plan(ticket, i, now, ticket.request.budget_usd)
            if plan is not None:
                yield plan

    def attempt_plan(self, ticket: Ticket, i: int, now: float, budget_usd: float | None) -> DispatchPlan | None:
        """The plan for an attempt on `i`: the one the request was booked on when that is still it (the same
        instance, still routable, the same money to spend), else a new one (see `plan`)."""
        booked, ticket.plan = ticket.plan, None  # good for one attempt
        if (booked is not None and booked.instance == i and budget_usd == ticket.request.budget_usd
                and self.pool_state.routable(ticket.config.instances[i].name, now)):
            return booked
        return self.plan(ticket, i, now, budget_usd)

    def plan(self, ticket: Ticket, i: int, now: float, budget_usd: float | None) -> DispatchPlan | None:
        """An attempt of the request on its ranked instance `i`, with max_tokens clamped to what
        `budget_usd` buys there (for each of its n answers) and to what the instance accepts
        (max_model_len minus the prompt); None if the instance is not routable now (cooling
        down after failures) or its prices leave nothing for an answer. A driver plans each
        attempt when its turn comes: time passes and money is spent between attempts (a failed
        attempt is paid for too, and a key's other requests spend concurrently)."""
        cfg, req = ticket.config, ticket.request
        inst = cfg.instances[i]
        if not self.pool_state.routable(inst.name, now):
            return None
        max_tokens = req.max_tokens
        if budget_usd is not None:
            max_tokens = clamp_max_tokens(budget_usd, req.input_tokens, *token_prices(inst), req.max_tokens, req.n,
                                          inst.max_model_len - req.input_tokens)
            if max_tokens is None:
                return None
        return DispatchPlan(i, max_tokens, max_tokens != req.max_tokens)

    def dispatched(self, ticket: Ticket, plan: DispatchPlan, now: float) -> None:
        """An attempt goes out on `plan`: the request's booking moves there if it was elsewhere."""
        self._book(ticket, plan.instance, now)
        self.pool_state.of(ticket.config.instances[plan.instance].name).health.attempt(ticket, now)
        self._tell(ticket.decided_by, "on_dispatch", ticket, plan, now)

    def attempt_failed(self, ticket: Ticket, plan: DispatchPlan, now: float, unreachable: bool = False) -> None:
        """The attempt on `plan` failed (reset, timed out, 5xx, wrong model): the instance's health
        hears it, and enough failures in a row cool it down. `unreachable` (the connection was
        refused): it cools down at once."""
        cfg = ticket.config
        health = self.pool_state.of(cfg.instances[plan.instance].name).health
        if unreachable:
            health.unreachable(ticket, now, cfg.health)
        else:
            health.failed(ticket, now, cfg.health)

    def attempt_succeeded(self, ticket: Ticket, plan: DispatchPlan) -> None:
        """The instance answered the attempt on `plan`: it is healthy."""
        self.pool_state.of(ticket.config.instances[plan.instance].name).health.succeeded(ticket)

    def _book(self, ticket: Ticket, i: int, now: float) -> None:
        name = ticket.config.instances[i].name
        if ticket.booked_on == name:
            return
        self._unbook(ticket)
        tokens = ticket.decision.tokens if ticket.decision and ticket.decision.tokens else 0.0
        req, scheduler, state = ticket.request, ticket.config.scheduler, self.pool_state.of(name)
        sends_prefix = bool(req.prefix) and scheduler.prefix_cache != "off"  # its policy reads the index
        cached = (state.cached_tokens(req.prefix, req.input_tokens, scheduler)
                  if sends_prefix and ticket.config.instances[i].prefix_caching else 0)
        state.dispatched(ticket, req.input_tokens - cached, tokens, now, ticket.streaming)
        if sends_prefix:
            self.pool_state.sent_prompt(name, req.prefix, scheduler.prefix_index_max_blocks)
        ticket.booked_on = name

    def _unbook(self, ticket: Ticket) -> None:
        if ticket.booked_on is not None:
            state = self.pool_state.of(ticket.booked_on)
            state.done(ticket)
            state.health.abandoned(ticket)
            ticket.booked_on = None

    # ---- what comes back -------------------------------------------------------------
    def progress(self, ticket: Ticket, tokens: int, now: float) -> None:
        """`tokens` answer tokens of the request have streamed back so far."""
        if ticket.booked_on is not None:
            self.pool_state.of(ticket.booked_on).streamed(ticket, tokens)
        policy = ticket.decided_by
        if policy is not None and policy.overrides("on_progress"):
            self._tell(policy, "on_progress", ticket, tokens, now)

    def first_token(self, ticket: Ticket, now: float) -> None:
        ticket.first_token_at = now
        self._tell(ticket.decided_by, "on_first_token", ticket, now)

    def complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        """The request is over, served or not: out of the pool state, and its policy hears how it went (once)."""
        self._unbook(ticket)
        policy, ticket.decided_by = ticket.decided_by, None
        self._tell(policy, "on_complete", ticket, completion, now)

    @staticmethod
    def _tell(policy: Policy | None, hook: str, *args: Any) -> None:
        """A lifecycle event for the policy; one that raises is logged and the request goes on."""
        if policy is None:
            return
        try:
            getattr(policy, hook)(*args)
        except Exception:
            log.exception("policy %s failed in `%s`", policy.name, hook)


def _checked(d: Decision, ticket: Ticket) -> Decision:
    """A decision the drivers can act on: refused with no instances, or instances among the
    request's candidates (a policy must not send a request for one model to another)."""
    if d.refused is not None:
        return d if not d.ranked else dataclasses.replace(d, ranked=())
    allowed = set(ticket.request.candidates)
    ranked = tuple(i for i in dict.fromkeys(d.ranked) if i in allowed)  # each instance once: never retried
    if not ranked:
        return Decision((), refused=Refusal(503, "the routing policy chose no instance for this request",
                                            "policy_error"))
    return d if len(ranked) == len(d.ranked) else dataclasses.replace(d, ranked=ranked)
