"""The two files of offline collection: the prompts `collect` reads, and the answers it writes for `judge`.

Prompts, JSON Lines, one object a line:

    {"id": "q1", "prompt": "What is 6 x 7?", "reference": "42", "task": "math"}

`prompt` is required; `id` (a string or an integer) defaults to the key `gateway.records.prompt_key` makes of
the prompt's text; `reference` (a string or a number) is the correct answer, checked by a rule instead of the
judge; `task` is the family of the prompt (the workload's `task`). Other keys are ignored.

Answers, one line per (prompt, model), self-contained so that `judge` needs no other file:

    {"id": "q1", "model": "...", "prompt": "...", "reference": "42", "task": "math", "answer": "...",
     "output_length": 57, "length_from": "usage", "finish_reason": "stop", "prompt_tokens": 31,
     "instance": "qwen7b-a30-0", "cost_usd": 4.6e-06}

`output_length` is the server's `usage.completion_tokens` (`length_from: "usage"`), or the answer's tokens
counted here when the server sent no usage (`"counted"`). A `finish_reason` of "length" means the answer was
cut at max_tokens: its length is a lower bound.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from gateway.lab.labelling.appendlog import read_log
from gateway.records import prompt_key


@dataclass(frozen=True, slots=True)
class PromptRow:
    """One prompt to collect answers to; `line` is where it stands in its file (for messages)."""

    id: str
    prompt: str
    line: int
    reference: str | None = None
    task: str | None = None


@dataclass(frozen=True, slots=True)
class CollectedAnswer:
    """One model's answer to one prompt, as the answers file holds it."""

    id: str
    model: str
    prompt: str
    answer: str
    output_length: int
    finish_reason: str | None
    length_from: str
    prompt_tokens: int
    instance: str
    cost_usd: float
    reference: str | None = None
    task: str | None = None
    line: int = 0  # where it stands in the answers file (0: not read from one)

    @property
    def cut(self) -> bool:
        """The answer reached max_tokens: its length is only a lower bound."""
        return self.finish_reason == "length"

    def to_json(self) -> dict:
        row: dict = {"id": self.id, "model": self.model, "prompt": self.prompt}
        if self.reference is not None:
            row["reference"] = self.reference
        if self.task is not None:
            row["task"] = self.task
        row |= {"answer": self.answer, "output_length": self.output_length, "length_from": self.length_from,
                "finish_reason": self.finish_reason, "prompt_tokens": self.prompt_tokens,
                "instance": self.instance, "cost_usd": self.cost_usd}
        return row


# --- prompts -------------------------------------------------------------------------------------------------


def read_prompts(path: Path) -> list[PromptRow]:
    """The prompts of a file; ValueError naming the file, the line and the field of the first bad one."""
    rows: list[PromptRow] = []
    seen: dict[str, int] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if not rows and line.lstrip().startswith("["):
                raise ValueError(f"{path}:{lineno}: a JSON array; the prompts file is JSON Lines, one JSON object "
                                 "(one prompt) per line")
            try:
                row = _prompt_row(line, lineno)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            if row.id in seen:
                raise ValueError(f"{path}:{lineno}: id {row.id!r} is also the id of line {seen[row.id]} (ids must "
                                 "be unique; leave them out to key prompts by their text)")
            seen[row.id] = lineno
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _prompt_row(line: str, lineno: int) -> PromptRow:
    try:
        obj = json.loads(line)
    except ValueError as e:
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("prompt: missing (a non-empty string)")
    return PromptRow(id=_id(obj.get("id"), prompt), prompt=prompt, line=lineno,
                     reference=_reference(obj.get("reference")), task=_text(obj, "task"))


def _id(value: object, prompt: str) -> str:
    if value is None:
        return prompt_key(prompt)
    if isinstance(value, bool) or not isinstance(value, (str, int)) or value == "":
        raise ValueError(f"id: must be a non-empty string or an integer, got {value!r}")
    return str(value)


def _reference(value: object) -> str | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f"reference: must be a string or a number, got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"reference: must be a finite number, got {value!r}")
    if isinstance(value, str) and not value.strip():
        raise ValueError("reference: must not be empty (leave it out where there is none)")
    return str(value)


def _text(obj: dict, key: str) -> str | None:
    value = obj.get(key)
    if value is not None and (not isinstance(value, str) or not value):
        raise ValueError(f"{key}: must be a non-empty string, got {value!r}")
    return value


# --- answers -------------------------------------------------------------------------------------------------


def read_answers(path: Path, *, repair: bool) -> tuple[list[CollectedAnswer], str | None]:
    """The answers of a file (none when it does not exist), and a note when its last line was torn (see
    appendlog.read_log; `repair` cuts it off). A bad line: ValueError naming the file, the line and the field."""
    rows, note = read_log(path, repair=repair)
    answers = []
    for lineno, obj in rows:
        try:
            answers.append(_answer(obj, lineno))
        except ValueError as e:
            raise ValueError(f"{path}:{lineno}: {e}") from None
    return answers, note


def _answer(obj: dict, lineno: int) -> CollectedAnswer:
    def typed(key: str, kind: type | tuple[type, ...], optional: bool = False):
        value = obj.get(key)
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise ValueError(f"{key}: expected {names}, got {value!r}")
        return value

    length = typed("output_length", int)
    if length < 0:
        raise ValueError(f"output_length: must be >= 0, got {length}")
    cost = typed("cost_usd", (int, float))
    if not math.isfinite(cost) or cost < 0:
        raise ValueError(f"cost_usd: must be a finite number >= 0, got {cost!r}")
    return CollectedAnswer(
        id=typed("id", str), model=typed("model", str), prompt=typed("prompt", str), answer=typed("answer", str),
        output_length=length, finish_reason=typed("finish_reason", str, optional=True),
        length_from=typed("length_from", str), prompt_tokens=typed("prompt_tokens", int),
        instance=typed("instance", str), cost_usd=float(cost), reference=typed("reference", str, optional=True),
        task=typed("task", str, optional=True), line=lineno)
