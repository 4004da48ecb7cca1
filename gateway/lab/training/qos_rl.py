"""Training the `qos-rl` policy: a discrete soft actor-critic in the simulator, exported to ONNX.

    routebalance train-policy qos-rl            # writes models/qos_rl/{actor.onnx, actor.json, learning_curve.*}

The paper's design (papers/qos-aware-edge-routing.txt, section V), at the
size two CPU cores train in minutes:

- State: the dynamic state abstraction (gateway/policies/qos/state.py,
  the features serving uses too): per instance, its tracked requests'
  features, pooled by attention with the instance's own features as the
  query (the paper's request -> expert edges of its heterogeneous graph);
  then the arrived request attends over the instances (its edges to every
  expert). The instance embeddings, the pooled context and the arrived
  request's embedding give one logit per instance plus one for dropping.
  Hidden size 24: about 11,000 parameters per network (the paper's HAN has
  19K, its actor-critic 10K).
- Actions: {drop, instance 1..N}, masked to the request's candidates.
- Reward (Eq. 16): QoS of completed requests that met their bound, minus the
  predicted quality of running requests on the chosen instance that the
  action-impact estimator says will miss their bound. Two readings:
  `gain="eq16", penalty="eq16"` is the equation as written: the QoS of
  whatever completed since the last decision, and every running request
  there predicted to miss. Here it taught the actor to drop: the first term
  does not depend on the action and the second punishes any busy instance,
  even for requests that were late anyway, so dropping (no penalty) looked
  best (greedy evaluation QoS fell to 0.04). The default,
  `gain="credited", penalty="marginal"`, credits each request's QoS to the
  decision that placed it (the same total over an episode) and charges an
  action only for the running requests it pushes over their bound.
- Learning: discrete SAC (Christodoulou 2019): twin Q heads over all actions
  on one shared encoder with a target copy, a soft policy, the temperature
  tuned to a target entropy that is a share of log(valid actions). gamma is
  short (0.5): what an action does to later requests is in its impact term.
- Demonstrations (not in the paper): the replay starts with episodes of the
  `qos` heuristic's decisions, which the actor first imitates while the
  critics learn; then SAC fine-tunes it. From a random actor SAC reached
  0.375 evaluation QoS in 200 s against the heuristic's 0.398; imitation
  starts it at the heuristic's level. `demo_episodes=0` is SAC from scratch
  (`--demo-episodes 0`; docs/results/qos.md has such a run's curve).
- The paper's Baseline RL (`baseline_settings`, `--baseline-rl`): the same
  SAC over the expert-level features alone (qos_baseline.py) with the
  QoS completed since each decision as its reward; its actor takes the same
  inputs, so it is exported and served as a `qos-rl` actor.

Episodes are simulated cells (gateway/lab/sim/simulator.py `run_cell`) on pools
of 3 to 13 instances drawn from the config's (or, `similar_share` of them,
the qos-similar pool of like experts, lab/sim/pools.py), Poisson or gamma-bursty
arrivals, a range of rates per instance and bounds L; the policy object runs
exactly as it serves (gateway/policies/qos/policy.py), with a torch
actor in place of the ONNX one and an observer that records its decisions
and the completions. After every few episodes the greedy actor is evaluated
on fixed held-out cells (the pools of lab/sim/pools.pool_names); the best one is
exported, as in the paper ("save the models that achieve the best evaluation
results"). Training stops at a wall-clock budget, so the number of steps
depends on the machine (and on what else runs on it): the sidecar records
them.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from gateway.core.policy import PolicyContext, PolicyEntry
from gateway.core.request import Completion, RouteRequest, Ticket
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import EvalSet, subset
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.pools import GAMMA_SHAPE, pool_names, qos_similar
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.policies import registry
from gateway.policies.qos.impact import Assessment
from gateway.policies.qos.policy import Qos, QosRl
from gateway.policies.qos.state import (
    ARRIVAL_FEATURES,
    INPUTS,
    INSTANCE_FEATURES,
    INVALID_LOGIT,
    N_MAX,
    R_MAX,
    REQUEST_FEATURES,
    layout,
)

log = logging.getLogger(__name__)

TRAIN_POLICY = "qos-rl-train"  # registered for the length of a training run only
DEMO_POLICY = "qos-demonstrations"  # ... and the heuristic whose decisions start the replay
DEFAULT_OUT = Path("models/qos_rl")
EVAL_CELLS = ((3, 4.0, 50.0, "poisson"), (6, 3.0, 30.0, "gamma"), (6, 4.0, 80.0, "poisson"),
              (13, 1.5, 50.0, "poisson"))  # (N, req/s per instance, L ms, arrivals): held-out prompts and seeds


@dataclass(frozen=True)
class TrainSettings:
    seed: int = 0
    budget_s: float = 480.0  # wall-clock seconds for collecting and learning (evaluation and export come on top)
    max_episodes: int = 100_000
    episode_requests: int = 400
    train_prompts: int = 1800  # episodes replay windows of the first this many held-out prompts ...
    eval_requests: int = 300  # ... and evaluation cells the ones after them
    hidden: int = 24
    gamma: float = 0.5  # short: the impact term carries what an action does to the others
    lr: float = 1e-3
    batch: int = 64
    updates_per_step: float = 0.25  # gradient updates per recorded decision
    warmup_steps: int = 1000  # decisions recorded before the first update
    # The replay starts with this many episodes of the `qos` heuristic's decisions, and the actor first
    # imitates them for `imitation_updates` steps (the critics learn meanwhile); then SAC takes over, its
    # temperature starting at `initial_alpha`. 0 demonstrations: SAC from a random actor, as in the paper.
    demo_episodes: int = 12
    imitation_updates: int = 600
    initial_alpha: float = 0.02
    finetune_lr: float = 3e-4  # the actor's learning rate once it has imitated (lr before)
    imitation_weight: float = 0.1  # SAC's actor loss keeps this much of the imitation loss on demonstrations
    replay: int = 100_000
    tau: float = 0.02  # target critics' Polyak step
    entropy_share: float = 0.3  # target entropy: this share of log(valid actions)
    # The reward's QoS term: "credited" (each request's QoS to its own decision) or "eq16" (Eq. 16 as
    # written: the QoS completed since the decision); its impact term: "marginal" (the running requests the
    # action pushes over their bound) or "eq16" (every running request there predicted to miss). See
    # Recorder.rewards; the module docstring says why the defaults are not Eq. 16 as written.
    gain: str = "credited"
    penalty: str = "marginal"
    penalty_weight: float = 1.0
    eval_every: int = 10  # episodes between evaluations
    sizes: tuple[int, int] = (3, 13)  # pool sizes drawn per episode
    rates_per_instance: tuple[float, float] = (0.5, 6.0)
    bounds_ms: tuple[float, ...] = (25.0, 30.0, 40.0, 50.0, 65.0, 80.0, 100.0)
    similar_share: float = 0.0  # share of episodes on the qos-similar pool (lab/sim/pools.py) instead
    # The networks: "dsa", the dynamic state abstraction (this module's StateEncoder), or "expert", the
    # paper's Baseline RL (only the expert-level features; qos_baseline.py).
    network: str = "dsa"
    drop: bool = True  # False masks the drop action in training and evaluation: every request is placed
    threads: int = 1  # tiny batches: a second thread costs more in handoffs than it brings

    def __post_init__(self):
        if self.network not in ("dsa", "expert"):
            raise ValueError(f"network 'dsa' or 'expert' ({self.network!r})")
        if self.gain not in ("eq16", "credited") or self.penalty not in ("eq16", "marginal"):
            raise ValueError(f"gain 'eq16' or 'credited' ({self.gain!r}), penalty 'eq16' or 'marginal' "
                             f"({self.penalty!r})")


def baseline_settings(**changes) -> TrainSettings:
    """The paper's Baseline RL (qos_baseline.py): expert-level features, the QoS completed since each decision
    as the reward (no impact penalty), SAC from a random actor. Its reward reaches an action only through
    the completions that follow it, so the discount is long (0.99, as in SAC's own paper), not 0.5."""
    return TrainSettings(**{"network": "expert", "gain": "eq16", "penalty": "eq16", "penalty_weight": 0.0,
                            "gamma": 0.99, "demo_episodes": 0, "hidden": 64, **changes})


# ---- the networks -----------------------------------------------------------------------------

def _mlp(n_in: int, hidden: int, n_out: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(n_in, hidden), nn.ReLU(), nn.Linear(hidden, n_out))


def _attend(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Masked dot-product attention over the second-to-last axis of keys/values; all-masked rows pool to 0."""
    scores = (query.unsqueeze(-2) * keys).sum(-1) / math.sqrt(keys.shape[-1])
    scores = torch.where(mask > 0.5, scores, torch.full_like(scores, INVALID_LOGIT))
    weights = torch.softmax(scores, dim=-1) * mask
    weights = weights / (weights.sum(-1, keepdim=True) + 1e-6)
    return (weights.unsqueeze(-1) * values).sum(-2)


class StateEncoder(nn.Module):
    """Requests -> attention-pooled per instance -> instance embeddings; the arrived request over instances."""

    def __init__(self, hidden: int):
        super().__init__()
        self.request = _mlp(len(REQUEST_FEATURES), hidden, hidden)
        self.instance = _mlp(len(INSTANCE_FEATURES), hidden, hidden)
        self.arrival = _mlp(len(ARRIVAL_FEATURES), hidden, hidden)
        self.pool_q, self.pool_k, self.pool_v = (nn.Linear(hidden, hidden) for _ in range(3))
        self.merge = _mlp(2 * hidden, hidden, hidden)
        self.look_q, self.look_k, self.look_v = (nn.Linear(hidden, hidden) for _ in range(3))

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        r = torch.relu(self.request(requests))  # (B, N, R, H)
        i = torch.relu(self.instance(instances))  # (B, N, H)
        pooled = _attend(self.pool_q(i), self.pool_k(r), self.pool_v(r), request_mask)  # (B, N, H)
        e = torch.relu(self.merge(torch.cat([i, pooled], dim=-1)))  # (B, N, H)
        a = torch.relu(self.arrival(arrival))  # (B, H)
        context = _attend(self.look_q(a), self.look_k(e), self.look_v(e), action_mask[:, 1:])  # (B, H)
        return e, context, a


class ActionHead(nn.Module):
    """One value per action: drop (from the context and the arrived request), then each instance."""

    def __init__(self, hidden: int):
        super().__init__()
        self.encoder = StateEncoder(hidden)
        self.per_instance = _mlp(3 * hidden, hidden, 1)
        self.drop = _mlp(2 * hidden, hidden, 1)

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        e, context, a = self.encoder(requests, request_mask, instances, arrival, action_mask)
        n = e.shape[1]
        both = torch.cat([context, a], dim=-1)
        per = self.per_instance(torch.cat([e, both.unsqueeze(1).expand(-1, n, -1)], dim=-1)).squeeze(-1)
        return torch.cat([self.drop(both), per], dim=-1)  # (B, 1 + N)


class TwinCritic(nn.Module):
    """Two Q heads over every action on one shared state encoder."""

    def __init__(self, hidden: int):
        super().__init__()
        self.encoder = StateEncoder(hidden)
        self.heads = nn.ModuleList(_QHead(hidden) for _ in range(2))

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        e, context, a = self.encoder(requests, request_mask, instances, arrival, action_mask)
        return tuple(head(e, context, a) for head in self.heads)


class _QHead(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.per_instance = _mlp(3 * hidden, hidden, 1)
        self.drop = _mlp(2 * hidden, hidden, 1)

    def forward(self, e, context, a):
        n = e.shape[1]
        both = torch.cat([context, a], dim=-1)
        per = self.per_instance(torch.cat([e, both.unsqueeze(1).expand(-1, n, -1)], dim=-1)).squeeze(-1)
        return torch.cat([self.drop(both), per], dim=-1)


class Actor(nn.Module):
    """Logits over {drop, instance 0..N_MAX-1}, invalid actions at INVALID_LOGIT: what ONNX serves."""

    def __init__(self, hidden: int):
        super().__init__()
        self.head = ActionHead(hidden)

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        logits = self.head(requests, request_mask, instances, arrival, action_mask)
        return torch.where(action_mask > 0.5, logits, torch.full_like(logits, INVALID_LOGIT))


def _tensors(inputs: Mapping[str, np.ndarray]) -> list[torch.Tensor]:
    return [torch.as_tensor(np.asarray(inputs[k], dtype=np.float32)) for k in INPUTS]


class TorchActor:
    """The training actor as the policy calls it (qos_state.Actor): numpy in, numpy logits out."""

    def __init__(self, net: Actor):
        self.net = net

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        with torch.no_grad():
            return self.net(*_tensors(inputs)).numpy()


# ---- recording decisions -------------------------------------------------------------------------

class Recorder:
    """The policy's observer during one episode: its states, actions, Eq. 16 penalties and completions."""

    def __init__(self, label_score: np.ndarray):
        self.label_score = label_score  # (requests, instances) of the episode's pool
        self.states: list[dict[str, np.ndarray]] = []
        self.actions: list[int] = []
        self.penalties: list[float] = []  # Eq. 16's: every running request there predicted to miss its bound
        self.flips: list[float] = []  # only the ones this action pushes over it
        self.completed_since: list[float] = []  # Eq. 16's first term: QoS completed after decision t
        self.own: list[float] = []  # the request's own QoS, credited to its decision
        self._by_request: dict[int, int] = {}
        self.qos: list[float] = []

    def decided(self, request: RouteRequest, state, action: int, assessment: Assessment, now: float) -> None:
        self._by_request[id(request)] = len(self.states)
        self.states.append(state)
        self.actions.append(action)
        self.penalties.append(0.0 if action == 0 else float(assessment.violations[action - 1]))
        self.flips.append(0.0 if action == 0 else float(assessment.flips[action - 1]))
        self.completed_since.append(0.0)
        self.own.append(0.0)

    def completed(self, ticket: Ticket, completion: Completion, now: float) -> None:
        phi = 0.0
        bound = ticket.request.tpot_slo_s
        if completion.ok and completion.instance is not None and bound is not None:
            tpot = (now - ticket.arrived) / max(completion.completion_tokens, 1)
            phi = float(self.label_score[ticket.handle, completion.instance]) if tpot <= bound else 0.0
        self.qos.append(phi)
        if self.completed_since:
            self.completed_since[-1] += phi
        t = self._by_request.pop(id(ticket.request), None)
        if t is not None:
            self.own[t] += phi

    def rewards(self, gain: str, penalty: str, penalty_weight: float) -> np.ndarray:
        """Per decision: Eq. 16's first term ("eq16": QoS completed since it) or the request's own QoS
        ("credited"), minus Eq. 16's second ("eq16": every running request predicted to miss there, or
        "marginal": those the action pushes over)."""
        got = np.array(self.completed_since if gain == "eq16" else self.own)
        return got - penalty_weight * np.array(self.penalties if penalty == "eq16" else self.flips)


class Replay:
    """Transitions (s, a, r, s', done) in preallocated arrays, oldest overwritten."""

    def __init__(self, capacity: int, seed: int):
        shapes = {"requests": (N_MAX, R_MAX, len(REQUEST_FEATURES)), "request_mask": (N_MAX, R_MAX),
                  "instances": (N_MAX, len(INSTANCE_FEATURES)), "arrival": (len(ARRIVAL_FEATURES),),
                  "action_mask": (1 + N_MAX,)}
        self.s = {k: np.zeros((capacity, *shapes[k]), dtype=np.float32) for k in INPUTS}
        self.s2 = {k: np.zeros((capacity, *shapes[k]), dtype=np.float32) for k in INPUTS}
        self.a = np.zeros(capacity, dtype=np.int64)
        self.r = np.zeros(capacity, dtype=np.float32)
        self.done = np.zeros(capacity, dtype=np.float32)
        self.demo = np.zeros(capacity, dtype=np.float32)  # 1: the heuristic's decision (its action is a label)
        self.capacity, self.size, self.next = capacity, 0, 0
        self.rng = np.random.default_rng(seed)

    def add_episode(self, states: Sequence[dict], actions: Sequence[int], rewards: np.ndarray,
                    demo: bool = False) -> None:
        for t in range(len(states)):
            k = self.next
            last = t == len(states) - 1
            for name in INPUTS:
                self.s[name][k] = states[t][name][0]
                self.s2[name][k] = states[t if last else t + 1][name][0]
            self.a[k], self.r[k], self.done[k], self.demo[k] = actions[t], rewards[t], float(last), float(demo)
            self.next = (k + 1) % self.capacity
            self.size = min(self.size + 1, self.capacity)

    def sample(self, n: int):
        idx = self.rng.integers(0, self.size, n)
        return ([torch.from_numpy(self.s[k][idx]) for k in INPUTS], torch.from_numpy(self.a[idx]),
                torch.from_numpy(self.r[idx]), [torch.from_numpy(self.s2[k][idx]) for k in INPUTS],
                torch.from_numpy(self.done[idx]), torch.from_numpy(self.demo[idx]))


# ---- soft actor-critic -----------------------------------------------------------------------------

class Sac:
    """Discrete SAC: twin Q heads over every action (one shared encoder), a target copy, a learned temperature."""

    def __init__(self, s: TrainSettings):
        self.s = s
        if s.network == "expert":
            from gateway.lab.training.qos_baseline import ExpertActor, ExpertTwinCritic

            self.actor: nn.Module = ExpertActor(s.hidden)
            self.critic: nn.Module = ExpertTwinCritic(s.hidden)
            self.critic_target: nn.Module = ExpertTwinCritic(s.hidden)
        else:
            self.actor, self.critic, self.critic_target = Actor(s.hidden), TwinCritic(s.hidden), TwinCritic(s.hidden)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)
        self.log_alpha = torch.zeros(1, requires_grad=True)
        self.actor_opt = torch.optim.Adam(self.actor.parameters(), lr=s.lr)
        self.critic_opt = torch.optim.Adam(self.critic.parameters(), lr=s.lr)
        self.alpha_opt = torch.optim.Adam([self.log_alpha], lr=s.lr)
        self.updates = 0

    def _policy(self, states) -> tuple[torch.Tensor, torch.Tensor]:
        log_p = torch.log_softmax(self.actor(*states), dim=-1)
        return log_p.exp(), log_p

    def update(self, batch, imitate: bool = False) -> dict[str, float]:
        """One gradient step of the critics, the actor and the temperature. `imitate`: the actor instead
        learns the batch's actions (behaviour cloning of the heuristic's demonstrations), the temperature
        stays, and the critics learn the values of the actor as it is."""
        states, actions, rewards, next_states, done, demo = batch
        valid, next_valid = states[-1] > 0.5, next_states[-1] > 0.5
        alpha = self.log_alpha.exp().detach()
        with torch.no_grad():
            p2, log_p2 = self._policy(next_states)
            q_next = torch.min(*self.critic_target(*next_states))
            v_next = torch.where(next_valid, p2 * (q_next - alpha * log_p2), torch.zeros_like(q_next)).sum(-1)
            target = rewards + self.s.gamma * (1.0 - done) * v_next
        q1_all, q2_all = self.critic(*states)
        q1 = q1_all.gather(1, actions[:, None]).squeeze(1)
        q2 = q2_all.gather(1, actions[:, None]).squeeze(1)
        critic_loss = nn.functional.mse_loss(q1, target) + nn.functional.mse_loss(q2, target)
        self.critic_opt.zero_grad()
        critic_loss.backward()
        self.critic_opt.step()

        p, log_p = self._policy(states)
        q = torch.min(q1_all, q2_all).detach()
        imitation = (nn.functional.nll_loss(log_p, actions, reduction="none") * demo).sum() / demo.sum().clamp(min=1)
        if imitate:
            actor_loss = imitation
        else:  # SAC's policy step, held near the demonstrations by `imitation_weight`
            actor_loss = torch.where(valid, p * (alpha * log_p - q), torch.zeros_like(q)).sum(-1).mean()
            actor_loss = actor_loss + self.s.imitation_weight * imitation
        self.actor_opt.zero_grad()
        actor_loss.backward()
        self.actor_opt.step()

        entropy = -torch.where(valid, p * log_p, torch.zeros_like(p)).sum(-1).detach()
        if not imitate:
            target_entropy = self.s.entropy_share * torch.log(valid.sum(-1).clamp(min=1).float())
            alpha_loss = (self.log_alpha * (entropy - target_entropy)).mean()
            self.alpha_opt.zero_grad()
            alpha_loss.backward()
            self.alpha_opt.step()

        with torch.no_grad():
            for w, wt in zip(self.critic.parameters(), self.critic_target.parameters(), strict=True):
                wt.mul_(1 - self.s.tau).add_(self.s.tau * w)
        self.updates += 1
        return {"critic_loss": float(critic_loss.detach()), "actor_loss": float(actor_loss.detach()),
                "alpha": float(alpha), "entropy": float(entropy.mean())}


# ---- episodes ---------------------------------------------------------------------------------------

class _Slot:
    """What the registered training policy is built with, swapped between episodes and evaluations."""

    actor: Callable | None = None
    observer: Recorder | None = None
    sample: bool = True  # explore (training episodes) or take the mode (evaluation)
    seed: int = 0  # the sampling seed of the next policy built
    drop: bool = True  # the drop action is open (TrainSettings.drop)


def _register(slot: _Slot) -> None:
    def build(context: PolicyContext) -> QosRl:
        options = dataclasses.replace(context.options("qos_rl"), sample=slot.sample, seed=slot.seed,
                                      drop=slot.drop)
        policy = QosRl(options, slot.actor, slot.observer)  # type: ignore[arg-type]
        policy.name = TRAIN_POLICY
        return policy

    registry.unregister(TRAIN_POLICY)
    registry.register(PolicyEntry(TRAIN_POLICY, build, "qos-rl while it trains", needs_estimates=True))


def _register_demonstrator(slot: _Slot) -> None:
    """The `qos` heuristic under DEMO_POLICY, reporting its decisions to the slot's observer."""
    def build(context: PolicyContext) -> Qos:
        policy = Qos(context.options("qos"), slot.observer)
        policy.name = DEMO_POLICY
        return policy

    registry.unregister(DEMO_POLICY)
    registry.register(PolicyEntry(DEMO_POLICY, build, "qos, demonstrating", needs_estimates=True))


def window(ev: EvalSet, start: int, n: int) -> EvalSet:
    """Prompts start..start+n of an evaluation set."""
    s = slice(start, start + n)
    return dataclasses.replace(ev, prompts=ev.prompts[s], prompt_tokens=ev.prompt_tokens[s],
                               label_score=ev.label_score[s], label_length=ev.label_length[s],
                               quality=ev.quality[s], length=ev.length[s], embeddings=ev.embeddings[s])


def _episode_cell(rng: np.random.Generator, cfg, ev: EvalSet, s: TrainSettings):
    if s.similar_share and rng.random() < s.similar_share:
        pool_cfg, pool_ev = qos_similar(cfg, ev)
        n = len(pool_cfg.instances)
    else:
        n = int(rng.integers(s.sizes[0], min(s.sizes[1], len(cfg.instances)) + 1))
        names = [cfg.instances[k].name for k in sorted(rng.choice(len(cfg.instances), n, replace=False))]
        pool_cfg, pool_ev = subset(cfg, ev, names)
    start = int(rng.integers(0, s.train_prompts - s.episode_requests + 1))
    rate = float(rng.uniform(*s.rates_per_instance)) * n
    kind = "gamma" if rng.random() < 0.5 else "poisson"
    spec = CellSpec(TRAIN_POLICY, arrivals=ArrivalSpec(kind, rate, shape=GAMMA_SHAPE),
                    requests=s.episode_requests, seed=int(rng.integers(1 << 31)),
                    tpot_slo_s=float(rng.choice(s.bounds_ms)) / 1000)
    return pool_cfg, window(pool_ev, start, s.episode_requests), spec


def _eval_cells(cfg, ev: EvalSet, s: TrainSettings):
    """The fixed evaluation cells: held-out prompts (after the training windows), fixed seeds."""
    cells = []
    for k, (n, per, bound_ms, kind) in enumerate(EVAL_CELLS):
        pool_cfg, pool_ev = subset(cfg, ev, pool_names(cfg.instances, n))
        spec = CellSpec(TRAIN_POLICY, arrivals=ArrivalSpec(kind, per * n, shape=GAMMA_SHAPE),
                        requests=s.eval_requests, seed=1000 + k, tpot_slo_s=bound_ms / 1000)
        cells.append((pool_cfg, window(pool_ev, s.train_prompts, s.eval_requests), spec))
    return cells


def evaluate(cells, estimators, policy: str = TRAIN_POLICY) -> list[float]:
    """Mean QoS of each evaluation cell under `policy` (the training one: the slot's actor, greedy)."""
    out = []
    for cfg, ev, spec in cells:
        result = run_cell(cfg, ev, dataclasses.replace(spec, policy=policy), estimators)
        out.append(float(summarise(result.outcomes, result.models)["qos"]))
    return out


# ---- training ---------------------------------------------------------------------------------------

@dataclass
class TrainResult:
    out_dir: Path
    meta: dict
    curve: list[dict] = field(default_factory=list)


def train(cfg, evalset: EvalSet, estimators, settings: TrainSettings = TrainSettings(),
          out_dir: Path = DEFAULT_OUT, command: str = "", progress: Callable[[dict], None] | None = None
          ) -> TrainResult:
    """Train, evaluate as it goes, export the best greedy actor to `out_dir` (module docstring)."""
    s = settings
    if len(evalset) < s.train_prompts + s.eval_requests:
        raise ValueError(f"the evaluation set holds {len(evalset)} prompts; training needs "
                         f"{s.train_prompts + s.eval_requests}")
    if len(cfg.instances) > N_MAX:
        raise ValueError(f"qos-rl places on at most {N_MAX} instances; the config has {len(cfg.instances)}")
    torch.manual_seed(s.seed)
    torch.set_num_threads(s.threads)
    rng = np.random.default_rng(s.seed)
    sac = Sac(s)
    replay = Replay(s.replay, s.seed)
    slot = _Slot()
    slot.drop = s.drop
    _register(slot)
    eval_cells = _eval_cells(cfg, evalset, s)
    try:
        slot.actor, slot.observer = TorchActor(sac.actor), None
        heuristic = evaluate(eval_cells, estimators, "qos")
        slot.sample = False
        start_qos = evaluate(eval_cells, estimators)
        curve = [_row(0, 0, 0, 0.0, math.nan, math.nan, start_qos, heuristic, {})]
        best = (float(np.mean(start_qos)), _snapshot(sac.actor), 0)
        if progress:
            progress(curve[-1])
        started, steps, episode, owed = time.monotonic(), 0, 0, 0.0
        rewards_since: list[float] = []
        qos_since: list[float] = []
        stats: dict[str, float] = {}
        if s.demo_episodes:
            _register_demonstrator(slot)
            for _ in range(s.demo_episodes):
                pool_cfg, ev, spec = _episode_cell(rng, cfg, evalset, s)
                slot.observer = recorder = Recorder(ev.label_score)
                run_cell(pool_cfg, ev, dataclasses.replace(spec, policy=DEMO_POLICY), estimators)
                rewards = recorder.rewards(s.gain, s.penalty, s.penalty_weight)
                replay.add_episode(recorder.states, recorder.actions, rewards, demo=True)
                steps += len(recorder.states)
                rewards_since.append(float(rewards.sum()))
                qos_since.append(float(np.mean(recorder.qos)) if recorder.qos else 0.0)
            slot.observer = None
            for _ in range(s.imitation_updates):
                stats = sac.update(replay.sample(s.batch), imitate=True)
            with torch.no_grad():
                sac.log_alpha.fill_(math.log(s.initial_alpha))
            for group in sac.actor_opt.param_groups:
                group["lr"] = s.finetune_lr
            qos = evaluate(eval_cells, estimators)
            curve.append(_row(0, steps, sac.updates, time.monotonic() - started, float(np.mean(rewards_since)),
                              float(np.mean(qos_since)), qos, heuristic, stats))
            rewards_since, qos_since = [], []
            if float(np.mean(qos)) > best[0]:
                best = (float(np.mean(qos)), _snapshot(sac.actor), 0)
            if progress:
                progress(curve[-1])
        while time.monotonic() - started < s.budget_s and episode < s.max_episodes:
            episode += 1
            pool_cfg, ev, spec = _episode_cell(rng, cfg, evalset, s)
            recorder = Recorder(ev.label_score)
            slot.observer, slot.sample, slot.seed = recorder, True, int(rng.integers(1 << 31))
            run_cell(pool_cfg, ev, spec, estimators)
            slot.observer, slot.sample = None, False
            if recorder.states:
                rewards = recorder.rewards(s.gain, s.penalty, s.penalty_weight)
                replay.add_episode(recorder.states, recorder.actions, rewards)
                steps += len(recorder.states)
                rewards_since.append(float(rewards.sum()))
                qos_since.append(float(np.mean(recorder.qos)) if recorder.qos else 0.0)
            if replay.size >= s.warmup_steps:
                owed += s.updates_per_step * len(recorder.states)
                while owed >= 1 and time.monotonic() - started < s.budget_s:
                    stats = sac.update(replay.sample(s.batch))
                    owed -= 1
            if episode % s.eval_every == 0:
                qos = evaluate(eval_cells, estimators)
                curve.append(_row(episode, steps, sac.updates, time.monotonic() - started,
                                  float(np.mean(rewards_since)), float(np.mean(qos_since)), qos, heuristic, stats))
                rewards_since, qos_since = [], []
                if float(np.mean(qos)) > best[0]:
                    best = (float(np.mean(qos)), _snapshot(sac.actor), episode)
                if progress:
                    progress(curve[-1])
        elapsed = time.monotonic() - started
    finally:
        registry.unregister(TRAIN_POLICY)
        registry.unregister(DEMO_POLICY)
    sac.actor.load_state_dict(best[1])
    meta = {
        "layout": layout(),
        "network": s.network,
        "seed": s.seed,
        "command": command,
        "training_s": round(elapsed, 1),
        "episodes": episode,
        "env_steps": steps,
        "updates": sac.updates,
        "best_episode": best[2],
        "best_eval_qos": round(best[0], 4),
        "heuristic_eval_qos": round(float(np.mean(heuristic)), 4),
        "start_eval_qos": round(float(np.mean(start_qos)), 4),
        "eval_cells": [{"n": n, "rate_per_instance": per, "tpot_slo_ms": b, "arrivals": k}
                       for n, per, b, k in EVAL_CELLS],
        "settings": {k: v for k, v in dataclasses.asdict(s).items()},
        "parameters": sum(p.numel() for p in sac.actor.parameters()),
        "torch": torch.__version__,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    export(sac.actor, out_dir / "actor.onnx", meta)
    write_curve(curve, out_dir)
    return TrainResult(out_dir, meta, curve)


def _snapshot(net: nn.Module) -> dict:
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


def _row(episode, steps, updates, wall_s, reward, train_qos, qos, heuristic, stats) -> dict:
    row = {"episode": episode, "env_steps": steps, "updates": updates, "wall_s": round(wall_s, 1),
           "episode_reward": reward, "train_qos": train_qos, "eval_qos": float(np.mean(qos)),
           "heuristic_eval_qos": float(np.mean(heuristic))}
    row |= {f"eval_qos_{k}": q for k, q in enumerate(qos)}
    return row | {k: stats.get(k, math.nan) for k in ("critic_loss", "actor_loss", "alpha", "entropy")}


# ---- export ---------------------------------------------------------------------------------------

def example_inputs(batch: int = 2) -> dict[str, np.ndarray]:
    """Zero states with every action valid: shapes for the export and a smoke test."""
    return {"requests": np.zeros((batch, N_MAX, R_MAX, len(REQUEST_FEATURES)), np.float32),
            "request_mask": np.zeros((batch, N_MAX, R_MAX), np.float32),
            "instances": np.zeros((batch, N_MAX, len(INSTANCE_FEATURES)), np.float32),
            "arrival": np.zeros((batch, len(ARRIVAL_FEATURES)), np.float32),
            "action_mask": np.ones((batch, 1 + N_MAX), np.float32)}


def export(actor: nn.Module, path: Path, meta: dict, check: Sequence[dict[str, np.ndarray]] = ()) -> None:
    """actor.onnx (batch axis dynamic) and its JSON sidecar; checks onnxruntime agrees with torch."""
    import onnxruntime as ort

    actor.eval()
    args = tuple(_tensors(example_inputs()))
    tmp = path.with_suffix(".tmp.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(actor, args, str(tmp), input_names=list(INPUTS), output_names=["logits"],
                          dynamic_axes={k: {0: "batch"} for k in (*INPUTS, "logits")}, opset_version=17,
                          dynamo=False)
    session = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    probe = example_inputs(4)
    probe = {k: (rng.random(v.shape).astype(np.float32) if k != "action_mask" else v) for k, v in probe.items()}
    for inputs in (probe, *check):
        want = TorchActor(actor)(inputs)
        got = session.run(None, {k: inputs[k] for k in INPUTS})[0]
        valid = inputs["action_mask"] > 0.5
        if not np.allclose(got[valid], want[valid], atol=1e-4, rtol=1e-4):
            raise RuntimeError("the ONNX export disagrees with the torch actor")
    tmp.replace(path)
    path.with_suffix(".json").write_text(json.dumps(meta, indent=1) + "\n")


def write_curve(curve: list[dict], out_dir: Path) -> list[Path]:
    """learning_curve.csv, and learning_curve.png when matplotlib is installed."""
    path = out_dir / "learning_curve.csv"
    keys = list(dict.fromkeys(k for r in curve for k in r))
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()} for r in curve)
    paths = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return paths
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    x = [r["env_steps"] for r in curve]
    left.plot(x, [r["eval_qos"] for r in curve], marker="o", label="qos-rl (greedy), evaluation cells")
    left.axhline(curve[0]["heuristic_eval_qos"], color="grey", linestyle="--", label="qos heuristic")
    left.set_xlabel("decisions recorded")
    left.set_ylabel("mean QoS")
    left.legend(fontsize=8)
    right.plot(x[1:], [r["episode_reward"] for r in curve[1:]], marker=".", color="tab:orange")
    right.set_xlabel("decisions recorded")
    right.set_ylabel("reward per episode (mean since last point)")
    fig.tight_layout()
    png = out_dir / "learning_curve.png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [*paths, png]


def main(cfg, settings: TrainSettings, out_dir: Path, command: str, prompts: int = 2500) -> TrainResult:
    """`routebalance train-policy qos-rl`: load the estimators and the evaluation set, train, report."""
    from gateway.estimators.bundle import Estimators
    from gateway.lab.sim.evalset import load_evalset
    from gateway.lab.training.build import ensure_built

    ensure_built(cfg)
    est = Estimators.load(cfg)
    ev = load_evalset(cfg, prompts, estimators=est)

    def report(row: dict) -> None:
        print(f"episode {row['episode']:>5}  decisions {row['env_steps']:>7}  updates {row['updates']:>6}  "
              f"{row['wall_s']:>6.0f}s  reward/episode {row['episode_reward']:8.2f}  "
              f"eval QoS {row['eval_qos']:.4f} (heuristic {row['heuristic_eval_qos']:.4f})", file=sys.stderr,
              flush=True)

    return train(cfg, ev, est, settings, out_dir, command, report)


def compare_curves(runs: Mapping[str, Path], out: Path) -> list[Path]:
    """Several runs' learning_curve.csv side by side: OUT.csv (a `run` column first) and OUT.png (greedy
    evaluation QoS against the decisions each had recorded, the qos heuristic's as a line), for the docs.

        python -c "from pathlib import Path; from gateway.lab.training.qos_rl import compare_curves; \\
            r = Path('loadtest/results'); compare_curves({'qos-rl from scratch': r / 'qos_rl_scratch', \\
            'Baseline RL': r / 'qos_baseline_rl', 'Baseline RL, no drop': r / 'qos_baseline_rl_nodrop', \\
            'qos-rl cloned (shipped)': Path('models/qos_rl')}, r / 'qos_learning')"

    (docs/results/qos.md shows that figure.)
    """
    rows = []
    for run, folder in runs.items():
        with (folder / "learning_curve.csv").open(newline="") as f:
            rows += [{"run": run, **r} for r in csv.DictReader(f)]
    keys = list(dict.fromkeys(k for r in rows for k in r))
    path = out.with_suffix(".csv")
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, keys)
        w.writeheader()
        w.writerows(rows)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [path]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for run in runs:
        mine = [r for r in rows if r["run"] == run]
        ax.plot([float(r["env_steps"]) for r in mine], [float(r["eval_qos"]) for r in mine], marker=".", label=run)
    ax.axhline(float(rows[0]["heuristic_eval_qos"]), color="grey", linestyle="--", label="qos heuristic")
    ax.set_xlabel("decisions recorded")
    ax.set_ylabel("mean QoS, evaluation cells (greedy)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    png = out.with_suffix(".png")
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return [path, png]
