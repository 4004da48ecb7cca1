"""Labelled workload: records of prompts with per-model quality and answer length.

- records.py: the record type and the JSONL format (reads the RouteBalance authors' shape).
- summary.py: aggregate figures (per-model quality, oracle, lengths, kinds).
- synthetic.py: a deterministic synthetic workload calibrated to the paper's dataset.
- text/: the prompt writers behind the synthetic workload, one module per kind.

Importing this package reads records only: the synthetic generator and its prompt
templates are data-making tools, off the serving path; import them from
``gateway.workload.synthetic``.

``python -m gateway.workload [FILE.jsonl]`` prints the aggregates.
"""

from .records import (
    MAX_OUTPUT_TOKENS,
    ModelLabel,
    Record,
    model_names,
    prompt_key,
    read_jsonl,
    split,
    write_jsonl,
)
from .summary import aggregates

__all__ = [
    "MAX_OUTPUT_TOKENS",
    "ModelLabel",
    "Record",
    "aggregates",
    "model_names",
    "prompt_key",
    "read_jsonl",
    "split",
    "write_jsonl",
]
