"""Labelled workload records: one prompt with a quality score and an answer length per model.

The file format is JSON Lines in the record shape of the RouteBalance authors
(papers/README.md), so their released data reads as is:

    {"prompt": "...", "input_len": 57,
     "models": {"Qwen/Qwen2.5-3B-Instruct": {"output_length": 212, "score": 0.41, ...}, ...}}

Two optional keys of our own ride along: ``id`` (defaults to ``prompt_key`` of the
prompt text, the same key the emulator uses to find a prompt's labels) and
``kind`` (the family of prompt, e.g. "math"; defaults to "unknown"). Any other
key, at either level, is ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.tokens import estimate_tokens

UNKNOWN_KIND = "unknown"
MAX_OUTPUT_TOKENS = 1024  # answers are capped at this length (the labels and the emulator's answers)


def prompt_key(text: str) -> str:
    """Stable key of a prompt text: a record's default id, and how the emulator finds a prompt's labels."""
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


@dataclass(frozen=True, slots=True)
class ModelLabel:
    """What one model did with one prompt: judged quality in [0, 1] and answer length in tokens."""

    score: float
    output_length: int


@dataclass(frozen=True, slots=True)
class Record:
    """One labelled prompt. ``models`` maps a model name to its label; treat it as read-only."""

    id: str
    prompt: str
    kind: str
    input_len: int
    models: Mapping[str, ModelLabel] = field(hash=False)


# --- reading -----------------------------------------------------------------


def read_jsonl(path: str | os.PathLike) -> list[Record]:
    """Read labelled records; a bad line raises ValueError naming the file, the line and the problem.

    Blank lines are skipped.
    """
    path = Path(path)
    records: list[Record] = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(parse_record(line))
            except ValueError as e:
                if not records and line.lstrip().startswith("["):
                    raise ValueError(f"{path}:{lineno}: a JSON array; a workload is JSON Lines, one JSON object "
                                     "(one prompt and its labels) per line") from None
                raise ValueError(f"{path}:{lineno}: {e}") from None
    return records


def parse_record(line: str) -> Record:
    """One JSON line to a Record; raises ValueError saying what is wrong with it."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")

    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("missing prompt (a non-empty string)")

    raw_models = obj.get("models")
    if not isinstance(raw_models, dict) or not raw_models:
        raise ValueError("no models (need a non-empty object of model name -> label)")
    models = {str(name): _parse_label(name, label) for name, label in raw_models.items()}

    input_len = obj.get("input_len")
    if input_len is None:
        input_len = estimate_tokens(prompt)
    elif not _is_count(input_len):
        raise ValueError(f"input_len must be a non-negative integer, got {input_len!r}")

    record_id = obj.get("id")
    if record_id is None:
        record_id = prompt_key(prompt)
    kind = obj.get("kind") or obj.get("task") or UNKNOWN_KIND  # the real-label files call it "task"
    return Record(id=str(record_id), prompt=prompt, kind=str(kind), input_len=int(input_len), models=models)


def _parse_label(name: str, label: object) -> ModelLabel:
    if not isinstance(label, dict):
        raise ValueError(f"model {name!r}: label must be an object, got {type(label).__name__}")
    score = label.get("score")
    if not _is_number(score) or not 0.0 <= score <= 1.0:
        raise ValueError(f"model {name!r}: score must be a number in [0, 1], got {score!r}")
    length = label.get("output_length")
    if not _is_count(length):
        raise ValueError(f"model {name!r}: output_length must be a non-negative integer, got {length!r}")
    return ModelLabel(score=float(score), output_length=int(length))


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _is_count(x: object) -> bool:
    # Integral floats (120.0) are accepted: dataframe exports write counts that way.
    return _is_number(x) and x >= 0 and float(x).is_integer()


# --- writing -----------------------------------------------------------------


def record_to_json(record: Record) -> dict:
    return {
        "id": record.id,
        "kind": record.kind,
        "prompt": record.prompt,
        "input_len": record.input_len,
        "models": {
            name: {"output_length": label.output_length, "score": label.score}
            for name, label in record.models.items()
        },
    }


def write_jsonl(records: Iterable[Record], path: str | os.PathLike) -> None:
    """Write records as JSON Lines (UTF-8); the file is replaced atomically."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record_to_json(record), ensure_ascii=False))
            f.write("\n")
    os.replace(tmp, path)


# --- splitting and model names ------------------------------------------------


def split_fraction(prompt: str) -> float:
    """A stable number in [0, 1) from the prompt text alone (same on every machine and run)."""
    digest = hashlib.blake2b(prompt.encode("utf-8", "surrogatepass"), digest_size=8, person=b"wl-split").digest()
    return int.from_bytes(digest, "big") / 2.0**64


def split(records: Iterable[Record], test_share: float = 0.2) -> tuple[list[Record], list[Record]]:
    """Train/test split by a hash of each prompt's text: independent of order, stable everywhere.

    Records with the same prompt always land on the same side. Input order is kept.
    """
    if not 0.0 <= test_share <= 1.0:
        raise ValueError(f"test_share must be in [0, 1], got {test_share}")
    train: list[Record] = []
    test: list[Record] = []
    for record in records:
        (test if split_fraction(record.prompt) < test_share else train).append(record)
    return train, test


def model_names(records: Iterable[Record]) -> list[str]:
    """Model names labelled in every record, in order of first appearance."""
    seen: dict[str, None] = {}
    common: set[str] | None = None
    for record in records:
        names = record.models.keys()
        for name in names:
            seen.setdefault(name)
        common = set(names) if common is None else common & set(names)
    return [name for name in seen if common and name in common]
