"""RouteBalance's per-batch assignment (paper section 4.1, Algorithm 1), as plain functions.

Per batch: order the requests by their longest predicted answer (LPT); for
each, drop the candidates its budget cannot pay (Eq. 2), score the rest by
Eq. 1 and take the best, then add the request to the chosen instance's
state (dead reckoning) so the next request sees it. Quality and length are
prompt-intrinsic and come in once per batch; latency depends on instance
state and is re-derived after every dispatch.

The paper's latency is decode only. Where the gateway knows what each
instance holds in its prefix cache ([scheduler] prefix_cache, core/prefix.py)
the latency gains the seconds to prefill what a candidate would compute
(`scoring.prefill_latency`): the prompt minus the prefix it holds, at its
tier's prefill rate, after the prompts pending there ahead of it. That
score chooses the model. Among the chosen model's instances the hold of
that prefill on each request running there counts too
(`scoring.prefill_hold`: a prefill step holds the whole decode batch). So a
warm instance wins by what it saves, and only while its queue does not cost
more than that: load stays priced, a warm instance is preferred, not
flooded. Between instances of one tier whose scores differ by less than the
TPOT head can tell apart, the one holding more of the prompt wins
(`warmest_within_error`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.budget import predicted_cost, within_budget
from gateway.core.request import Decision, Estimates, Refusal, RouteRequest
from gateway.core.scoring import QualityTerm, eq1, expected_latency, prefill_hold, prefill_latency, quality_term
from gateway.core.view import PoolView

# Feature rows for a TPOT head: instance state (view.STATE_FEATURES) + prompt and answer tokens.
TpotFn = Callable[[str, np.ndarray], np.ndarray]  # (tier, rows) -> seconds per token
TIE = 1e-9  # scores this close are equal; the tie-break decides
LatencyTerm = Literal["heads", "prior", "off"]
PrefillTerm = Literal["cached", "cold"]
TieBreak = Literal["shortest_queue", "predicted"]


@section
class RouteBalanceOptions(Section):
    """[policies.routebalance]: variants of the score, for experiments (the paper's isolation arms).

    quality_term: the KNN score as is, or min-max normalised over the
    candidates; latency_term: the TPOT heads with live pending work, the
    tier's static prior (tpot_prior_ms x predicted length, no telemetry), or
    off (w_lat = 0); tiebreak among equal scores: the shorter queue, or the
    lower predicted latency then the shorter queue, and among instances
    equal on those too a seeded random choice (`seed`), so ties spread load
    instead of herding onto the lowest-numbered instance; lpt: longest
    predicted answer first within a batch; budget_filter: Eq. 2 before
    scoring (the dispatch clamp and the streaming stop apply either way);
    prefill_term (where the gateway looks at prefixes): the prefill of what a
    candidate does not hold, or of the whole prompt as if no instance held
    any of it (the ablation that tells pricing the prefill's load apart from
    knowing the caches); prefill_weight: how many times the request's own
    prefill counts (1: once, in its end-to-end time, as Eq. 1 prices
    latency; the default 4 weighs its time to first token too, which a
    streaming client waits through before it sees anything, and so favours
    warm instances); prefill_running_weight: how much the prefill's hold on
    each request running beside it counts when the instances of the model
    the request's own score chose are ranked (1: as much as the request's
    own time, the pool's total there; 0: the request's own latency alone);
    it spreads a model's load off busy warm instances and never changes the
    model, where across models it bought time to first token with cost
    (docs/results/prefix.md); tie_tolerance: how many times w_lat x the
    TPOT head's held-out error a tier-mate's score may be below the best's
    and still win by holding more of the prompt
    (`warmest_within_error`; 0: the score alone decides); tie_min_share:
    how much more of the prompt (a share of it) that tier-mate must hold
    than the best for it to win so (the chat template's opening block, which
    every instance that has served anything holds, must not decide).
    """

    quality_term: QualityTerm = "raw"
    latency_term: LatencyTerm = "heads"
    tiebreak: TieBreak = "shortest_queue"
    lpt: bool = True
    budget_filter: bool = True
    prefill_term: PrefillTerm = "cached"
    prefill_weight: float = option(4.0, ge=1)
    prefill_running_weight: float = option(1.0, ge=0)
    tie_tolerance: float = option(1.0, ge=0)
    tie_min_share: float = option(0.3, ge=0, le=1)
    seed: int = 0

    @property
    def uses_heads(self) -> bool:
        """The heads price latency in the score, or (w_lat = 0) break ties by predicted latency."""
        return self.latency_term == "heads" or (self.latency_term == "off" and self.tiebreak == "predicted")


def warmest_within_error(ranking: np.ndarray, scores: np.ndarray, cached: np.ndarray, tiers: Sequence[str],
                         tolerance: np.ndarray, min_gain: float) -> np.ndarray:
    """`ranking` with the candidate holding most of the prompt cached first, among the best's tier-mates whose
    score is within the best's `tolerance` of it, when it holds at least `min_gain` tokens more than the best
    (then the rest in their order).

    A tier's instances share one TPOT head, and what tells them apart is
    its answer to their different states. The head misses by its held-out
    relative error e, which moves the latency term (1 - T / max T) by up to
    w_lat x e: score differences within that are noise of the estimate, and
    the cached prefix is a saving the instance will show. In the simulator a
    spread of 3-10% between the head's answers for idle and lightly loaded
    3B instances outweighed the prefill a short history saves, and turns
    left their history (docs/policies/prefix.md). What a tier-mate holds
    decides only when it is `min_gain` tokens more than the best holds: every
    prompt opens with the chat template's block, so every instance that has
    served anything holds a little of every prompt, and live that block alone
    kept drawing new conversations to busy instances while one that had
    missed the first requests never got any."""
    best = int(ranking[0])
    if tolerance[best] <= 0:  # no latency term, or no error known: exact ties stay the queue's to break
        return ranking
    near = [int(k) for k in ranking if tiers[k] == tiers[best] and scores[k] >= scores[best] - tolerance[best]]
    warmest = max(near, key=lambda k: cached[k])  # the first of the most cached, in ranking order
    gain = cached[warmest] - cached[best]
    if gain <= 0 or gain < min_gain:
        return ranking
    return np.concatenate(([warmest], ranking[ranking != warmest]))


def lpt_order(lengths: Sequence[np.ndarray]) -> list[int]:
    """Requests by their longest predicted answer over their candidates, longest first (stable)."""
    keys = [float(row.max()) if len(row) else 0.0 for row in lengths]
    return sorted(range(len(keys)), key=lambda r: -keys[r])


class BatchLatency:
    """Per-(request, instance) TPOT for a batch, kept current as dispatches land.

    The heads run once per tier at the start (one call over every request of
    the batch on every instance of the tier) and again for an instance each
    time it gets a request, over the requests still to be decided that may go
    there (a decided request's row is never read again). A prediction never
    falls after a dispatch: added work cannot make an instance faster, and a
    tree's noise must not pull the next request onto the instance that just
    got one.
    """

    def __init__(self, batch: Sequence[RouteRequest], est: Estimates, view: PoolView, tpot: TpotFn | None,
                 tpot_error: Mapping[str, float] | None = None):
        self.tpot_fn = tpot
        # Per instance, its tier's TPOT head's held-out relative error (0: unknown, or the prior prices latency).
        errors = tpot_error if tpot is not None and tpot_error is not None else {}
        self.error = np.array([errors.get(tier, 0.0) for tier in view.tiers])
        self.inputs = np.array([r.input_tokens for r in batch], dtype=np.float64)
        self.length = est.length
        n, n_inst = est.length.shape
        if tpot is None:  # the static prior: nominal TPOT, no telemetry
            self.tpot = np.broadcast_to(view.tpot_prior_s, (n, n_inst)).copy()
            return
        self.tpot = np.empty((n, n_inst))
        for tier in dict.fromkeys(view.tiers):
            cols = [i for i, t in enumerate(view.tiers) if t == tier]
            rows = np.concatenate([self._rows(view, i) for i in cols])
            self.tpot[:, cols] = tpot(tier, rows).reshape(len(cols), n).T
        self._fill_unknown(view)

    def _fill_unknown(self, view: PoolView) -> None:
        """A tier the heads do not know (added by a reload) answers NaN: use its configured prior."""
        unknown = np.isnan(self.tpot)
        if unknown.any():
            self.tpot = np.where(unknown, view.tpot_prior_s[None, :], self.tpot)

    def _rows(self, view: PoolView, i: int, requests: slice | np.ndarray = slice(None)) -> np.ndarray:
        """The heads' feature rows of `requests` (all: the default) on instance i."""
        inputs, length = self.inputs[requests], self.length[requests, i]
        state = view.state_row(i)
        return np.column_stack([np.broadcast_to(state, (len(inputs), len(state))),
                                inputs, length]).astype(np.float32)

    def dispatched(self, view: PoolView, i: int, requests: np.ndarray) -> None:
        """Re-predict instance i's column for `requests` (row indices) after `view.dispatched` added a request
        to it."""
        if self.tpot_fn is not None and len(requests):
            fresh = self.tpot_fn(view.tiers[i], self._rows(view, i, requests))
            # fmax: a NaN (unknown tier) keeps the prior
            self.tpot[requests, i] = np.fmax(self.tpot[requests, i], fresh)


def assign_batch(batch: Sequence[RouteRequest], est: Estimates, view: PoolView, options: RouteBalanceOptions,
                 tpot: TpotFn | None, rng: np.random.Generator,
                 tpot_error: Mapping[str, float] | None = None) -> list[Decision]:
    """Algorithm 1: one Decision per request, in the batch's order. Updates `view` in place;
    `rng` breaks the ties that remain after the tie-break keys; `tpot_error` is each tier's TPOT head's held-out
    relative error (the build's report), within which a prompt's cached prefix decides between a tier's
    instances."""
    latency = BatchLatency(batch, est, view, tpot if options.uses_heads else None, tpot_error)
    usable = [np.array(view.usable(r.candidates), dtype=np.int64) for r in batch]
    order = lpt_order([est.length[r, usable[r]] for r in range(len(batch))]) if options.lpt else range(len(batch))
    decisions: dict[int, Decision] = {}
    for k, r in enumerate(order):
        req, cands = batch[r], usable[r]
        decision = decisions[r] = decide_one(req, r, cands, est, view, latency, options, rng)
        chosen = decision.ranked[0] if decision.ranked else None
        if chosen is not None:
            tokens = float(est.length[r, chosen])
            view.dispatched(chosen, tokens, req.input_tokens, req.prefix)
            later = np.array([q for q in order[k + 1:] if chosen in usable[q]], dtype=np.int64)
            latency.dispatched(view, chosen, later)
    return [decisions[r] for r in range(len(batch))]


def decide_one(req: RouteRequest, r: int, cands: np.ndarray, est: Estimates, view: PoolView,
               latency: BatchLatency, options: RouteBalanceOptions, rng: np.random.Generator) -> Decision:
    length = est.length[r, cands]
    cost = predicted_cost(req.input_tokens, length * req.n, view.price_in[cands], view.price_out[cands])
    if options.latency_term == "prior":  # the paper's arm 4: nominal TPOT x length, no instance state
        t = latency.tpot[r, cands] * length
    else:
        t = expected_latency(latency.tpot[r, cands], length, view.pending_decode[cands],
                             view.running[cands], view.waiting[cands], view.kv_usage[cands],
                             view.max_num_seqs[cands])
    cached = view.cached_tokens(req.prefix, req.input_tokens)[cands] if view.knows_prefixes else None
    hold = np.zeros(len(cands))
    if cached is not None:
        priced = cached if options.prefill_term == "cached" else np.zeros_like(cached)
        t = t + prefill_latency(view.prefill_s[cands], req.input_tokens, priced, view.pending_prefill[cands],
                                options.prefill_weight)
        hold = prefill_hold(view.prefill_s[cands], req.input_tokens, priced, view.running[cands],
                            options.prefill_running_weight)
    quality = est.quality[r, cands]
    if req.budget_usd is not None:
        keep = budget_filter(req.budget_usd, req.input_tokens, cost, view.price_in[cands], view.price_out[cands],
                             options.budget_filter, req.n)
        if not keep.any():
            return Decision((), refused=refusal(req.budget_usd, req.input_tokens, cost, view.price_in[cands],
                                                view.price_out[cands], options.budget_filter, req.n))
        cands, length, cost, t, quality = cands[keep], length[keep], cost[keep], t[keep], quality[keep]
        hold, cached = hold[keep], cached[keep] if cached is not None else None
    weights = req.weights
    if options.latency_term == "off":
        weights = (weights[0], 0.0, weights[2])
    q_term = quality_term(quality, options.quality_term)
    tiers = [view.tiers[c] for c in cands]
    queue = view.active[cands]
    draw = rng.random(len(cands))
    # The model is the request's own trade: Eq. 1 over its quality, cost and
    # latency. Which of that model's instances serves it also weighs what its
    # prefill holds the requests running there (`hold`): spread within a tier,
    # that keeps a warm instance from being flooded, where across tiers it
    # would buy time to first token with cost (docs/results/prefix.md).
    scores, t_key, mine = eq1(weights, q_term, cost, t), t, None
    if hold.any():
        best_tier = tiers[_ranked(scores, t, queue, draw, options.tiebreak)[0]]
        mine = np.array([tier == best_tier for tier in tiers])
        pooled = t + hold
        scores = np.where(mine, eq1(weights, q_term, cost, pooled), scores)
        t_key = np.where(mine, pooled, t)
    ranking = _ranked(scores, t_key, queue, draw, options.tiebreak, first=mine)
    if cached is not None and options.prefill_term == "cached":  # the cold ablation looks at no cache
        ranking = warmest_within_error(ranking, scores, cached, tiers,
                                       options.tie_tolerance * weights[1] * latency.error[cands],
                                       options.tie_min_share * req.input_tokens)
    best = ranking[0]
    return Decision(tuple(int(c) for c in cands[ranking]), quality=float(quality[best]), cost_usd=float(cost[best]),
                    latency_s=float(t[best]), tokens=float(length[best]),
                    cached_tokens=float(cached[best]) if cached is not None else None)


def _ranked(scores: np.ndarray, t: np.ndarray, queue: np.ndarray, draw: np.ndarray, tiebreak: TieBreak,
            first: np.ndarray | None = None) -> np.ndarray:
    """Candidates best score first (those in `first` ahead of the rest); among equal scores the tie-break: the
    shorter queue (dead-reckoned requests on the instance), or the lower predicted latency `t` and then the
    shorter queue (a tree's predictions are piecewise constant, so instances of a tier often tie on them;
    without the queue behind them such ties would all go to the lowest index). What is still equal after that
    (an idle pool, identical instances) goes by `draw`, a random number per candidate."""
    rounded = np.round(scores / TIE) * TIE
    keys = [draw, queue] if tiebreak == "shortest_queue" else [draw, queue, np.round(t / TIE) * TIE]
    keys.append(-rounded)
    if first is not None:
        keys.append(~first)
    return np.lexsort(tuple(keys))


def budget_filter(budget: float, input_tokens: int, cost: np.ndarray, price_in: np.ndarray, price_out: np.ndarray,
                  use_filter: bool, n: int = 1) -> np.ndarray:
    """Eq. 2 over one request's candidates: the mask of those kept.

    With the filter: the predicted cost (prompt plus each candidate's own
    predicted answer, `cost`) is within the budget. Without it: every
    candidate that can pay for the prompt and one token for each of the `n`
    answers; the dispatch clamp and the streaming stop cut what the budget
    cannot buy. Nothing kept means the request is refused (402), never
    rerouted to a candidate its budget was judged unable to pay.
    """
    payable = within_budget(predicted_cost(input_tokens, n, price_in, price_out), budget)
    return within_budget(cost, budget) & payable if use_filter else payable


def refusal(budget: float, input_tokens: int, cost: np.ndarray, price_in: np.ndarray, price_out: np.ndarray,
            use_filter: bool, n: int = 1) -> Refusal:
    least = float(predicted_cost(input_tokens, n, price_in, price_out).min()) if len(price_in) else 0.0
    if use_filter and within_budget(least, budget):  # the prompt was payable: the predicted answer was not
        return Refusal(402, f"the budget of {budget:.8f} USD is below the predicted cost of this request "
                            f"({input_tokens} prompt tokens and the predicted answer) on every candidate instance; "
                            f"the cheapest is predicted at {float(cost.min()):.8f} USD",
                       "budget", "routing.budget_usd", "insufficient_budget")
    answers = "one answer token" if n == 1 else f"one token for each of {n} answers"
    return Refusal(402, f"the budget of {budget:.8f} USD cannot pay for this prompt ({input_tokens} tokens) and "
                        f"{answers} on any candidate instance; the cheapest needs {least:.8f} USD",
                   "budget", "routing.budget_usd", "insufficient_budget")
