"""The synthetic labelled workload: a deterministic generator calibrated to the paper's dataset.

- synthetic.py: the generator (seven kinds of prompts, per-model quality and answer length);
- text/: the prompt writers behind it, one module per kind;
- progressive.py: how long sketches and expansions of a labelled answer are (the emulator and simulator);
- summary.py: aggregate figures of any labelled workload (per-model quality, oracle, lengths, kinds).

The record format and its reader are not here: they are the serving side's data layer
(gateway/records.py), read by training, label export and progressive mode alike.

``python -m gateway.lab.workload [FILE.jsonl]`` prints the aggregates.
"""
