"""Token logprobs for the emulator's answers, in vLLM's OpenAI shapes.

The mapping (deterministic per prompt, model, emulator seed and request seed):

- the answer's quality q in [0, 1] is the model's labelled score for the prompt
  (for a progressive prompt, for its question) when the prompt is known, else
  a prior by model size, PRIOR_BASE + PRIOR_PER_LOG_B * ln(params in billions),
  clamped to [0, 1] (3B 0.36, 7B 0.45, 14B 0.52, 72B 0.68);
- the answer's mean token logprob is ln(P_FLOOR + P_SPAN * q): from ln 0.45
  (-0.80) for a useless answer to ln 0.95 (-0.05) for a perfect one, so a better
  model, or an easier prompt, is more confident;
- a request `seed` moves that mean by a factor exp(SEED_SPREAD * z), z ~ N(0, 1)
  drawn from the seed, as sampling with another seed gives another answer;
- per token, the logprob is the mean times an exponential draw normalised to mean
  one over the answer, so a whole answer's mean is exactly the target;
- the top alternatives share the rest of the probability mass (1 - p) in
  geometric shares 0.6, 0.24, 0.096, ... over words of the filler vocabulary.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from gateway.core.engine.profiles import arch_for
from gateway.records import prompt_key

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
P_FLOOR, P_SPAN = 0.45, 0.5
PRIOR_BASE, PRIOR_PER_LOG_B = 0.25, 0.1
SEED_SPREAD = 0.15
_ALT_FIRST, _ALT_RATIO = 0.6, 0.4
_ALT_WORDS = tuple(" " + w for w in (
    "a the this that an its these their our your one some any each such more most other same new first "
    "so then also thus hence however while when where which who what how why if as"
).split())


def prior_quality(model: str) -> float:
    """A model's quality on a prompt with no label: grows with its size (an unknown model counts as 7B)."""
    return min(1.0, max(0.0, PRIOR_BASE + PRIOR_PER_LOG_B * math.log(arch_for(model).params_b)))


def mean_logprob(quality: float) -> float:
    """The mean token logprob of an answer of this quality (see the module docstring)."""
    return math.log(P_FLOOR + P_SPAN * min(1.0, max(0.0, quality)))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The logprob of each token of one answer, and how its alternatives are drawn."""

    values: tuple[float, ...]
    key: int

    @classmethod
    def for_answer(cls, *, text: str, model: str, quality: float | None, tokens: int, emulator_seed: int,
                   request_seed: int | None) -> TokenLogprobs:
        key = prompt_key(text)
        mean = mean_logprob(prior_quality(model) if quality is None else quality)
        rng = random.Random(f"logprobs:{emulator_seed}:{model}:{key}:{request_seed}")
        if request_seed is not None:
            mean = max(mean * math.exp(SEED_SPREAD * rng.gauss(0.0, 1.0)), -5.0)
        draws = [rng.expovariate(1.0) for _ in range(tokens)]
        scale = mean * tokens / sum(draws) if tokens and sum(draws) > 0 else 0.0
        return cls(tuple(min(0.0, d * scale) for d in draws), int(key[:8], 16))

    def top(self, i: int, token: str, n: int) -> list[tuple[str, float]]:
        """The `n` most likely tokens at position i, best first (the sampled one among them if it ranks)."""
        if n <= 0:
            return []
        lp = self.values[i] if i < len(self.values) else 0.0
        rest = max(1.0 - math.exp(lp), 1e-9)
        alts: list[tuple[str, float]] = [(token, lp)]
        j, share = 0, _ALT_FIRST
        while len(alts) < n + 1:
            alt = _ALT_WORDS[(self.key + 13 * i + 7 * j) % len(_ALT_WORDS)]
            j += 1
            if alt == token or any(alt == a for a, _ in alts):
                if j > 4 * len(_ALT_WORDS):
                    break
                continue
            alts.append((alt, math.log(rest * share)))
            share *= _ALT_RATIO
        alts.sort(key=lambda a: -a[1])
        return alts[:n]

    def value(self, i: int) -> float:
        return self.values[i] if i < len(self.values) else 0.0


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8"))


def chat_content(lp: TokenLogprobs, tokens: list[str], start: int, top_n: int) -> list[dict]:
    """`choices[i].logprobs.content` for tokens [start, start + len(tokens)), as vLLM's chat server writes it."""
    out = []
    for k, tok in enumerate(tokens):
        i = start + k
        out.append({"token": tok, "logprob": lp.value(i), "bytes": _bytes(tok),
                    "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in lp.top(i, tok, top_n)]})
    return out


def completion_logprobs(lp: TokenLogprobs, tokens: list[str], start: int, top_n: int, text_offset: int) -> dict:
    """`choices[i].logprobs` of /v1/completions for tokens [start, ...): offsets count from the answer's start
    (a stream's chunks continue them), and each top_logprobs dict holds the sampled token and the top `top_n`."""
    offsets, top = [], []
    for k, tok in enumerate(tokens):
        i = start + k
        offsets.append(text_offset)
        text_offset += len(tok)
        entry = {tok: lp.value(i)}
        for t, v in lp.top(i, tok, top_n):
            entry.setdefault(t, v)
        top.append(entry)
    return {"text_offset": offsets, "token_logprobs": [lp.value(start + k) for k in range(len(tokens))],
            "tokens": tokens, "top_logprobs": top}
