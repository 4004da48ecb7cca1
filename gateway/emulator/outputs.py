"""What an emulated model says: how many tokens, and filler text to carry them.

Lengths are deterministic per (prompt, model): from workload labels when the
prompt is known, otherwise drawn from the model's length distribution with a
generator seeded by the prompt, so the same request always gets the same
answer length (as with greedy decoding). A known prompt's kind (its domain:
code, math, ...) is what a mixture-of-experts instance routes its tokens by;
an unknown prompt has none (it routes uniformly).
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping

from gateway.workload import MAX_OUTPUT_TOKENS, prompt_key

LOG_SIGMA = 0.8  # spread of answer lengths around the model's mean (log-normal)

_WORDS = (
    "the of and to in is that for it as with was on be by this are or at from an which have not "
    "can will one all their there been has more if when would about so what up out into than them "
    "only other some time could these two may then first any like now such where most over also "
    "after used well should because each just those how very through make between both under "
    "value model answer request system result data point case number state order process example"
).split()
_TOKENS = tuple(" " + w for w in _WORDS)


class OutputLengths:
    def __init__(
        self,
        mean_tokens: Mapping[str, float],
        labels: Mapping[str, Mapping[str, int]] | None = None,
        seed: int = 0,
        kinds: Mapping[str, str] | None = None,
    ):
        self.mean_tokens = dict(mean_tokens)
        self.labels = labels or {}
        self.seed = seed
        self.kinds = kinds or {}  # prompt key -> the workload's kind of the prompt

    def kind_of(self, text: str) -> str | None:
        """The prompt's kind when it is a workload prompt, else None."""
        return self.kinds.get(prompt_key(text)) if self.kinds else None

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
