"""Progressive mode (PICE) in the simulator: a client request becomes a sketch and its expansions.

A cell with `CellSpec.progressive` asks every request for progressive mode,
as a client sending `routing.mode = "progressive"` would. Per request:

- the fallback rule (core/progressive.py, the config's [progressive]
  table) reads the prompt and the estimators' predicted answer length of the
  largest tier; a request it sends back is routed normally (row r as usual);
- otherwise row r is the sketch: a request naming the largest tier (the
  highest-priced model), its prompt the sketch prompt, its answer the points
  the emulated model writes (workload/progressive.py: one point per 70
  labelled answer tokens, 3 to 8), parsed as the gateway parses them;
- when the sketch ends, `candidates` expansions of each point arrive at once
  (rows past the client requests), candidate k naming the k-th cheapest
  model, each answering its model's labelled length over the point count;
- each point keeps the candidate the gateway would keep: the highest Eq. 3
  confidence (core/progressive.py `confidence_score`) on what the emulator
  would send: its mean token logprob (emulator/logprobs.py: a per-model bias,
  noise, and a correlation of 0.3 with the labelled quality), its length, and
  ROUGE-L of its text (the emulator's filler) against the point. The noise is
  drawn as the default emulator ([emulator] seed 0) draws it for a request
  without a seed, so it is fixed per prompt, point and model across arrival
  seeds. The request ends when every point's candidates have ended (the
  gateway waits for all of a point's candidates). Its first token is point
  1's, as streamed.

Every call is paid (the answer's cost is the sketch's and every candidate's),
every call goes through the same scheduling loop as any request, and none
carries a budget (progressive cells refuse budget shares).

Quality is what PICE's judges measured and ours cannot (the text is filler).
A progressive outcome's `quality` is the mean, over its points, of the
labelled score of the model whose expansion the confidence kept (on the whole
question: the small models decide the answer); a point with no expansion
keeps the sketch's words and the largest tier's score. `quality_oracle` holds
the same mean under an oracle pick (each point's candidate of highest label):
what a perfect confidence would give. The cloud-only cell's `quality` is the
largest tier's score on the same prompts.

Prompt sizes: the sketch prompt is the question plus SKETCH_HEAD; an
expansion's is the question, EXPANSION_HEAD and the skeleton (its tokens plus
two per point for the renumbering).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

from gateway.core.progressive import (
    FallbackRule,
    ProgressiveLimits,
    best_of,
    confidence_score,
    fallback_reason,
    parse_points,
    tiers,
)
from gateway.core.progressive_prompts import (
    EXPANSION_HEAD,
    QUESTION_MARK,
    SKELETON_MARK,
    SKETCH_HEAD,
    expansion_prompt,
    sketch_prompt,
)
from gateway.lab.emulator.logprobs import answer_mean_logprob
from gateway.lab.emulator.outputs import filler_text, sketch_pieces, text_seed
from gateway.lab.workload.progressive import expansion_tokens, sketch_points

PROGRESSIVE = "progressive"
EMULATOR_SEED = 0  # the default [emulator] seed: the confidence noise the default emulator draws


@functools.cache
def _head_tokens(max_points: int) -> tuple[int, int]:
    """Tokens the sketch (asking for `max_points` points) and expansion heads add to a question (Qwen2.5's
    tokenizer)."""
    from gateway.tokens import TokenCounter

    count = TokenCounter().count
    return (count(SKETCH_HEAD.format(max_points=max_points) + QUESTION_MARK),
            count(EXPANSION_HEAD.format(point=1) + SKELETON_MARK + QUESTION_MARK))


@dataclass(frozen=True, slots=True)
class Expansion:
    """One expansion call: its row, its point (1-based), its candidate, the model it names."""

    row: int
    point: int
    candidate: int
    model: str


@dataclass(frozen=True, slots=True)
class ProgressivePlan:
    """One progressive request: its sketch (row `parent`) and its expansions."""

    parent: int
    points: int
    sketch_prompt_tokens: int
    sketch_tokens: int
    expand_prompt_tokens: int
    expansions: tuple[Expansion, ...]
    point_texts: tuple[str, ...] = ()  # the sketch's points as the gateway parses them
    expansion_prompts: tuple[str, ...] = ()  # per point, the expansion prompt the gateway sends


@dataclass(frozen=True, slots=True)
class ProgressivePlans:
    """Every request's mode, and the plans of those served progressively."""

    large: str
    small: tuple[str, ...]
    modes: tuple[str, ...]  # per client request: "progressive", "normal" or the fallback reason
    plans: dict[int, ProgressivePlan]  # client request -> its plan
    parent: np.ndarray  # per row (client requests, then expansions): the client request it serves
    limits: ProgressiveLimits

    @property
    def rows(self) -> int:
        return len(self.parent)


def plan_all(prompts, prompt_tokens: np.ndarray, label_length: np.ndarray, predicted: np.ndarray, instances,
             limits: ProgressiveLimits, rule: FallbackRule) -> ProgressivePlans:
    """Each request's plan. `label_length` / `predicted`: (n, I) labelled and predicted answer tokens per
    instance column; the largest tier's first instance column is read for its model."""
    prices = {inst.model: (inst.price_output_per_mtok, inst.price_input_per_mtok) for inst in instances}
    picked = tiers(prices, limits.candidates)
    if picked is None:
        raise ValueError("progressive mode needs two models in the pool")
    large, small = picked
    column = next(k for k, inst in enumerate(instances) if inst.model == large)
    sketch_head, expand_head = _head_tokens(limits.max_points)
    n = len(prompts)
    modes: list[str] = []
    plans: dict[int, ProgressivePlan] = {}
    parent = list(range(n))
    for r in range(n):
        reason = fallback_reason(prompts[r], float(predicted[r, column]), rule)
        if reason is not None:
            modes.append(reason.value)
            continue
        written = sketch_points(int(label_length[r, column]), limits.max_points)
        seed = text_seed(sketch_prompt(prompts[r], limits.max_points))
        pieces = sketch_pieces(written, seed)[:limits.sketch_max_tokens]  # the emulator's sketch, as sent
        sketch = len(pieces)
        texts = tuple(parse_points("".join(pieces), limits.max_points))  # what the gateway reads of it
        points = len(texts)
        if points < limits.min_points:
            modes.append("few_points")
            continue
        expansions = []
        for p in range(1, points + 1):
            for k in range(limits.candidates):
                expansions.append(Expansion(len(parent), p, k, small[k % len(small)]))
                parent.append(r)
        plans[r] = ProgressivePlan(r, points, int(prompt_tokens[r]) + sketch_head, sketch,
                                   int(prompt_tokens[r]) + expand_head + sketch + 2 * points, tuple(expansions),
                                   texts, tuple(expansion_prompt(prompts[r], texts, p) for p in range(1, points + 1)))
        modes.append(PROGRESSIVE)
    return ProgressivePlans(large, tuple(small), tuple(modes), plans, np.array(parent, dtype=np.int64), limits)


def row_lengths(plans: ProgressivePlans, label_length: np.ndarray, predicted: np.ndarray,
                instances) -> tuple[np.ndarray, np.ndarray]:
    """(rows, I) answer tokens and predicted answer tokens of every row: a client request's own, a sketch's
    points, an expansion's share of its model's answer. The predictions are what a gateway knows: the
    sketch's bound, an expansion's predicted answer over the points (at most its bound)."""
    lengths = label_length[plans.parent].astype(np.int64)
    guesses = predicted[plans.parent].astype(float)
    limits = plans.limits
    for r, plan in plans.plans.items():
        lengths[r, :] = plan.sketch_tokens
        guesses[r, :] = limits.sketch_max_tokens
        rows = [e.row for e in plan.expansions]  # every expansion of a request answers a point's share
        lengths[rows, :] = [expansion_tokens(int(label_length[r, i]), plan.points) for i in range(len(instances))]
        guesses[rows, :] = np.minimum(predicted[r, :] / plan.points, limits.expansion_max_tokens)
    return lengths, guesses


def kept(plan: ProgressivePlan, point: int, served: list[tuple[Expansion, object]],
         limits: ProgressiveLimits) -> int:
    """Index in `served` ((expansion, outcome) of point `point`'s candidates that were served) of the one the
    gateway keeps: the highest Eq. 3 confidence on what the emulator would send each (its mean token
    logprob, its length and its filler text), ties to the shorter, then the first."""
    prompt, text_point = plan.expansion_prompts[point - 1], plan.point_texts[point - 1]
    seed = text_seed(prompt)
    scores = []
    for e, o in served:
        mean = answer_mean_logprob(model=e.model, quality=o.quality, prompt=prompt, emulator_seed=EMULATOR_SEED,
                                   request_seed=None)
        scores.append(confidence_score(mean, o.completion_tokens, text_point,
                                       filler_text(seed, 0, o.completion_tokens), limits.confidence))
    return best_of(scores, [o.completion_tokens for _, o in served])


def fold(plans: ProgressivePlans, outcomes: list) -> list:
    """The client requests' outcomes, each progressive one made of its sketch's and expansions' (see the
    module docstring); `outcomes` holds every row's, costed."""
    n = len(plans.modes)
    folded = outcomes[:n]
    for r, mode in enumerate(plans.modes):
        folded[r].mode = mode
    for r, plan in plans.plans.items():
        out = folded[r]
        if out.instance < 0:
            continue  # the sketch was refused: so is the request
        sketch_tokens, sketch_finished, sketch_quality = out.completion_tokens, out.finished, out.quality
        done: list[float] = []
        tokens, chosen, oracle = 0, [], []
        for p in range(1, plan.points + 1):
            rows = [(e, outcomes[e.row]) for e in plan.expansions if e.point == p]
            served = [(e, o) for e, o in rows if o.instance >= 0]
            out.cost_usd += sum(o.cost_usd for _, o in rows)
            if not served:  # the point keeps the sketch's words
                done.append(sketch_finished)
                tokens += max(1, sketch_tokens // plan.points)
                chosen.append(sketch_quality)
                oracle.append(sketch_quality)
                continue
            pick = served[kept(plan, p, served, plans.limits)][1]
            done.append(max(o.finished for _, o in served))
            tokens += pick.completion_tokens
            chosen.append(pick.quality)
            oracle.append(max(o.quality for _, o in served))
        streamed = np.maximum.accumulate(done)  # a point is sent once it and every point before it are done
        out.first_token, out.finished = float(streamed[0]), float(streamed[-1])
        out.completion_tokens = tokens
        out.quality = float(np.mean(chosen)) if chosen else sketch_quality
        out.quality_oracle = float(np.mean(oracle)) if oracle else math.nan
    return folded
