"""Prompt writers, one module per kind of request.

Every writer has the same shape: ``write(dice, topic, level, target_tokens) -> str``,
and a ``TOPICS`` mapping whose keys name the topics (subskills) of that kind. Topics
carry their own vocabulary, so prompts on one topic sit near each other in embedding
space; the level (EASY, MEDIUM, HARD) shows in the wording and the number of
constraints or steps; the target sets how much context, code, passage or transcript
is added.
"""

from __future__ import annotations

from types import ModuleType

from . import chat, code, instruction, math, multiturn, reading, safety
from .common import EASY, HARD, MEDIUM, Dice

WRITERS: dict[str, ModuleType] = {m.KIND: m for m in (instruction, code, safety, multiturn, math, reading, chat)}
KINDS: tuple[str, ...] = tuple(WRITERS)

__all__ = ["EASY", "HARD", "KINDS", "MEDIUM", "WRITERS", "Dice", "topics", "write"]


def topics(kind: str) -> tuple[str, ...]:
    return tuple(WRITERS[kind].TOPICS)


def write(dice: Dice, kind: str, topic: str, level: int, target_tokens: int) -> str:
    return WRITERS[kind].write(dice, topic, level, target_tokens)
