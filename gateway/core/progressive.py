"""Progressive mode's plan, pure (PICE, papers/pice-progressive-inference.txt): no I/O, no clock.

A large-tier model writes a sketch of numbered points; small-tier models expand
each point (several candidates where the budget allows); the gateway keeps each
point's most confident expansion (the paper's Eq. 3: token probability, length
and ROUGE-L against the point) and assembles the points in order. This module
holds the decisions and the arithmetic; the server does the calls. The prompts
themselves are gateway/core/progressive_prompts.py.

- `fallback_reason`: which prompts go through normal routing instead, and why.
- `parse_points`: a sketch answer into its points.
- `tiers`: which model sketches and which expand.
- `plan_calls`, `check_budget`, `candidates_within`: the calls and their worst-case cost.
- `confidence`, `rouge_l`, `choose`: one point's expansion among candidates (Eq. 3).
- `answer_part`, `assemble`: the final text, in point order (the same pieces a stream sends).
- `Usage`, `sum_usage`: tokens and cost over every upstream call.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from gateway.core.budget import within_budget

# --- the fallback rule --------------------------------------------------------------------------------


class Fallback(StrEnum):
    """Why a progressive request goes through normal routing (a metric label)."""

    EMPTY = "empty_prompt"
    CODE = "code"
    SINGLE_FACT = "single_fact"
    SHORT_ANSWER = "short_answer"
    NO_ESTIMATE = "no_estimate"


DEFAULT_CODE_PATTERNS = (
    r"```",  # a fenced block
    r"^\s*(def|class)\s+\w+",  # Python
    r"\bfunction\s*\w*\s*\(",  # JavaScript
    r"\bSELECT\b[\s\S]+\bFROM\b",  # SQL
    r"#include\s*<",  # C / C++
    r"\b(write|implement|fix|debug|refactor)\b[^.?!\n]{0,40}\b(code|function|script|program|class|query|regex)\b",
)
DEFAULT_FACT_OPENERS = (
    r"(what|who|whom|whose|when|where|which)\b",
    r"how\s+(many|much|old|long|far|tall)\b",
    r"(name|define)\b",
)


@dataclass(frozen=True, slots=True)
class FallbackRule:
    """When a progressive request is better served whole. Checked in this order:

    1. EMPTY: the prompt has no words;
    2. CODE: any of `code_patterns` matches (code does not split into independent points);
    3. SINGLE_FACT: the prompt opens with one of `fact_openers`, has at most `fact_max_words`
       words, and the predicted answer is at most `fact_max_answer_tokens` (unknown counts as short);
    4. NO_ESTIMATE: no predicted length and `require_estimate`;
    5. SHORT_ANSWER: the predicted answer is under `min_answer_tokens` (a sketch of at least
       three points and their expansions only pays for a long answer).
    """

    min_answer_tokens: int = 200
    fact_max_words: int = 15
    fact_max_answer_tokens: int = 400
    require_estimate: bool = False
    code_patterns: tuple[str, ...] = DEFAULT_CODE_PATTERNS
    fact_openers: tuple[str, ...] = DEFAULT_FACT_OPENERS
    _code: tuple[re.Pattern[str], ...] = field(init=False, repr=False, compare=False)
    _fact: re.Pattern[str] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_code", tuple(re.compile(p, re.IGNORECASE | re.MULTILINE)
                                                for p in self.code_patterns))
        object.__setattr__(self, "_fact", re.compile(r"\s*(?:" + "|".join(self.fact_openers) + r")",
                                                     re.IGNORECASE))


def fallback_reason(prompt: str, predicted_tokens: float | None,
                    rule: FallbackRule = FallbackRule()) -> Fallback | None:
    """Why this prompt should go through normal routing, or None if progressive mode suits it.
    `predicted_tokens`: the estimated answer length on the large tier (None: no estimate)."""
    words = prompt.split()
    if not words:
        return Fallback.EMPTY
    if any(p.search(prompt) for p in rule._code):
        return Fallback.CODE
    if (len(words) <= rule.fact_max_words and rule._fact.match(prompt)
            and (predicted_tokens is None or predicted_tokens <= rule.fact_max_answer_tokens)):
        return Fallback.SINGLE_FACT
    if predicted_tokens is None:
        return Fallback.NO_ESTIMATE if rule.require_estimate else None
    if predicted_tokens < rule.min_answer_tokens:
        return Fallback.SHORT_ANSWER
    return None


# --- the sketch -----------------------------------------------------------------------------------------

_MARKED = re.compile(r"^\s*(?:\(?\d{1,2}\s*[.):]|[-*\u2022])\s*(.*)$")
_EMPHASIS = re.compile(r"[*_`]{1,3}")


def _clean(text: str) -> str:
    return " ".join(_EMPHASIS.sub("", text).split()).strip(" :;-")


def parse_points(sketch: str, max_points: int) -> list[str]:
    """The points of a sketch answer, in order: lines opening "1." / "1)" / "(1)" / "-" / "*" start a point,
    an unmarked line continues the one before (or is a point itself when no line is marked); markdown
    emphasis goes, duplicates (ignoring case and spacing) go, at most `max_points` are kept."""
    lines = [ln for ln in sketch.splitlines() if ln.strip()]
    marked = [_MARKED.match(ln) for ln in lines]
    raw: list[str] = []
    if not any(marked):
        raw = lines
    else:
        for ln, m in zip(lines, marked, strict=True):
            if m is not None:
                raw.append(m.group(1))
            elif raw:
                raw[-1] += " " + ln
            # text before the first marked line is a preamble ("Here is the skeleton:"), dropped
    points: list[str] = []
    seen: set[str] = set()
    for text in raw:
        point = _clean(text)
        key = point.casefold()
        if point and key not in seen:
            seen.add(key)
            points.append(point)
        if len(points) >= max_points:
            break
    return points


# --- usage ----------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    """Tokens and cost (USD) of one upstream call, or of several summed."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost: float = 0.0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.prompt_tokens + other.prompt_tokens, self.completion_tokens + other.completion_tokens,
                     self.cost + other.cost)


def sum_usage(usages: Iterable[Usage]) -> Usage:
    """What the client is charged: every call's tokens and cost (the sketch, every candidate, failed ones too)."""
    total = Usage()
    for u in usages:
        total = total + u
    return total


# --- choosing among candidates --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Candidate:
    """One expansion of one point: its text, its tokens' logprobs (None: the upstream sent none)."""

    text: str
    token_logprobs: Sequence[float] | None
    usage: Usage = Usage()
    source: str = ""  # the instance or model that wrote it, for logs

    @property
    def mean_logprob(self) -> float:
        """Mean token logprob (natural log); -inf without logprobs or tokens."""
        lps = self.token_logprobs
        return math.fsum(lps) / len(lps) if lps else -math.inf

    @property
    def tokens(self) -> int:
        """Its length in tokens: the upstream's count, else its logprobs' count, else its words."""
        return self.usage.completion_tokens or len(self.token_logprobs or ()) or len(self.text.split())


@dataclass(frozen=True, slots=True)
class ConfidenceWeights:
    """The weights of PICE's Eq. 3 (the paper names alpha_1 and alpha_2 but gives no values): `logprob` on
    the mean token probability, `length` on the normalised length, the rest on ROUGE-L against the point.
    `length_scale`: the tokens at which the length term saturates (the expansion's max_tokens)."""

    logprob: float = 0.5
    length: float = 0.25
    length_scale: int = 200

    def __post_init__(self) -> None:
        if self.logprob < 0 or self.length < 0 or self.logprob + self.length > 1 + 1e-9:
            raise ValueError("confidence weights must be >= 0 and sum to at most 1")
        if self.length_scale < 1:
            raise ValueError("length_scale must be at least 1")

    @property
    def rouge(self) -> float:
        return max(0.0, 1.0 - self.logprob - self.length)


_WORD = re.compile(r"\w+")
MAX_ROUGE_WORDS = 2000  # words of each text ROUGE-L reads: bounds its O(n m) table


def rouge_l(reference: str, candidate: str) -> float:
    """ROUGE-L F1 of `candidate` against `reference` (Lin 2004): the longest common subsequence of their
    lower-cased words, as precision over the candidate's words and recall over the reference's, combined
    by their harmonic mean (the F-measure ROUGE packages report by default). 0 when either has no words."""
    ref = _WORD.findall(reference.lower())[:MAX_ROUGE_WORDS]
    cand = _WORD.findall(candidate.lower())[:MAX_ROUGE_WORDS]
    if not ref or not cand:
        return 0.0
    row = [0] * (len(cand) + 1)  # LCS lengths against the reference's prefix read so far
    for w in ref:
        prev_diag = 0
        for j, c in enumerate(cand, 1):
            above = row[j]
            row[j] = prev_diag + 1 if w == c else max(above, row[j - 1])
            prev_diag = above
    lcs = row[-1]
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(cand), lcs / len(ref)
    return 2 * precision * recall / (precision + recall)


def confidence_score(mean_logprob: float, tokens: int, point: str, text: str,
                     weights: ConfidenceWeights = ConfidenceWeights()) -> float:
    """PICE's Eq. 3: weights.logprob x the mean token probability (2 to the mean log2 probability, i.e.
    exp of the mean natural logprob; 0 without logprobs) + weights.length x the length normalised by
    `weights.length_scale` (at most 1: a more detailed expansion scores higher) + the rest x ROUGE-L of the
    expansion against its sketch point (an expansion that keeps to its point scores higher). In [0, 1]."""
    probability = math.exp(mean_logprob) if mean_logprob > -math.inf else 0.0
    length = min(1.0, max(0, tokens) / weights.length_scale)
    score = weights.logprob * probability + weights.length * length
    if weights.rouge > 0:
        score += weights.rouge * rouge_l(point, text)
    return score


def confidence(candidate: Candidate, point: str, weights: ConfidenceWeights = ConfidenceWeights()) -> float:
    """Eq. 3's confidence of one expansion of `point` (confidence_score on the candidate's own figures)."""
    return confidence_score(candidate.mean_logprob, candidate.tokens, point, candidate.text, weights)


def best_of(scores: Sequence[float], tokens: Sequence[int]) -> int:
    """Index of the highest score; ties go to the shorter answer, then to the first."""
    if not scores:
        raise ValueError("no candidates to choose from")
    return max(range(len(scores)), key=lambda i: (scores[i], -tokens[i], -i))


def choose(candidates: Sequence[Candidate], point: str = "", weights: ConfidenceWeights = ConfidenceWeights()) -> int:
    """Index of the expansion of `point` to keep: the highest Eq. 3 confidence (`confidence`); ties go to
    the shorter answer (its tokens, else characters), then to the first."""
    if not candidates:
        raise ValueError("no candidates to choose from")
    return best_of([confidence(c, point, weights) for c in candidates],
                   [c.usage.completion_tokens or len(c.text) for c in candidates])


# --- assembly -------------------------------------------------------------------------------------------


def answer_part(index: int, point: str, expansion: str | None) -> str:
    """Point `index`'s (0-based) share of the final answer, separator included: streaming the parts
    in order gives exactly `assemble`'s text. A point with no expansion keeps the sketch's words."""
    body = " ".join((expansion or "").split()) or point
    return ("" if index == 0 else "\n\n") + f"{index + 1}. {body}"


def assemble(points: Sequence[str], expansions: Sequence[str | None]) -> str:
    """The final answer: each point's chosen expansion, numbered, in point order."""
    if len(points) != len(expansions):
        raise ValueError(f"{len(points)} points but {len(expansions)} expansions")
    return "".join(answer_part(i, p, e) for i, (p, e) in enumerate(zip(points, expansions, strict=True)))


# --- the plan and its budget ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProgressiveLimits:
    """Bounds of one progressive request."""

    max_points: int = 8  # points asked for (and kept) in the sketch
    sketch_max_tokens: int = 160
    expansion_max_tokens: int = 200
    candidates: int = 2  # expansions per point, at most
    min_points: int = 2  # a sketch with fewer points is answered whole (normal routing)
    confidence: ConfidenceWeights = ConfidenceWeights()  # how a point's expansion is chosen (Eq. 3)


def tiers(prices: Mapping[str, tuple[float, float]], expanders: int) -> tuple[str, list[str]] | None:
    """The sketch model and the expansion models among `prices` (model -> (output, input) price): the
    highest-priced model (the largest tier) sketches; the `expanders` cheapest others expand, cheapest
    first. None when there are not two models."""
    if len(prices) < 2:
        return None
    ordered = sorted(prices, key=lambda m: prices[m])
    return ordered[-1], ordered[:-1][:max(1, expanders)]


@dataclass(frozen=True, slots=True)
class Call:
    """One upstream call of the plan: stage "sketch" (point None) or "expand" (point 1-based, candidate 0-based)."""

    stage: str
    model: str
    max_tokens: int
    point: int | None = None
    candidate: int = 0


@dataclass(frozen=True, slots=True)
class Price:
    """USD per token (budget.per_token of the config's per-1M prices)."""

    input: float
    output: float


def plan_calls(sketch_model: str, expand_models: Sequence[str], points: int,
               limits: ProgressiveLimits = ProgressiveLimits(), candidates: int | None = None) -> list[Call]:
    """The sketch call, then `candidates` expansions of each of `points` points (candidate c on
    expand_models[c % len]: spreading candidates over models is what makes them differ)."""
    if not expand_models:
        raise ValueError("no model to expand with")
    c = limits.candidates if candidates is None else candidates
    calls = [Call("sketch", sketch_model, limits.sketch_max_tokens)]
    calls += [Call("expand", expand_models[k % len(expand_models)], limits.expansion_max_tokens, point=p, candidate=k)
              for p in range(1, points + 1) for k in range(c)]
    return calls


@dataclass(frozen=True, slots=True)
class BudgetCheck:
    fits: bool
    worst_case: float  # USD if every call used its max_tokens
    budget: float | None


def worst_case_cost(calls: Sequence[Call], prompt_tokens: Mapping[str, int], prices: Mapping[str, Price]) -> float:
    """USD if every call ran to its max_tokens. `prompt_tokens` per stage ("sketch", "expand"): the
    expansion prompt carries the question and the whole skeleton, so bound it by sketch_max_tokens."""
    total = 0.0
    for call in calls:
        price = prices[call.model]
        total += prompt_tokens[call.stage] * price.input + call.max_tokens * price.output
    return total


def check_budget(calls: Sequence[Call], prompt_tokens: Mapping[str, int], prices: Mapping[str, Price],
                 budget: float | None) -> BudgetCheck:
    """Whether the whole plan fits the budget in the worst case (None: no budget, always fits)."""
    worst = worst_case_cost(calls, prompt_tokens, prices)
    return BudgetCheck(budget is None or bool(within_budget(worst, budget)), worst, budget)


def candidates_within(sketch_model: str, expand_models: Sequence[str], prompt_tokens: Mapping[str, int],
                      prices: Mapping[str, Price], budget: float | None,
                      limits: ProgressiveLimits = ProgressiveLimits(), points: int | None = None,
                      sketched: bool = False) -> int:
    """The most candidates per point (up to limits.candidates) whose plan fits the budget in the worst
    case, for `points` points (before the sketch: limits.max_points); 0 if not even one fits, when the
    server falls back to normal routing or refuses with the worst case in its message. `sketched`: the
    sketch is written and paid, so only the expansions count against `budget` (what is left of it)."""
    n = limits.max_points if points is None else points
    for c in range(limits.candidates, 0, -1):
        plan = plan_calls(sketch_model, expand_models, n, limits, candidates=c)[1 if sketched else 0:]
        if check_budget(plan, prompt_tokens, prices, budget).fits:
            return c
    return 0
