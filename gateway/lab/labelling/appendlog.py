"""Append-only JSON Lines files that a long run can be stopped and resumed from, and its progress line.

A run appends one line per finished item and flushes it, so what was finished survives a stop (Ctrl-C, a
crash); the next run reads the lines back and skips those items. A stop in the middle of a write leaves a
last line without its newline: reading repairs that (the torn line is cut off the file, or kept when it is
whole JSON), so the next append starts on a line of its own.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import IO, Any


def read_log(path: Path, *, repair: bool) -> tuple[list[tuple[int, dict]], str | None]:
    """(line number, object) of each line of `path` (none when it does not exist), and a note when its last
    line was torn. `repair`: cut the torn line off the file (a run that appends to it next); otherwise leave
    the file alone. A bad line before the last: ValueError naming the file and the line."""
    if not path.exists():
        return [], None
    data = path.read_bytes()
    body, newline, tail = data.rpartition(b"\n")
    kept = body + newline
    note = None
    if tail.strip():
        whole = _as_object(tail)
        if whole is not None:
            kept = data + b"\n"
            note = f"{path}: its last line had no newline; it is whole, so it was kept"
        else:
            note = (f"{path}: its last line was cut short ({len(tail)} bytes, a run stopped while writing it) and "
                    + ("was removed" if repair else "is ignored"))
        if repair:
            with path.open("r+b") as f:
                f.truncate(len(body + newline))
                f.seek(0, os.SEEK_END)
                if whole is not None:
                    f.write(tail + b"\n")
    rows = []
    for lineno, line in enumerate(kept.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        obj = _as_object(line.encode())
        if obj is None:
            raise ValueError(f"{path}:{lineno}: not a JSON object (this file is JSON Lines, one object a line)")
        rows.append((lineno, obj))
    return rows, note


def _as_object(line: bytes) -> dict | None:
    try:
        obj = json.loads(line)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class AppendLog:
    """Lines appended to a file, each written whole and flushed before the next (readable by `read_log`)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[str] = path.open("a", encoding="utf-8")

    def append(self, obj: dict[str, Any]) -> None:
        self._file.write(json.dumps(obj, ensure_ascii=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ProgressLine:
    """`[=====     ] 12/40 answers, 1 failed, 3 s` on stderr: rewritten in place on a terminal, else a new
    line every `every_s` seconds (logs and pipes), and always at the end."""

    WIDTH = 24

    def __init__(self, what: str, total: int, every_s: float = 5.0, stream: IO[str] | None = None):
        self.what, self.total, self.every_s = what, total, every_s
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.started = self._shown = time.monotonic()

    def update(self, done: int, failed: int, *, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self._shown < (0.2 if self.tty else self.every_s):
            return
        self._shown = now
        filled = self.WIDTH * done // max(1, self.total)
        line = (f"[{'=' * filled}{' ' * (self.WIDTH - filled)}] {done}/{self.total} {self.what}"
                + (f", {failed} failed" if failed else "") + f", {now - self.started:.0f} s")
        end = "\n" if final or not self.tty else ""
        self.stream.write(("\r" if self.tty else "") + line + end)
        self.stream.flush()
