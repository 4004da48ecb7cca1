"""The policy interface: one required hook (`assign`) and optional ones, and how a policy is registered.

A policy does no I/O and reads no clock: the scheduling loop passes in the
view of the pool and the time, so the live server and the simulator drive
the same code. Hooks:

- `admit(request, view)`: None to admit, or a Refusal (QoS drop, SLO
  infeasible, ...). Runs when the request's batch is formed, before estimates.
- `order(waiting, view, now)`: the waiting tickets in the order they should
  enter the next batch (FCFS when not overridden). Only the config's default
  policy orders the shared queue.
- `assign(batch, estimates, view)`: one Decision per request (a ranked list
  of instances). May update `view` (dead reckoning) so later requests of the
  batch see the work the earlier ones added.
- `hold(ticket, view)`: True keeps a decided request in the gateway until
  its instance has room (request pulling); False lets it go as decided; a
  Decision lets it go placed anew (a policy that re-plans its queues moves a
  waiting request to another instance). The loop asks again after every
  completion and scrape (in the simulator, after every event), in the order
  the requests were held. A held request is not in the pool state, so the
  view does not count it: a policy that holds keeps its own account of what
  it holds (it sees every held ticket in `hold`).
- `evict(view, now)`: dispatched requests of this policy to abort and hold
  again (eviction at the gateway: a tighter-SLO request would otherwise
  miss). Only a request whose client has seen no byte of its answer may be
  evicted (not streamed, or streamed before its first token), so the client
  gets one answer; the loop drops any other. An evicted request is held (its
  policy's `hold` decides when it goes again) and its aborted attempt is paid.
- `keeps_state(ticket, instance)`: whether a request this policy evicts
  from `instance` keeps its KV cache in host memory (GPU-CPU state swap),
  to resume where it stopped when it goes back there. Only the simulator's
  engines can; live, eviction always recomputes.
- `warm()`: instances whose models the policy wants in host memory next,
  most wanted first (QLM's warm start). Only GPUs shared by several models
  (`gpu_id`) in the simulator heed it: stock vLLM gives a gateway no control
  of its weights.
- `on_dispatch(ticket, plan, now)`, `on_first_token(ticket, now)`,
  `on_progress(ticket, tokens, now)` (answer tokens so far),
  `on_complete(ticket, completion, now)`: lifecycle events, for policies that
  learn or keep state. Every decided request ends in `on_complete`, refused
  ones included (`completion.ok` False, `instance` None).

A hook that raises refuses only its own requests (`admit`, `assign`, `hold`:
HTTP 500) or is logged and passed over (`order`: first come, first served;
the lifecycle events).

Threads: live, `admit` and `assign` run in the scheduler's worker thread and
the other hooks on the event loop; a policy whose hooks share mutable state
across the two must guard it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from gateway.core.request import Completion, Decision, DispatchPlan, Estimates, Refusal, RouteRequest, Ticket
from gateway.core.settings import CoreConfig
from gateway.core.view import PoolView

# What a batch's assignment costs a simulated scheduler when a policy says
# nothing else: a pipeline router's choice is a centroid search or an argmax.
LIGHT_COMPUTE_S = 0.0002


class Policy:
    """Base class: every optional hook does nothing (or the default), `assign` must be written."""

    name: str = ""
    needs_estimates: bool = False  # the loop runs the estimators for this policy's requests

    def prompt_blind(self, request: RouteRequest, view: PoolView) -> bool:
        """Whether this request's estimates may be its candidates' priors (each model's mean quality and answer
        length) instead of its prompt's: the loop then does not embed it. Only for a policy that needs
        estimates, and only where the prompt could not change its choice much."""
        return False

    def admit(self, request: RouteRequest, view: PoolView) -> Refusal | None:
        return None

    def order(self, waiting: Sequence[Ticket], view: PoolView, now: float) -> Sequence[Ticket]:
        return waiting

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        raise NotImplementedError

    def hold(self, ticket: Ticket, view: PoolView) -> bool | Decision:
        return False

    def evict(self, view: PoolView, now: float) -> Sequence[Ticket]:
        return ()

    def keeps_state(self, ticket: Ticket, instance: int) -> bool:
        return False

    def warm(self) -> Sequence[int]:
        return ()

    def on_dispatch(self, ticket: Ticket, plan: DispatchPlan, now: float) -> None:
        pass

    def on_first_token(self, ticket: Ticket, now: float) -> None:
        pass

    def on_progress(self, ticket: Ticket, tokens: int, now: float) -> None:
        pass

    def on_complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        pass

    def compute_s(self, batch_size: int, cost: Any) -> float:
        """Seconds a batch's `assign` costs, charged by the simulator (`cost`: its measured ComputeCost)."""
        return LIGHT_COMPUTE_S

    def overrides(self, hook: str) -> bool:
        """Does this policy implement `hook` itself (so the loop must call it)?"""
        return getattr(type(self), hook) is not getattr(Policy, hook)


@dataclass(frozen=True, slots=True)
class PolicyContext:
    """What a policy is built from: the config (its own table via `options`) and the estimators."""

    config: CoreConfig
    estimators: Any = None  # gateway.estimators.bundle.Estimators, or None when not built

    def options(self, table: str) -> Any:
        return self.config.options(table)


@dataclass(frozen=True, slots=True)
class PolicyEntry:
    """A registered policy: its name, how to build it, and a line for the help and the README."""

    name: str
    build: Callable[[PolicyContext], Policy]
    summary: str
    needs_estimates: bool = False  # whether serving it needs the built estimators
    reads_prefixes: bool = False  # it reads the prefix index (PoolView.cached_tokens): prompts are hashed for it


class PolicyCatalog(Protocol):
    """Where the scheduling loop finds policies by name: the registry (gateway/policies/registry.py)."""

    def entry(self, name: str) -> PolicyEntry: ...

    def build(self, name: str, config: CoreConfig, estimators: Any = None) -> Policy: ...
