"""QoS-aware routing (papers/qos-aware-edge-routing.txt): `qos` (a heuristic) and `qos-rl` (a learned policy).

A request's QoS is its answer's quality if its time per output token (arrival
to the answer's end, over the answer's tokens) stays within its bound L, else
0 (paper Eq. 1). L is the request's `tpot_slo_s` (the API's
`routing.tpot_slo_ms`), else the policy table's `tpot_slo_ms`.

Both policies keep the requests they dispatched (qos_state.Tracker, fed by
their lifecycle hooks) and run the action-impact estimator (impact.py) for
each arrived request on every candidate instance: its own estimated time per
token there, and how much it would slow the requests already running there.

- `qos`: the candidate of highest expected QoS net of the expected QoS it
  costs the running requests,
      score_n = q_n x P(tpot_n <= L) - sum_i q_i x (P(tpot_i <= L_i) - P(tpot_i + l+_i <= L_i)),
  the probabilities soft around the bound (`width`: the estimate's relative
  error). When no candidate can meet L (P < `drop_below` everywhere), the
  request is dropped: 503, code `qos_drop`.
- `qos-rl`: a discrete soft actor-critic's actor over the paper's dynamic
  state abstraction (qos_state.encode), trained in the simulator
  (`routebalance train-policy qos-rl`, gateway/lab/training/qos_rl.py) and
  served from ONNX with onnxruntime; its action 0 drops the request.

Threads: live, `assign` runs in the scheduler's worker thread and the
lifecycle hooks on the event loop; one lock guards the tracker.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.budget import predicted_cost
from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.profiles import engine_spec, spec_for_instance
from gateway.core.policy import Policy, PolicyContext, PolicyEntry
from gateway.core.request import Completion, Decision, DispatchPlan, Estimates, Refusal, RouteRequest, Ticket
from gateway.core.settings import InstanceSettings
from gateway.core.view import PoolView
from gateway.policies.qos.impact import Assessment, StepCurves, assess
from gateway.policies.qos.state import (
    FEATURE_HEADROOM,
    FEATURE_WIDTH,
    N_MAX,
    Actor,
    Tracked,
    Tracker,
    encode,
    load_of,
    masked_softmax,
)

# What a batch's decisions cost (charged by the simulator; measured with gateway/lab/experiments/qos_eval.py's
# `bench_decisions` on this 2-core machine at ~60 tracked requests over the 13-instance pool).
QOS_FIXED_S = 0.00005
QOS_PER_REQUEST_S = 0.00013
QOS_RL_PER_REQUEST_S = 0.0009
UNKNOWN_GPU_MEMORY_GB = 24.0  # an instance whose GPU memory the config cannot tell: a small card's KV cache


@section
class QosOptions(Section):
    """[policies.qos]: the default time-per-token bound, the estimate's tolerance, dropping, the tie-break seed."""

    # L of a request that names none (routing.tpot_slo_ms, X-Route-TPOT-SLO-MS or its key's), milliseconds.
    tpot_slo_ms: float = option(50.0, gt=0)
    # Relative error of the estimated time per token: the meet probability falls from 0.73 to 0.27 between
    # (1 - width) L and (1 + width) L.
    width: float = option(0.05, gt=0, le=1)
    # Aim below the bound: the estimate assumes the instance's load stays as it is, but later admissions
    # slow every request still running, so a request judged at exactly L ends a little above it.
    headroom: float = option(0.05, ge=0, le=0.5)
    drop: bool = True  # refuse (503, qos_drop) a request no instance can serve within L
    drop_below: float = option(0.5, ge=0, le=1)  # ... i.e. whose best meet probability is below this
    seed: int = 0  # tie-breaks between equal instances


@section
class QosRlOptions(Section):
    """[policies.qos_rl]: the exported actor, the default bound, dropping, sampling and its seed.

    The estimator's tolerance and aim are not knobs here: they shape the actor's input features
    (qos_state.FEATURE_WIDTH, FEATURE_HEADROOM), fixed by the layout it was trained on."""

    # The ONNX actor `routebalance train-policy qos-rl` writes (relative: to the working directory, else to
    # the checkout the gateway runs from); its JSON sidecar names the feature layout it was trained on.
    actor: str = option("models/qos_rl/actor.onnx", nonempty=True)
    tpot_slo_ms: float = option(50.0, gt=0)
    drop: bool = True  # False masks the drop action: every request is served
    sample: bool = False  # sample the action from the policy (as in training) instead of taking its mode
    seed: int = 0


class Observer(Protocol):
    """What a trainer hears from a QoS policy (gateway/lab/training/qos_rl.py)."""

    def decided(self, request: RouteRequest, state: dict[str, np.ndarray], action: int, assessment: Assessment,
                now: float) -> None:
        """A request's state, the action taken (0 drop, 1 + k instance k) and what the impact estimator said
        of each instance (Eq. 16's penalty for the action is `assessment.violations[action - 1]`)."""

    def completed(self, ticket: Ticket, completion: Completion, now: float) -> None:
        """A request this policy decided is over."""


def _spec(inst) -> EngineSpec:
    try:
        return spec_for_instance(inst)
    except ValueError:  # a real instance whose memory the config does not give: the KV cache is a guess
        return engine_spec(model=inst.model, gpu=inst.gpu, gpu_count=inst.gpu_count,
                           gpu_memory_gb=UNKNOWN_GPU_MEMORY_GB, gpu_memory_utilization=inst.gpu_memory_utilization,
                           tpot_prior_ms=inst.tpot_prior_ms, max_num_seqs=inst.max_num_seqs,
                           max_model_len=inst.max_model_len)


class _QosPolicy(Policy):
    """The shared part: the tracker and its hooks, the impact estimate, the decision's figures."""

    needs_estimates = True

    def __init__(self, tpot_slo_ms: float, width: float, headroom: float, seed: int = 0,
                 observer: Observer | None = None, max_age_s: float = 3600.0):
        self.default_bound_s = tpot_slo_ms / 1000.0
        self.width = width
        self.aim = 1.0 - headroom  # requests are placed to finish within this share of their bound
        self.rng = np.random.default_rng(seed)
        self.observer = observer
        self.max_age_s = max_age_s  # a tracked request older than this is forgotten (a lost completion)
        self.tracker = Tracker()
        self.lock = threading.Lock()
        self._curves: StepCurves | None = None
        self._instances: Sequence[InstanceSettings] | None = None

    def curves(self, instances: Sequence[InstanceSettings]) -> StepCurves:
        if self._instances is not instances:
            self._curves, self._instances = StepCurves.of([_spec(i) for i in instances]), instances
        assert self._curves is not None
        return self._curves

    def bound_s(self, request: RouteRequest) -> float:
        """The time per token the policy aims the request at: its bound L, less the headroom."""
        return self.aim * (request.tpot_slo_s if request.tpot_slo_s is not None else self.default_bound_s)

    # ---- assign --------------------------------------------------------------------------------
    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None:
            raise ValueError(f"{self.name} needs the batch's estimates")
        with self.lock:
            self._forget_old(view.now)
            curves = self.curves(view.instances)
            out = []
            for r, req in enumerate(batch):
                out.append(self._decide(req, estimates.quality[r], estimates.length[r], view, curves))
            return out

    def _decide(self, req: RouteRequest, quality: np.ndarray, length: np.ndarray, view: PoolView,
                curves: StepCurves) -> Decision:
        usable = np.array(view.usable(req.candidates), dtype=np.int64)
        bound = self.bound_s(req)
        running = self.tracker.running(view.now, curves.tpot_s)
        load = load_of(view.running, view.waiting, view.kv_usage, curves.kv_capacity, running)
        a = assess(curves, load, running, float(req.input_tokens), length, bound, self.width)
        score = quality * a.meet - a.loss
        # Equal scores (an idle pool): fewer requests first, then a seeded random order.
        order = np.lexsort((self.rng.random(len(usable)), view.active[usable], -score[usable]))
        ranked = usable[order]
        choice = self.choose(req, ranked, a, quality, length, view, curves, running, load, bound)
        if choice is None:
            best = ranked[np.argmax(a.meet[ranked])]
            return Decision((), refused=Refusal(
                503, f"no instance can serve this request within its time per output token of "
                     f"{bound / self.aim * 1000:g} ms "
                     f"(best estimate {a.tpot_s[best] * 1000:.0f} ms, on {view.instances[best].name})",
                "qos_drop", code="qos_drop", final=True))
        ranked = np.concatenate([[choice], ranked[ranked != choice]])
        tokens = float(length[choice])
        view.dispatched(int(choice), tokens, req.input_tokens)
        self.tracker.add(id(req), Tracked(int(choice), float(req.input_tokens), tokens, float(quality[choice]),
                                          bound, view.now, quality_row=quality.copy(), length_row=length.copy(),
                                          request=req))
        return Decision(tuple(int(i) for i in ranked), quality=float(quality[choice]),
                        cost_usd=float(predicted_cost(req.input_tokens, tokens * req.n, view.price_in[choice],
                                                      view.price_out[choice])),
                        latency_s=float(a.tpot_s[choice] * tokens), tokens=tokens)

    def choose(self, req: RouteRequest, ranked: np.ndarray, a: Assessment, quality: np.ndarray,
               length: np.ndarray, view: PoolView, curves: StepCurves, running, load, bound: float) -> int | None:
        """The instance for the request (`ranked`: the usable ones by heuristic score), or None to drop it."""
        raise NotImplementedError

    def _state(self, req, a, quality, length, view, curves, running, load, bound, allow_drop) -> dict:
        usable = np.zeros(len(view.instances), dtype=bool)
        usable[view.usable(req.candidates)] = True
        return encode(assessment=a, running=running, started=self.tracker.started(), load=load,
                      kv_usage=view.kv_usage, kv_capacity=curves.kv_capacity, tpot_prior_s=curves.tpot_s,
                      candidates=usable, quality=quality, length=length, prompt=float(req.input_tokens),
                      bound_s=bound, allow_drop=allow_drop)

    def _forget_old(self, now: float) -> None:
        old = [k for k, e in self.tracker.entries.items() if now - e.arrived > self.max_age_s]
        for k in old:
            self.tracker.pop(k)

    # ---- lifecycle -----------------------------------------------------------------------------
    def on_dispatch(self, ticket: Ticket, plan: DispatchPlan, now: float) -> None:
        with self.lock:
            entry = self.tracker.get(id(ticket.request))
            if entry is None:
                return
            if plan.instance != entry.instance and entry.length_row is not None and entry.quality_row is not None:
                entry.instance = plan.instance  # a retry on the next-ranked instance
                entry.total = float(entry.length_row[plan.instance])
                entry.quality = float(entry.quality_row[plan.instance])
                entry.generated, entry.started = 0, False
            entry.arrived, entry.dispatched, entry.streaming = ticket.arrived, now, ticket.streaming

    def on_first_token(self, ticket: Ticket, now: float) -> None:
        with self.lock:
            entry = self.tracker.get(id(ticket.request))
            if entry is not None:
                entry.started = True

    def on_progress(self, ticket: Ticket, tokens: int, now: float) -> None:
        with self.lock:
            entry = self.tracker.get(id(ticket.request))
            if entry is not None:
                entry.generated = max(entry.generated, tokens)

    def on_complete(self, ticket: Ticket, completion: Completion, now: float) -> None:
        with self.lock:
            self.tracker.pop(id(ticket.request))
            if self.observer is not None:
                self.observer.completed(ticket, completion, now)


class Qos(_QosPolicy):
    """The heuristic (module docstring): best expected QoS net of the QoS it costs the running requests."""

    name = "qos"

    def __init__(self, options: QosOptions, observer: Observer | None = None):
        super().__init__(options.tpot_slo_ms, options.width, options.headroom, options.seed, observer)
        self.options = options

    def choose(self, req, ranked, a, quality, length, view, curves, running, load, bound) -> int | None:
        # Drop what cannot meet L anywhere, or costs the running requests more QoS than it brings anywhere.
        best = ranked[0]
        drop = self.options.drop and (a.meet[ranked].max() < self.options.drop_below
                                      or quality[best] * a.meet[best] - a.loss[best] <= 0.0)
        choice = None if drop else int(best)
        if self.observer is not None:  # a trainer learning from the heuristic's decisions
            state = self._state(req, a, quality, length, view, curves, running, load, bound, self.options.drop)
            self.observer.decided(req, state, 0 if choice is None else 1 + choice, a, view.now)
        return choice

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return QOS_FIXED_S + QOS_PER_REQUEST_S * batch_size


class QosRl(_QosPolicy):
    """The learned policy: the actor's most probable action (or a sample) among the request's candidates."""

    name = "qos-rl"

    def __init__(self, options: QosRlOptions, actor: Actor, observer: Observer | None = None):
        # The features' meet probabilities and aim are part of the layout the actor was trained on.
        super().__init__(options.tpot_slo_ms, FEATURE_WIDTH, FEATURE_HEADROOM, options.seed, observer)
        self.options = options
        self.actor = actor

    def choose(self, req, ranked, a, quality, length, view, curves, running, load, bound) -> int | None:
        state = self._state(req, a, quality, length, view, curves, running, load, bound, self.options.drop)
        probs = masked_softmax(np.asarray(self.actor(state), dtype=np.float64), state["action_mask"])[0]
        action = int(self.rng.choice(len(probs), p=probs) if self.options.sample else np.argmax(probs))
        if self.observer is not None:
            self.observer.decided(req, state, action, a, view.now)
        return None if action == 0 else action - 1

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return QOS_FIXED_S + QOS_RL_PER_REQUEST_S * batch_size


def build_qos(context: PolicyContext) -> Qos:
    return Qos(context.options("qos"))


def build_qos_rl(context: PolicyContext) -> QosRl:
    """The ONNX actor comes from the estimators' `qos_actor(path)` loader (the core cannot import
    onnxruntime): gateway/policies/qos/actor.py."""
    options = context.options("qos_rl")
    if len(context.config.instances) > N_MAX:  # refused when built (503), not on every decision
        raise ValueError(f"qos-rl places on at most {N_MAX} instances; the pool has {len(context.config.instances)}")
    loader = getattr(context.estimators, "qos_actor", None)
    if loader is None:
        raise ValueError("qos-rl needs the estimators' ONNX actor loader (qos_actor), which this process lacks")
    return QosRl(options, loader(options.actor))


OPTIONS = {"qos": QosOptions, "qos_rl": QosRlOptions}
ENTRIES = (
    PolicyEntry("qos", build_qos, "QoS-aware (quality x [time per token <= L]): best expected QoS net of the "
                                  "slowdown it causes the running requests; drops what cannot meet L",
                needs_estimates=True),
    PolicyEntry("qos-rl", build_qos_rl, "learned QoS-aware routing: a soft actor-critic's attention policy over "
                                        "per-request and per-instance state (ONNX); may drop", needs_estimates=True),
)
