"""A label store's labels as a workload file for `routebalance train --workload` (gateway/records.py's shape).

`train` refuses a model labelled in some records only, so a prompt is exported only when every exported
model has both a quality label and a length for it; the others are counted by the first thing they lack.

- score: the mean of the quality sources present (file, judge, feedback), each weighted by its
  configured weight: sources are combined, not taken as one scale; a source weighted 0 is left out.
- output_length: the longest uncensored length seen; where only censored lengths exist (every answer was
  cut), the longest of those, marked `"length_censored": true` in the model's label and counted.

The prompt's text is needed (the estimators embed it): prompts kept as hashes only are left out.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gateway.learning.labels import LENGTH, Label


@dataclass(slots=True)
class ExportSummary:
    models: list[str]
    exported: int = 0
    censored_lengths: int = 0  # exported model labels whose length is only a lower bound
    left_out: Counter[str] = field(default_factory=Counter)  # why -> prompts


def workload_records(labels: Iterable[Label], models: Sequence[str], weights: Mapping[str, float],
                     count_tokens: Callable[[str], int], summary: ExportSummary):
    """One record (a dict in the workload file's shape) per exportable prompt; `labels` grouped by prompt."""
    for h, group in itertools.groupby(labels, key=lambda label: label.prompt_hash):
        prompt, scores, lengths = _collect(group)
        record_models: dict[str, dict] = {}
        why = "no prompt text (kept as a hash only)" if prompt is None else None
        for model in models if why is None else ():
            quality = {s: v for s, v in scores.get(model, {}).items() if weights.get(s, 0.0) > 0}
            full, cut = lengths.get(model, (None, None))
            if not quality:
                why = f"no quality label for {model}"
                break
            if full is None and cut is None:
                why = f"no answer length for {model}"
                break
            label: dict = {"score": sum(weights[s] * v for s, v in quality.items()) / sum(weights[s] for s in quality),
                           "output_length": int(full if full is not None else cut), "sources": sorted(quality)}
            if full is None:
                label["length_censored"] = True
            record_models[model] = label
        if why is not None or not record_models:
            summary.left_out[why or "no exported model"] += 1
            continue
        summary.exported += 1
        summary.censored_lengths += sum(1 for m in record_models.values() if m.get("length_censored"))
        assert prompt is not None  # checked above
        yield {"id": h, "prompt": prompt, "input_len": count_tokens(prompt), "models": record_models}


def _collect(group: Iterable[Label]):
    """A prompt's text, its quality scores (model -> source -> score) and lengths (model -> (longest
    uncensored, longest censored))."""
    prompt: str | None = None
    scores: dict[str, dict[str, float]] = {}
    lengths: dict[str, tuple[float | None, float | None]] = {}
    for label in group:
        prompt = prompt if prompt is not None else label.prompt
        if label.source != LENGTH:
            scores.setdefault(label.model, {})[label.source] = label.value
            continue
        full, cut = lengths.get(label.model, (None, None))
        if label.censored:
            cut = label.value if cut is None else max(cut, label.value)
        else:
            full = label.value if full is None else max(full, label.value)
        lengths[label.model] = (full, cut)
    return prompt, scores, lengths


def write_workload(labels: Iterable[Label], out: str | os.PathLike[str], models: Sequence[str],
                   weights: Mapping[str, float], count_tokens: Callable[[str], int]) -> ExportSummary:
    """Write the exportable prompts as JSON Lines to `out` (replaced atomically; not written when none is)."""
    summary = ExportSummary(list(models))
    out = Path(out)
    tmp = out.with_name(out.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            for record in workload_records(labels, models, weights, count_tokens, summary):
                f.write(json.dumps(record, ensure_ascii=False))
                f.write("\n")
        if summary.exported:
            os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return summary
