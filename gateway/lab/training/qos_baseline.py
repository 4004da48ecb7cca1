"""The QoS routing paper's "Baseline RL" (papers/qos-aware-edge-routing.txt, section VI-A), as networks for
the soft actor-critic of qos_rl.py.

The paper adapts earlier RL request routers, built for identical instances,
by leaving out its two contributions:

- no dynamic state abstraction: the state is only the expert-level features
  (e_n, |running_n|, |waiting_n|) of each expert, stacked, fed to
  two-layer perceptrons (no per-request features, nothing about the arrived
  request, no impact estimate);
- no QoS-aware reward: r_j is the QoS of the requests completed since
  decision j, with no impact penalty (TrainSettings gain="eq16",
  penalty_weight=0; `baseline_settings`).

Here the expert-level features are columns of the same encoded state the
`qos-rl` actor reads (gateway/policies/qos/state.py): KV-cache use (the
paper's GPU memory share), running/64 and waiting/16; the action mask says
which instances exist. Taking the same inputs lets the exported actor run
in the `qos-rl` policy unchanged (its ONNX loader checks the inputs), so the
comparison differs only in what the networks look at and how they are rewarded.
"""

from __future__ import annotations

import torch
from torch import nn

from gateway.policies.qos.state import INSTANCE_FEATURES, INVALID_LOGIT, N_MAX

RAW_FEATURES = ("kv_usage", "running/64", "waiting/16")
_FIRST = INSTANCE_FEATURES.index(RAW_FEATURES[0])
assert INSTANCE_FEATURES[_FIRST:_FIRST + len(RAW_FEATURES)] == RAW_FEATURES  # one slice, for the ONNX export


def _raw(instances: torch.Tensor, action_mask: torch.Tensor, *unused: torch.Tensor) -> torch.Tensor:
    """The stacked expert-level features and the instance mask, (B, N_MAX x 3 + N_MAX).

    The inputs the baseline does not read enter with weight zero, so the
    ONNX export keeps them as graph inputs (the qos-rl loader requires all five)."""
    x = instances[:, :, _FIRST:_FIRST + len(RAW_FEATURES)].flatten(1)
    ignored = sum((u.sum() * 0.0 for u in unused), torch.zeros(()))
    return torch.cat([x, action_mask[:, 1:]], dim=-1) + ignored


def _perceptron(hidden: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(N_MAX * (len(RAW_FEATURES) + 1), hidden), nn.ReLU(),
                         nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1 + N_MAX))


class ExpertActor(nn.Module):
    """Logits over {drop, instance 0..N_MAX-1} from the expert-level features; invalid ones at INVALID_LOGIT."""

    def __init__(self, hidden: int):
        super().__init__()
        self.net = _perceptron(hidden)

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        logits = self.net(_raw(instances, action_mask, requests, request_mask, arrival))
        return torch.where(action_mask > 0.5, logits, torch.full_like(logits, INVALID_LOGIT))


class ExpertTwinCritic(nn.Module):
    """Two Q perceptrons over every action, from the same features."""

    def __init__(self, hidden: int):
        super().__init__()
        self.heads = nn.ModuleList(_perceptron(hidden) for _ in range(2))

    def forward(self, requests, request_mask, instances, arrival, action_mask):
        x = _raw(instances, action_mask)
        return tuple(head(x) for head in self.heads)
