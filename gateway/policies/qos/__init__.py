"""QoS-aware routing (papers/qos-aware-edge-routing.txt): the action-impact estimator (impact.py), the
heuristic and the learned policy (policy.py), the learned policy's state encoding (state.py) and its
ONNX actor (actor.py)."""

from gateway.policies.qos.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
