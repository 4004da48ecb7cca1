"""ELDR's expert signature: a prompt's prefill expert counts, reweighted by inverse document frequency.

The paper (papers/eldr-expert-locality-routing.txt, "Expert Signature")
builds a request's signature from the experts its prefill tokens were routed
to: per MoE layer and expert, how many of its tokens took that expert (top-k
counts, not gate scores), times w(l, e) = log((|C| + 1) / (df(l, e) + 1)),
where df counts the calibration requests in which the expert fired at that
layer (an expert every request uses says little about which one this is),
concatenated over layers and L2-normalised, so that the cosine between two
signatures tracks how much their decode experts overlap.

What is left out: the paper's greedy layer selection (keeping the layers
that raise the rank correlation; +0.005-0.032 in its Fig. 8) - every layer
is kept.

The counts come from whoever ran the prefill: a disaggregated prefill worker
in the paper; here, only the simulator's MoE engine (engine/moe.py
`ExpertModel.prefill_counts`), since the gateway routes before any prefill.
"""

from __future__ import annotations

import numpy as np


def idf(counts: np.ndarray) -> np.ndarray:
    """(layers, experts) weights from the calibration requests' counts (n, layers, experts)."""
    counts = np.asarray(counts)
    df = (counts > 0).sum(axis=0)
    return np.log((len(counts) + 1) / (df + 1.0))


def signatures(counts: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """(n, layers x experts) unit count-IDF signatures of the requests' counts (n, layers, experts)."""
    counts = np.asarray(counts, dtype=np.float32)
    x = (counts * np.asarray(weights, dtype=np.float32)).reshape(len(counts), -1)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
