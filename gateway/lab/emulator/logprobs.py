"""Token logprobs for the emulator's answers, in vLLM's OpenAI shapes.

The answer's mean token logprob is a noisy, per-model-biased signal only partly
correlated with its labelled quality (so that choosing among answers by it is
not an oracle; issue 27). Deterministic per prompt, model, emulator seed and
request seed:

    mean = LP_BASE + bias(model)
           + LP_SPREAD * (RHO * (q - Q_CENTRE) / Q_SCALE + sqrt(1 - RHO^2) * z)

- q in [0, 1] is the model's labelled score for the prompt (for a progressive
  prompt, for its question) when the prompt is known, else a prior by model
  size, PRIOR_BASE + PRIOR_PER_LOG_B * ln(params in billions), clamped to
  [0, 1] (3B 0.36, 7B 0.45, 14B 0.52, 72B 0.68);
- z ~ N(0, 1) is drawn from (emulator seed, model, prompt, request seed, and
  the sample's index when a request asks for several answers): a request
  `seed` gives another answer, and another confidence, as sampling does, and
  so does each of the n samples of one request;
- bias(model) ~ N(0, BIAS_SD) is drawn once per model name (seeded by the name
  alone): PICE observed that a model's perplexity sits above or below another's
  whatever the answers' quality (Llama3-8B's above Qwen2.5-7B's), which is why
  its Eq. 3 adds text scores to it;
- within one model the mean's correlation with q is RHO (0.3) when the labels'
  spread is Q_SCALE (0.22, the synthetic small models' label sd). RHO is an
  assumption, not a measurement: token likelihood is a weak-to-moderate
  predictor of answer quality in the uncertainty-estimation literature, and 0.3
  sits at the weak end (it tells a good answer from a bad one with AUROC about
  0.67: a point-biserial 0.3 over balanced classes); across models the biases
  add to it. LP_SPREAD (0.15 nats) is a model's spread of mean token logprob
  across answers and LP_BASE (-0.45, perplexity 1.57) its typical level for chat
  answers; both set the scale the bias is read against;
- the mean is kept in [LP_MIN, LP_MAX];
- per token, the logprob is the mean times an exponential draw normalised to mean
  one over the answer, so a whole answer's mean is exactly the target (the
  simulator reads `answer_mean_logprob` for it, sim/progressive.py);
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
PRIOR_BASE, PRIOR_PER_LOG_B = 0.25, 0.1
LP_BASE, LP_SPREAD = -0.45, 0.15  # nats per token: a model's typical mean, and its spread across answers
RHO = 0.3  # within a model, the mean's correlation with the labelled quality (at label sd Q_SCALE)
Q_CENTRE, Q_SCALE = 0.38, 0.22  # the synthetic small models' mean label and its sd
BIAS_SD = 0.1  # nats per token: spread of the per-model offsets
LP_MIN, LP_MAX = -5.0, -0.005
_ALT_FIRST, _ALT_RATIO = 0.6, 0.4
_ALT_WORDS = tuple(" " + w for w in (
    "a the this that an its these their our your one some any each such more most other same new first "
    "so then also thus hence however while when where which who what how why if as"
).split())


def prior_quality(model: str) -> float:
    """A model's quality on a prompt with no label: grows with its size (an unknown model counts as 7B)."""
    return min(1.0, max(0.0, PRIOR_BASE + PRIOR_PER_LOG_B * math.log(arch_for(model).params_b)))


def model_bias(model: str) -> float:
    """The model's offset of mean token logprob, drawn once from its name (see the module docstring)."""
    return random.Random(f"logprob-bias:{model}").gauss(0.0, BIAS_SD)


def _sample_key(request_seed: int | None, sample: int) -> str:
    """What the draws of one answer are seeded by beside the prompt: the request seed, and the sample's index past
    the first (so sample 0 is the answer of an n = 1 request)."""
    return f"{request_seed}" if sample == 0 else f"{request_seed}:sample:{sample}"


def answer_mean_logprob(*, model: str, quality: float, prompt: str, emulator_seed: int,
                        request_seed: int | None, sample: int = 0) -> float:
    """The mean token logprob of `model`'s answer to `prompt` (key text: the last user turn), whose labelled
    quality is `quality`, in the request's sample `sample` (see the module docstring)."""
    q = min(1.0, max(0.0, quality))
    key = f"logprob-noise:{emulator_seed}:{model}:{prompt_key(prompt)}:{_sample_key(request_seed, sample)}"
    z = random.Random(key).gauss(0.0, 1.0)
    signal = RHO * (q - Q_CENTRE) / Q_SCALE + math.sqrt(1.0 - RHO * RHO) * z
    return min(LP_MAX, max(LP_MIN, LP_BASE + model_bias(model) + LP_SPREAD * signal))


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The logprob of each token of one answer, and how its alternatives are drawn."""

    values: tuple[float, ...]
    key: int

    @classmethod
    def for_answer(cls, *, text: str, model: str, quality: float | None, tokens: int, emulator_seed: int,
                   request_seed: int | None, sample: int = 0) -> TokenLogprobs:
        key = prompt_key(text)
        mean = answer_mean_logprob(model=model, quality=prior_quality(model) if quality is None else quality,
                                   prompt=text, emulator_seed=emulator_seed, request_seed=request_seed, sample=sample)
        rng = random.Random(f"logprobs:{emulator_seed}:{model}:{key}:{_sample_key(request_seed, sample)}")
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
