"""How an emulated model answers progressive mode's prompts (gateway/core/progressive_prompts.py).

The emulator's and the simulator's shared world, not a gateway rule: a sketch has one point per
POINT_TOKENS of the model's labelled answer (SKETCH_MIN_POINTS..SKETCH_MAX_POINTS, never more than
asked), each "N." plus 3-6 words, one token each; an expansion is the model's labelled length over
the skeleton's point count.
"""

from __future__ import annotations

POINT_TOKENS = 70  # one sketch point per this many tokens of the labelled answer
SKETCH_MIN_POINTS, SKETCH_MAX_POINTS = 3, 8
MIN_EXPANSION_TOKENS = 8


def sketch_points(answer_tokens: int, max_points: int) -> int:
    """How many points a model's sketch has for an answer of `answer_tokens` tokens."""
    k = min(SKETCH_MAX_POINTS, max(SKETCH_MIN_POINTS, round(answer_tokens / POINT_TOKENS)))
    return max(1, min(k, max_points))


def sketch_words(point: int, seed: int) -> int:
    """Words of the sketch's point `point` (1-based), after its "N." token."""
    return 3 + (seed + 5 * point) % 4


def expansion_tokens(answer_tokens: int, points: int) -> int:
    """Tokens of one point's expansion: the model's answer length shared over the skeleton's points."""
    return max(MIN_EXPANSION_TOKENS, round(answer_tokens / points))
