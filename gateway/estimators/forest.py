"""An XGBoost regression forest evaluated with numpy, for the few rows a routing decision asks about.

XGBoost's `inplace_predict` costs 0.6-0.9 ms a call here however few the
rows, and the scheduler calls a TPOT head once per tier a batch, and again
for a tier after each dispatch into it. Walking all the trees at once, one
level per step, costs about an eighth of that for one row and half for
thirteen, and as much for fifty (`routebalance bench` prints both; the
heads use the walk up to latency.WALK_ROWS rows). The walk is XGBoost's own:
a float32 feature below the split goes left, a missing one (NaN) goes the
node's default way, and the leaves are summed onto the base score, so the
predictions agree with XGBoost's to float32 rounding (tests/test_forest.py).

Only what `estimators/latency.py` trains is read: one target, numeric
splits, gbtree. A model that is anything else is refused at load, not
mispredicted.
"""

from __future__ import annotations

import json

import numpy as np
import xgboost as xgb

from gateway.artefacts import ArtefactError


class Forest:
    """The trees of one booster as flat arrays: node i of the forest splits on `feature[i]` at `threshold[i]`;
    its children are `child[2 * i]` (right) and `child[2 * i + 1]` (left). A leaf is its own child and keeps
    its value in `threshold`, so walking `depth` levels from every root ends on each tree's leaf."""

    __slots__ = ("base", "roots", "feature", "threshold", "default_left", "child", "depth")

    def __init__(self, booster: xgb.Booster):
        learner = json.loads(booster.save_raw("json"))["learner"]
        params = learner["learner_model_param"]
        if learner["gradient_booster"]["name"] != "gbtree" or params.get("num_target", "1") != "1":
            raise ArtefactError("a TPOT head must be a single-target gbtree regression")
        base = params["base_score"]
        self.base = np.float32(json.loads(base)[0] if base.startswith("[") else float(base))
        trees = learner["gradient_booster"]["model"]["trees"]
        roots, feature, threshold, default_left, child, depths = [], [], [], [], [], []
        offset = 0
        for tree in trees:
            if any(tree.get("split_type", ())):
                raise ArtefactError("a TPOT head must split on numbers only (it has categorical splits)")
            left, right = np.array(tree["left_children"]), np.array(tree["right_children"])
            nodes = np.arange(len(left))
            leaf = left == -1
            roots.append(offset)
            feature.append(np.where(leaf, 0, tree["split_indices"]))
            threshold.append(np.array(tree["split_conditions"], dtype=np.float32))
            default_left.append(np.array(tree["default_left"], dtype=bool))
            child.append(np.stack([np.where(leaf, nodes, right), np.where(leaf, nodes, left)], axis=1) + offset)
            depths.append(_depth(left, right))
            offset += len(left)
        self.roots = np.array(roots, dtype=np.intp)
        self.feature = np.concatenate(feature).astype(np.intp)
        self.threshold = np.concatenate(threshold)
        self.default_left = np.concatenate(default_left)
        self.child = np.concatenate(child).ravel().astype(np.intp)
        self.depth = max(depths, default=0)

    def predict(self, x: np.ndarray) -> np.ndarray:
        """The booster's prediction for each row of `x` (n, features), float32."""
        x = np.ascontiguousarray(x, dtype=np.float32)
        n, width = x.shape
        flat = x.ravel()
        missing = bool(np.isnan(flat).any())
        row_start = (np.arange(n, dtype=np.intp) * width)[:, None]
        node = np.tile(self.roots, (n, 1))
        for _ in range(self.depth):
            value = flat[row_start + self.feature[node]]
            went_left = value < self.threshold[node]
            if missing:
                went_left = np.where(np.isnan(value), self.default_left[node], went_left)
            node = self.child[2 * node + went_left]
        return self.threshold[node].sum(axis=1, dtype=np.float32) + self.base


def _depth(left: np.ndarray, right: np.ndarray) -> int:
    """The longest root-to-leaf path of one tree (levels of splits)."""
    deepest, stack = 0, [(0, 0)]
    while stack:
        node, depth = stack.pop()
        if left[node] == -1:
            deepest = max(deepest, depth)
        else:
            stack += [(left[node], depth + 1), (right[node], depth + 1)]
    return deepest
