"""One label: what is known of one model's answer to one prompt, and where that knowledge came from.

Sources are kept apart, never averaged as one scale: a user's file (0/1 correctness or graded scores), a
judge's score, a client's feedback (a thumbs or a score) are quality in [0, 1]; "length" is an answer's
length in tokens, which may be censored (the answer was cut, so it is a lower bound).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Literal, get_args

Source = Literal["file", "feedback", "judge", "length"]
SOURCES: tuple[str, ...] = get_args(Source)
QUALITY_SOURCES: tuple[str, ...] = ("file", "judge", "feedback")
LENGTH = "length"


def prompt_hash(text: str) -> str:
    """The SHA-256 of a prompt's text as routed (64 hex digits): labels of one prompt meet on it, also when the
    text itself is not kept."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


@dataclass(frozen=True, slots=True)
class Label:
    """One stored label. `created` is epoch seconds given by the caller (the store reads no clock);
    `key` is the API key's name whose traffic gave it (None: anonymous, or a file)."""

    prompt_hash: str
    model: str
    source: Source
    value: float  # a score in [0, 1] for the quality sources; tokens for "length"
    created: float
    prompt: str | None = None  # None where the config keeps hashes only
    censored: bool = False  # a length that is only a lower bound (cut by max_tokens, a budget, a client leaving)
    key: str | None = None

    def __post_init__(self) -> None:
        if self.source not in SOURCES:
            raise ValueError(f"unknown label source {self.source!r} (known: {', '.join(SOURCES)})")
        if not math.isfinite(self.value) or not math.isfinite(self.created):
            raise ValueError("a label's value and time must be finite numbers")
        if self.source == LENGTH:
            if self.value < 0 or not float(self.value).is_integer():
                raise ValueError(f"a length is a whole number of tokens >= 0, got {self.value!r}")
        else:
            if not 0.0 <= self.value <= 1.0:
                raise ValueError(f"a {self.source} score must be in [0, 1], got {self.value!r}")
            if self.censored:
                raise ValueError("only a length can be censored")
