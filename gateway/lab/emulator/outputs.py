"""What an emulated model says: how many tokens, and filler text to carry them.

Lengths are deterministic per (prompt, model): from workload labels when the
prompt is known, otherwise drawn from the model's length distribution with a
generator seeded by the prompt, so the same request always gets the same
answer length (as with greedy decoding). A known prompt's kind (its domain:
code, math, ...) is what a mixture-of-experts instance routes its tokens by;
an unknown prompt has none (it routes uniformly).

Progressive mode's prompts (gateway/core/progressive_prompts.py) are answered as
the model would answer them, from the original question's labels:

- a sketch request gets numbered points (how many and how long:
  workload/progressive.py, which the simulator reads too);
- an expansion request gets the model's labelled length divided by the
  skeleton's point count.

An unknown question falls back to the usual length model, as any prompt does.

A request for several answers (`n`, or `best_of` samples; vLLM's parallel
sampling) gets, as sample 0, the answer above; each further sample has words
of its own and, but for a sketch (whose length its points' words make), a
length drawn log-normally around sample 0's, with SAMPLE_LOG_SIGMA: samples
of one prompt differ in length less than answers to different prompts do
(LOG_SIGMA). SAMPLE_LOG_SIGMA is a choice, not a measurement.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gateway.core.engine.moe import expert_domain
from gateway.core.progressive_prompts import original_question, parse_expansion_prompt, parse_sketch_prompt
from gateway.lab.workload.progressive import expansion_tokens, sketch_points, sketch_words
from gateway.records import MAX_OUTPUT_TOKENS, UNKNOWN_KIND, Record, prompt_key

LOG_SIGMA = 0.8  # spread of answer lengths around the model's mean (log-normal)
SAMPLE_LOG_SIGMA = 0.3  # spread of one request's samples' lengths around its first sample's (log-normal)

_WORDS = (
    "the of and to in is that for it as with was on be by this are or at from an which have not "
    "can will one all their there been has more if when would about so what up out into than them "
    "only other some time could these two may then first any like now such where most over also "
    "after used well should because each just those how very through make between both under "
    "value model answer request system result data point case number state order process example"
).split()
_TOKENS = tuple(" " + w for w in _WORDS)


@dataclass(frozen=True, slots=True)
class Answer:
    """What the model says to one request: `tokens` tokens (the engine's output length), as text.

    `pieces` are explicit token strings (a sketch's numbered points); past them,
    or without them, the deterministic filler carries the tokens.
    """

    tokens: int
    text_seed: int
    pieces: tuple[str, ...] = ()

    def token_strings(self, start: int, count: int) -> list[str]:
        n, m = len(_TOKENS), len(self.pieces)
        return [self.pieces[i] if i < m else _TOKENS[(self.text_seed + 7 * i) % n] for i in range(start, start + count)]

    def text(self, start: int, count: int) -> str:
        return "".join(self.token_strings(start, count))


def text_seed(prompt: str, sample: int = 0) -> int:
    """The seed of the words the emulator answers `prompt` with (its filler and a sketch's points) in the
    request's sample `sample` (0: the only answer of an n = 1 request)."""
    seed = int(prompt_key(prompt)[:8], 16)
    return seed if sample == 0 else int(prompt_key(f"{seed}:sample:{sample}")[:8], 16)


def sketch_pieces(points: int, seed: int) -> tuple[str, ...]:
    """A sketch's tokens: "1." then 3-6 words, "\n2." then 3-6 words, ..."""
    pieces: list[str] = []
    for j in range(1, points + 1):
        pieces.append(f"{j}." if j == 1 else f"\n{j}.")
        pieces.extend(_TOKENS[(seed + 11 * j + 3 * w) % len(_TOKENS)] for w in range(sketch_words(j, seed)))
    return tuple(pieces)


class OutputLengths:
    def __init__(
        self,
        mean_tokens: Mapping[str, float],
        labels: Mapping[str, Mapping[str, int]] | None = None,
        seed: int = 0,
        kinds: Mapping[str, str] | None = None,
        scores: Mapping[str, Mapping[str, float]] | None = None,
    ):
        self.mean_tokens = dict(mean_tokens)
        self.labels = labels or {}
        self.seed = seed
        self.kinds = kinds or {}  # prompt key -> the workload's kind of the prompt
        self.scores = scores or {}  # prompt key -> model -> labelled quality in [0, 1]

    @classmethod
    def from_records(cls, mean_tokens: Mapping[str, float], records: Iterable[Record], seed: int = 0) -> OutputLengths:
        """Lengths, kinds and quality scores of labelled records (what `emulate` knows of its workload)."""
        labels: dict[str, dict[str, int]] = {}
        scores: dict[str, dict[str, float]] = {}
        kinds: dict[str, str] = {}
        for r in records:
            key = prompt_key(r.prompt)
            labels[key] = {m: lab.output_length for m, lab in r.models.items()}
            scores[key] = {m: lab.score for m, lab in r.models.items()}
            if r.kind != UNKNOWN_KIND:
                kinds[key] = r.kind
        return cls(mean_tokens, labels=labels, seed=seed, kinds=kinds, scores=scores)

    def kind_of(self, text: str) -> str | None:
        """The prompt's kind when it is a workload prompt (or a progressive prompt about one), else None."""
        if not self.kinds:
            return None
        return self.kinds.get(prompt_key(_question(text)))

    def domain_of(self, text: str) -> str | None:
        """What a mixture-of-experts instance routes the prompt's tokens by: its kind and its question's text
        (engine/moe.py expert_domain, as the simulator gives it), None for a prompt of no known kind."""
        return expert_domain(self.kind_of(text), _question(text))

    def quality(self, text: str, model: str) -> float | None:
        """The labelled quality of `model` on this prompt (or on a progressive prompt's question), if known."""
        known = self.scores.get(prompt_key(_question(text))) if self.scores else None
        return known.get(model) if known else None

    def answer(self, text: str, model: str, sample: int = 0) -> Answer:
        """What `model` answers to `text` in the request's sample `sample` (see the module docstring): a
        progressive prompt by its question's labels, any other by its own."""
        seed = text_seed(text, sample)
        sketch = parse_sketch_prompt(text)
        if sketch is not None:
            k = sketch_points(self.for_prompt(sketch.question, model), sketch.max_points)
            pieces = sketch_pieces(k, seed)
            return Answer(len(pieces), seed, pieces)
        expansion = parse_expansion_prompt(text)
        if expansion is not None:
            tokens = expansion_tokens(self.for_prompt(expansion.question, model), len(expansion.points))
        else:
            tokens = self.for_prompt(text, model)
        return Answer(self._sampled(tokens, text, model, sample), seed)

    def _sampled(self, tokens: int, text: str, model: str, sample: int) -> int:
        """The length of sample `sample` of an answer whose sample 0 is `tokens` long."""
        if sample == 0:
            return tokens
        rng = random.Random(f"{self.seed}:{model}:{prompt_key(text)}:sample:{sample}")
        draw = rng.lognormvariate(math.log(tokens) - SAMPLE_LOG_SIGMA**2 / 2, SAMPLE_LOG_SIGMA)
        return max(1, min(round(draw), MAX_OUTPUT_TOKENS))

    def for_prompt(self, text: str, model: str) -> int:
        key = prompt_key(text)
        known = self.labels.get(key)
        if known and model in known:
            return max(1, min(int(known[model]), MAX_OUTPUT_TOKENS))
        rng = random.Random(f"{self.seed}:{model}:{key}")
        mean = self.mean_tokens.get(model, 150.0)
        # log-normal with the requested mean: mu = ln(mean) - sigma^2 / 2
        draw = rng.lognormvariate(math.log(mean) - LOG_SIGMA**2 / 2, LOG_SIGMA)
        return max(1, min(round(draw), MAX_OUTPUT_TOKENS))


def filler_text(seed: int, start: int, count: int) -> str:
    """Tokens [start, start+count) of a deterministic answer; one word per token."""
    n = len(_TOKENS)
    return "".join(_TOKENS[(seed + 7 * i) % n] for i in range(start, start + count))


def _question(text: str) -> str:
    """The prompt whose labels apply: a progressive prompt's question, else the prompt itself."""
    question = original_question(text)
    return text if question is None else question
