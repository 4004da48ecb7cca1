"""Aggregate figures of a labelled workload, in the terms the paper reports them."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence

import numpy as np

from gateway.records import Record, model_names


def aggregates(records: Sequence[Record], mix: Mapping[str, float] | None = None) -> dict:
    """Per-model mean quality and answer length, oracle and prompt-blind mix quality, prompt-length
    percentiles and kind counts.

    ``random_mix_quality`` is the mean quality of a router that ignores the prompt and sends each
    request to model m with probability mix[m] (default: uniform over the models), which is the
    mix-weighted average of the per-model means. Only models labelled on every record count.
    """
    if not records:
        raise ValueError("no records")
    names = model_names(records)
    if not names:
        raise ValueError("no model is labelled on every record")
    scores = np.array([[r.models[m].score for m in names] for r in records])
    lengths = np.array([[r.models[m].output_length for m in names] for r in records], dtype=float)
    prompt_lens = np.array([r.input_len for r in records], dtype=float)

    weights = np.ones(len(names)) if mix is None else np.array([float(mix.get(m, 0.0)) for m in names])
    if weights.sum() <= 0:
        raise ValueError("mix weights must have a positive sum over the labelled models")
    weights = weights / weights.sum()
    per_model = scores.mean(axis=0)

    return {
        "records": len(records),
        "models": names,
        "mean_quality": dict(zip(names, per_model.round(4).tolist(), strict=True)),
        "oracle_quality": round(float(scores.max(axis=1).mean()), 4),
        "random_mix_quality": round(float(per_model @ weights), 4),
        "best_model_share": dict(zip(names, (np.bincount(scores.argmax(axis=1), minlength=len(names))
                                             / len(records)).round(4).tolist(), strict=True)),
        "mean_output_tokens": dict(zip(names, lengths.mean(axis=0).round(1).tolist(), strict=True)),
        "prompt_tokens": {
            "mean": round(float(prompt_lens.mean()), 1),
            "median": round(float(np.median(prompt_lens)), 1),
            "p90": round(float(np.percentile(prompt_lens, 90)), 1),
            "p99": round(float(np.percentile(prompt_lens, 99)), 1),
            "max": int(prompt_lens.max()),
        },
        "kinds": dict(Counter(r.kind for r in records).most_common()),
    }
