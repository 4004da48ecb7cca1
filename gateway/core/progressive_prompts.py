"""The prompts progressive mode sends, and the parsers that read them back.

Progressive mode (PICE, papers/pice-progressive-inference.txt) asks a large
model for a skeleton of the answer, then small models to expand each point.
The gateway builds these prompts; the emulator recognises them, finds the
original question inside and answers as that model would (its labelled
length split into points). Both sides import this one module, so the wire
format is written once. It lives in the functional core so that the gateway, the emulator and
the simulator can all import it.

Layout (the parsers rely on it):

- a sketch prompt is SKETCH_HEAD (with the point bound) + QUESTION_MARK + the
  question, the question last, verbatim: everything after the first
  QUESTION_MARK is the question, whatever it contains;
- an expansion prompt is EXPANSION_HEAD (with the point's number) +
  SKELETON_MARK + the skeleton + QUESTION_MARK + the question. The skeleton is
  the gateway's own rendering of the parsed points (`format_skeleton`: one
  "N. text" line per point, no blank line), so the first QUESTION_MARK after
  it ends it.

How the emulator and the simulator answer them is lab code: gateway/lab/workload/progressive.py.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

QUESTION_MARK = "\n\nQuestion:\n"
SKELETON_MARK = "\n\nSkeleton:\n"

SKETCH_HEAD = (
    "Write only the skeleton of an answer to the question below, not the answer itself: "
    "at most {max_points} numbered points (\"1. ...\", \"2. ...\"), one per line, "
    "each point a few words (3 to 8), nothing else."
)
EXPANSION_HEAD = (
    "Here are a question and the skeleton of its answer. Expand point {point} of the skeleton "
    "in 1-3 sentences. Write only that point's expansion: do not repeat its number and do not "
    "continue with other points."
)

_SKETCH_RE = re.compile(
    re.escape(SKETCH_HEAD).replace(re.escape("{max_points}"), r"(\d+)") + re.escape(QUESTION_MARK) + r"(.*)\Z",
    re.DOTALL,
)
_EXPANSION_RE = re.compile(
    re.escape(EXPANSION_HEAD).replace(re.escape("{point}"), r"(\d+)") + re.escape(SKELETON_MARK)
    + r"(.*?)" + re.escape(QUESTION_MARK) + r"(.*)\Z",
    re.DOTALL,
)


@dataclass(frozen=True, slots=True)
class SketchPrompt:
    question: str
    max_points: int


@dataclass(frozen=True, slots=True)
class ExpansionPrompt:
    question: str
    point: int  # 1-based, as written in the skeleton
    points: list[str]  # the skeleton's point texts, in order


def sketch_prompt(question: str, max_points: int) -> str:
    """The prompt asking the large model for a skeleton of at most `max_points` points."""
    if max_points < 1:
        raise ValueError("max_points must be at least 1")
    return SKETCH_HEAD.format(max_points=max_points) + QUESTION_MARK + question


def format_skeleton(points: Sequence[str]) -> str:
    """The skeleton as the expansion prompts carry it: "1. text" lines, each point on one line."""
    return "\n".join(f"{i}. {' '.join(p.split())}" for i, p in enumerate(points, 1))


def expansion_prompt(question: str, points: Sequence[str], point: int) -> str:
    """The prompt asking a small model to expand point `point` (1-based) of the skeleton."""
    if not 1 <= point <= len(points):
        raise ValueError(f"point {point} is not in a skeleton of {len(points)} points")
    return (EXPANSION_HEAD.format(point=point) + SKELETON_MARK + format_skeleton(points)
            + QUESTION_MARK + question)


def parse_sketch_prompt(text: str) -> SketchPrompt | None:
    """The sketch request inside `text`, or None if it is not one."""
    if not text.startswith(SKETCH_HEAD[:40]):
        return None
    m = _SKETCH_RE.match(text)
    if m is None:
        return None
    return SketchPrompt(question=m.group(2), max_points=int(m.group(1)))


_SKELETON_LINE = re.compile(r"(\d+)\. (.*)")


def parse_expansion_prompt(text: str) -> ExpansionPrompt | None:
    """The expansion request inside `text`, or None if it is not one (or its skeleton is malformed)."""
    if not text.startswith(EXPANSION_HEAD[:40]):
        return None
    m = _EXPANSION_RE.match(text)
    if m is None:
        return None
    points: list[str] = []
    for i, line in enumerate(m.group(2).split("\n"), 1):
        lm = _SKELETON_LINE.fullmatch(line)
        if lm is None or int(lm.group(1)) != i:
            return None
        points.append(lm.group(2))
    point = int(m.group(1))
    if not 1 <= point <= len(points):
        return None
    return ExpansionPrompt(question=m.group(3), point=point, points=points)


def original_question(text: str) -> str | None:
    """The user's question inside a sketch or expansion prompt, or None for any other prompt."""
    parsed = parse_sketch_prompt(text) or parse_expansion_prompt(text)
    return parsed.question if parsed is not None else None
