"""Labelled workload: records of prompts with per-model quality and answer length.

- records.py: the record type and the JSONL format (reads the RouteBalance authors' shape).
- synthetic.py: a deterministic synthetic workload calibrated to the paper's dataset.
- summary.py: aggregate figures (per-model quality, oracle, lengths, kinds).
- text/: the prompt writers behind the synthetic workload, one module per kind.

``python -m gateway.workload [FILE.jsonl]`` prints the aggregates.
"""

from .records import ModelLabel, Record, model_names, read_jsonl, split, write_jsonl
from .summary import aggregates
from .synthetic import POOL_MODELS, generate

__all__ = [
    "POOL_MODELS",
    "ModelLabel",
    "Record",
    "aggregates",
    "generate",
    "model_names",
    "read_jsonl",
    "split",
    "write_jsonl",
]
