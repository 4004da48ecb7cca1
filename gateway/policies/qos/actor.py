"""The qos-rl policy's actor, served with onnxruntime (no PyTorch at serving time).

`routebalance train-policy qos-rl` (gateway/lab/training/qos_rl.py) writes
`actor.onnx` and a JSON sidecar, `actor.json`, that names the feature layout
it was trained on (gateway/policies/qos/state.layout()); a sidecar of
another layout is refused at load, not met as a shape error on the serving
path. The session runs on the CPU with one thread: one forward is a few
thousand multiply-adds, and the scheduler's worker must not compete with the
embedder for cores.

The scheduling core cannot import onnxruntime; the policy gets this object
from its build context (the estimators bundle's `qos_actor(path)`) and calls
it as `qos_state.Actor`: the encoded inputs -> logits.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from gateway.artefacts import ArtefactError
from gateway.policies.qos.state import INPUTS, layout

REPO_ROOT = Path(__file__).resolve().parents[3]


def resolve(path: str | Path) -> Path:
    """A relative actor path: from the working directory if it is there, else from the checkout."""
    p = Path(path)
    if p.is_absolute() or p.exists():
        return p
    return REPO_ROOT / p


def sidecar(path: Path) -> Path:
    return path.with_suffix(".json")


class QosActor:
    """An exported actor: `actor(inputs)` -> logits (batch, 1 + N_MAX); `probabilities(inputs)` after the mask."""

    def __init__(self, path: str | Path, threads: int = 1):
        import onnxruntime as ort

        self.path = resolve(path)
        if not self.path.is_file():
            raise ArtefactError(f"{self.path}: no qos-rl actor; run `routebalance train-policy qos-rl`")
        meta_path = sidecar(self.path)
        try:
            self.meta = json.loads(meta_path.read_text())
        except (OSError, ValueError) as e:
            raise ArtefactError(f"{meta_path}: the actor's sidecar is missing or unreadable ({e})") from e
        if self.meta.get("layout") != layout():
            raise ArtefactError(f"{meta_path}: the actor was trained on another feature layout than this gateway "
                                "encodes; retrain with `routebalance train-policy qos-rl`")
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        try:
            self.session = ort.InferenceSession(str(self.path), opts, providers=["CPUExecutionProvider"])
        except Exception as e:  # onnxruntime raises its own exception types for a corrupt graph
            raise ArtefactError(f"{self.path}: not a loadable ONNX actor ({e})") from e
        names = [i.name for i in self.session.get_inputs()]
        if names != list(INPUTS):
            raise ArtefactError(f"{self.path}: inputs {names}, expected {list(INPUTS)}")

    def __call__(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        feed = {k: np.ascontiguousarray(inputs[k], dtype=np.float32) for k in INPUTS}
        return self.session.run(None, feed)[0]

    def probabilities(self, inputs: Mapping[str, np.ndarray]) -> np.ndarray:
        from gateway.policies.qos.state import masked_softmax

        return masked_softmax(self(inputs).astype(np.float64), inputs["action_mask"])
