"""The QoS policies' state: the requests they dispatched, and the learned policy's input features.

Two things, both pure (numpy, no clock, no I/O):

- `Tracker`: one entry per request a QoS policy decided, from its `assign`
  (dead reckoning: the next request of the batch sees it) through
  `on_dispatch`, `on_first_token` and `on_progress` to `on_complete`. It
  gives the action-impact estimator (impact.py) its `RunningArrays`. It is
  not thread-safe: the policy holds a lock around it (live, `assign` runs in
  the scheduler's worker thread and the lifecycle hooks on the event loop).

- `encode`: the dynamic state abstraction of the QoS routing paper (section
  V-B) as fixed-size arrays for the actor: per instance, up to R_MAX of its
  tracked requests with the paper's request features (p_j, s_hat, d_hat,
  e_j, d_jt, l_jt, plus their projected time per token without and with the
  arrived request), the instance's features (KV use, |running|, |waiting|,
  plus what the impact estimator says of placing the arrived request there),
  and the arrived request's own. Training (gateway/lab/training/qos_rl.py, a
  torch actor) and serving (an ONNX actor, gateway/policies/qos/actor.py)
  both call `encode`, so their features cannot drift apart. Action 0 drops
  the request, action 1 + k sends it to instance k (config order).

Times per token are given relative to the request's bound L, so one actor
serves any L.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from gateway.policies.qos.impact import Assessment, Load, RunningArrays

N_MAX = 16  # instances an actor can place on (the 13-instance pool fits)
R_MAX = 8  # tracked requests per instance it sees (the most at risk of missing their bound)
LAYOUT_VERSION = 1
REQUEST_FEATURES = (
    "prompt_tokens/1000", "quality", "answer_tokens/1000", "kv_share", "generated/1000",
    "tpot_so_far/L", "projected_tpot/L", "projected_tpot_with_arrival/L", "started",
)
INSTANCE_FEATURES = (
    "candidate", "kv_usage", "running/64", "waiting/16", "step/L", "tpot_prior/L",
    "arrival_quality", "arrival_answer_tokens/1000", "arrival_tpot/L", "arrival_meet",
    "expected_qos_loss", "violations/10",
)
ARRIVAL_FEATURES = ("prompt_tokens/1000", "L/50ms", "best_candidate_quality", "best_candidate_meet",
                    "candidates/16")
INPUTS = ("requests", "request_mask", "instances", "arrival", "action_mask")
FEATURE_WIDTH = 0.05  # the meet probabilities' tolerance in the features (as [policies.qos] width)
FEATURE_HEADROOM = 0.05  # the bound the features measure against: (1 - this) x L (as [policies.qos] headroom)
RATIO_CAP = 4.0  # times per token relative to L are clipped here: beyond it they all mean "far too slow"
INVALID_LOGIT = -1e9

# The actor: the encoded inputs (INPUTS, batch first) -> logits (batch, 1 + N_MAX), invalid actions at
# INVALID_LOGIT or below. An onnxruntime session live, a torch module in training.
Actor = Callable[[Mapping[str, np.ndarray]], np.ndarray]


def layout() -> dict:
    """What an exported actor was trained on: checked when one is loaded."""
    return {"version": LAYOUT_VERSION, "n_max": N_MAX, "r_max": R_MAX, "width": FEATURE_WIDTH,
            "headroom": FEATURE_HEADROOM, "ratio_cap": RATIO_CAP, "inputs": list(INPUTS),
            "request_features": list(REQUEST_FEATURES), "instance_features": list(INSTANCE_FEATURES),
            "arrival_features": list(ARRIVAL_FEATURES), "actions": "0 = drop, 1 + k = instance k (config order)"}


# ---- the tracker ----------------------------------------------------------------------------------

@dataclass(slots=True)
class Tracked:
    """One request a QoS policy decided."""

    instance: int
    prompt: float
    total: float  # predicted answer tokens on its instance
    quality: float  # predicted quality on its instance
    bound_s: float
    arrived: float
    dispatched: float | None = None  # None: decided, not yet sent
    generated: int = 0
    started: bool = False  # its first token came back
    streaming: bool = True  # False: no progress is heard before the end, so it is estimated from time
    # Its predictions on every instance (a retry moves it to another), and the request itself: the
    # tracker's key is the request object's id, which must not be reused while it is tracked.
    quality_row: np.ndarray | None = None
    length_row: np.ndarray | None = None
    request: object = None


class Tracker:
    """The requests a QoS policy has on the pool, by key (the policy uses the request object's id)."""

    def __init__(self) -> None:
        self.entries: dict[int, Tracked] = {}

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: int, entry: Tracked) -> None:
        self.entries[key] = entry

    def get(self, key: int) -> Tracked | None:
        return self.entries.get(key)

    def pop(self, key: int) -> Tracked | None:
        return self.entries.pop(key, None)

    def running(self, now: float, tpot_s: np.ndarray) -> RunningArrays:
        """The tracked requests as the impact estimator's arrays at `now`. A request that streams
        nothing back is assumed to decode at its instance's lone-sequence pace since it was sent."""
        if not self.entries:
            return RunningArrays.empty()
        rows = list(self.entries.values())
        inst = np.fromiter((e.instance for e in rows), dtype=np.int64, count=len(rows))
        generated = np.fromiter((e.generated for e in rows), dtype=np.float64, count=len(rows))
        silent = [k for k, e in enumerate(rows) if not e.streaming and e.dispatched is not None]
        if silent:
            since = np.array([now - rows[k].dispatched for k in silent])  # type: ignore[operator]
            generated[silent] = np.maximum(generated[silent], np.floor(since / tpot_s[inst[silent]]))
        total = np.fromiter((e.total for e in rows), dtype=np.float64, count=len(rows))
        total = np.maximum(total, generated + 1.0)
        return RunningArrays(
            instance=inst,
            prompt=np.fromiter((e.prompt for e in rows), dtype=np.float64, count=len(rows)),
            total=total,
            generated=generated,
            elapsed_s=now - np.fromiter((e.arrived for e in rows), dtype=np.float64, count=len(rows)),
            quality=np.fromiter((e.quality for e in rows), dtype=np.float64, count=len(rows)),
            bound_s=np.fromiter((e.bound_s for e in rows), dtype=np.float64, count=len(rows)),
        )

    def started(self) -> np.ndarray:
        return np.fromiter((e.started for e in self.entries.values()), dtype=bool, count=len(self.entries))


def context_tokens(running: RunningArrays, n_instances: int) -> np.ndarray:
    """Tokens of context the tracked requests hold on each instance (prompt plus answer so far)."""
    return np.bincount(running.instance, weights=running.prompt + running.generated, minlength=n_instances)


def load_of(view_running: np.ndarray, view_waiting: np.ndarray, view_kv_usage: np.ndarray,
            kv_capacity: np.ndarray, running: RunningArrays) -> Load:
    """Each instance's load: the view's counts (scraped, plus the gateway's own dispatches), at least the
    requests tracked there, and the larger of the scraped KV use and the context the tracked requests hold
    (a scrape lags the dispatches)."""
    n = len(kv_capacity)
    kv = np.maximum(view_kv_usage * kv_capacity, context_tokens(running, n))
    tracked = np.bincount(running.instance, minlength=n).astype(np.float64)
    view_active = np.asarray(view_running, dtype=np.float64) + np.asarray(view_waiting, dtype=np.float64)
    # Tracked requests the view does not count (it lags) are running, as far as anyone knows.
    running_now = np.asarray(view_running, dtype=np.float64) + np.maximum(tracked - view_active, 0.0)
    return Load(running_now, np.asarray(view_waiting, dtype=np.float64), kv)


# ---- the actor's features --------------------------------------------------------------------------

def _ratio(x: np.ndarray | float, bound: np.ndarray | float) -> np.ndarray:
    return np.clip(np.asarray(x, dtype=np.float64) / bound, 0.0, RATIO_CAP)


def encode(*, assessment: Assessment, running: RunningArrays, started: np.ndarray, load: Load,
           kv_usage: np.ndarray, kv_capacity: np.ndarray, tpot_prior_s: np.ndarray, candidates: np.ndarray,
           quality: np.ndarray, length: np.ndarray, prompt: float, bound_s: float,
           allow_drop: bool = True) -> dict[str, np.ndarray]:
    """One arrived request's state, batch of one: {input name: float32 array} (INPUTS).

    `quality`, `length`: its predictions per instance; `candidates`: bool per
    instance, the instances it may use now.
    """
    n_inst = len(candidates)
    if n_inst > N_MAX:
        raise ValueError(f"the actor places on at most {N_MAX} instances; the pool has {n_inst}")
    a = assessment
    requests = np.zeros((1, N_MAX, R_MAX, len(REQUEST_FEATURES)), dtype=np.float32)
    mask = np.zeros((1, N_MAX, R_MAX), dtype=np.float32)
    if len(running):
        with_new = a.projected_s + a.impact_s
        risk = with_new / running.bound_s
        order = np.lexsort((-risk, running.instance))  # by instance, the most at risk first
        inst_sorted = running.instance[order]
        first = np.searchsorted(inst_sorted, inst_sorted, side="left")
        rank = np.arange(len(order)) - first
        keep = rank < R_MAX
        rows, slots, inst = order[keep], rank[keep], inst_sorted[keep]
        gen = running.generated[rows]
        feats = np.stack([
            running.prompt[rows] / 1000.0,
            running.quality[rows],
            running.total[rows] / 1000.0,
            (running.prompt[rows] + gen) / kv_capacity[inst],
            gen / 1000.0,
            _ratio(running.elapsed_s[rows] / np.maximum(gen, 1.0), running.bound_s[rows]),
            _ratio(a.projected_s[rows], running.bound_s[rows]),
            _ratio(with_new[rows], running.bound_s[rows]),
            started[rows].astype(np.float64),
        ], axis=1)
        requests[0, inst, slots] = feats
        mask[0, inst, slots] = 1.0
    inst_feats = np.zeros((1, N_MAX, len(INSTANCE_FEATURES)), dtype=np.float32)
    inst_feats[0, :n_inst] = np.stack([
        candidates.astype(np.float64),
        np.clip(kv_usage, 0.0, 1.0),
        load.running / 64.0,
        load.waiting / 16.0,
        _ratio(a.step_s, bound_s),
        _ratio(tpot_prior_s, bound_s),
        quality,
        length / 1000.0,
        _ratio(a.tpot_s, bound_s),
        a.meet,
        a.loss,
        a.violations / 10.0,
    ], axis=1)
    cand_q = quality[candidates] if candidates.any() else np.zeros(1)
    cand_meet = a.meet[candidates] if candidates.any() else np.zeros(1)
    arrival = np.array([[prompt / 1000.0, bound_s / 0.05, cand_q.max(), cand_meet.max(), candidates.sum() / 16.0]],
                       dtype=np.float32)
    action_mask = np.zeros((1, 1 + N_MAX), dtype=np.float32)
    action_mask[0, 0] = 1.0 if allow_drop else 0.0
    action_mask[0, 1:1 + n_inst] = candidates
    return {"requests": requests, "request_mask": mask, "instances": inst_feats, "arrival": arrival,
            "action_mask": action_mask}


def stack(states: list[dict[str, np.ndarray]]) -> dict[str, np.ndarray]:
    """Encoded states of one request each, as one batch."""
    return {k: np.concatenate([s[k] for s in states]) for k in INPUTS}


def masked_softmax(logits: np.ndarray, action_mask: np.ndarray) -> np.ndarray:
    """Action probabilities from an actor's logits, zero where the mask is 0."""
    z = np.where(action_mask > 0, logits, -np.inf)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)
