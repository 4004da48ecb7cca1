"""QLM's step-time curve read from the TPOT heads instead of the engine model (`step_curve = "heads"`).

QLM's completion-time estimate (rct.py) needs each instance's decode step as a
line over the batch: a lone step and a slope per extra sequence. By default it
reads them from the engine model the simulator and the emulator run, so in
simulation it is exact. A live pool offers no such curve; what the gateway
has learnt of it is the TPOT heads (estimators/latency.py), which answer one
request's time per token for an instance state. This module asks the heads
for the steady state at each batch size and fits the line through their
answers, so QLM plans with what was learnt and its error shows.

The steady state at b sequences: b running and in flight, none waiting, no
prefill pending, each running answer half done (b x half a typical answer
still to decode), the KV cache holding b typical contexts, and the decode
rate those b make at the head's own answer (b / TPOT, solved by iterating).
The heads do not predict prefill, so the prefill rate stays the engine
model's; a tier without a head keeps the engine's curve.
"""

from __future__ import annotations

import numpy as np

from gateway.core.engine.engine import EngineSpec
from gateway.core.view import STATE_FEATURES, tier_key

# The batch sizes the heads are asked about (those up to the instance's max_num_seqs).
BATCHES = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)
TYPICAL_PROMPT_TOKENS = 256
FIXED_POINT_ROUNDS = 5  # the decode rate a state shows depends on the TPOT the head gives it


def steady_state(batch: int, tpot_s: float, spec: EngineSpec, prompt_tokens: float,
                 answer_tokens: float) -> np.ndarray:
    """A head's feature row for `batch` sequences decoding at `tpot_s` (STATE_FEATURES, then the request)."""
    kv_tokens = spec.num_gpu_blocks * spec.block_size
    state = {
        "running": batch, "waiting": 0.0,
        "kv_usage": min(1.0, batch * (prompt_tokens + answer_tokens / 2) / kv_tokens) if kv_tokens else 0.0,
        "decode_rate": batch / tpot_s, "in_flight": batch, "pending_prefill_tokens": 0.0,
        "pending_decode_tokens": batch * answer_tokens / 2,
    }
    return np.array([[*(state[f] for f in STATE_FEATURES), prompt_tokens, answer_tokens]])


def heads_curve(heads, inst, spec: EngineSpec, answer_tokens: float, slowdown: float,
                prompt_tokens: float = TYPICAL_PROMPT_TOKENS) -> tuple[float, float] | None:
    """(lone step in seconds, batch slope as a share of it) fitted through the heads' steady-state answers,
    or None when the instance's tier has no head.

    The fit keeps the batches QLM plans with: those up to the first whose step reaches `slowdown` x the
    lone step (the cap is there, rct.InstanceModel.of). Beyond the loads a head was trained on its trees
    answer flat, and a line through those answers would bend the part QLM uses (a head that is monotone in
    its load features flattens below 1.5 x `slowdown` x the lone step, so a bound on the step alone let the
    flat answers in and doubled the cap). The line is Theil-Sen's (the median of the slopes between pairs
    of points), so one odd answer of a tree does not tilt it."""
    tier = tier_key(inst.model, inst.gpu)
    if tier not in heads.boosters:
        return None
    batches = np.array([b for b in BATCHES if b <= inst.max_num_seqs], dtype=float)
    steps = np.empty(len(batches))
    for k, b in enumerate(batches):
        tpot = spec.tpot_s
        for _ in range(FIXED_POINT_ROUNDS):
            tpot = float(heads.tpot(tier, steady_state(int(b), tpot, spec, prompt_tokens, answer_tokens))[0])
        steps[k] = tpot
    reached = np.flatnonzero(steps >= slowdown * steps[0])
    used = slice(0, reached[0] + 1 if len(reached) else len(steps))
    x, y = batches[used] - 1, steps[used]
    if len(x) < 2:
        return float(steps[0]), 0.0
    i, j = np.triu_indices(len(x), k=1)
    slope = max(float(np.median((y[j] - y[i]) / (x[j] - x[i]))), 0.0)
    lone = max(float(np.median(y - slope * x)), float(y.min()))  # not below the fastest answer
    return lone, slope / lone
