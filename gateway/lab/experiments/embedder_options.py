"""Faster embedders judged by the routing they give, not by how often they agree with the exact one.

    python -m gateway.lab.experiments.embedder_options \
        --workload ../shared/data/real-labels/zeroeval_crux_math_dev.jsonl

For each option (fp32 at 256 tokens, the reference; fp32 truncated at 128 and 64 tokens; int8, onnxruntime's
dynamic quantisation of the same graph, at 256; bf16, which onnxruntime's CPU provider here cannot run: the
probe says so in the table) on a labelled
file (real prompts, correctness and answer lengths):

- time: CPU ms per prompt and prompts/s, embedding the file's prompts in batches of the gateway's
  sub-batch size with its threads, in this process (one untimed pass first);
- outcome: the paper's KNN estimators (quality: k = 10 shrunk; length: k = 10, the synthetic build's)
  cross-fitted on that option's embeddings (the repeated k-fold `train --workload` reports with, the same
  folds for every option; the other candidates left out to keep the run short, and no candidate routes
  this file better than chance, docs/results/real_labels.md), then each preset's picks on an idle pool,
  scored with the prompts' own labels: mean correct and USD per 1,000 requests, and the paired difference
  to fp32 per prompt with its 95% bootstrap interval.

An option may become the default only if both its differences' intervals contain 0 on this file and on
the synthetic world (the design's rule); this command measures the real-label half.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.estimators.crossfit import LENGTH_CANDIDATES, QUALITY_CANDIDATES, Pricing, out_of_fold, pool_columns
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.minilm_export import export_minilm_onnx, quantize_int8
from gateway.lab.sim.stats import difference
from gateway.lab.training.build import checked_workload, label_arrays
from gateway.lab.training.routing_report import PER, picks, pricing_of
from gateway.learning.labels import prompt_hash
from gateway.records import Record, read_jsonl

log = logging.getLogger("routebalance.embedder_options")


@dataclass(frozen=True)
class Option:
    name: str
    max_tokens: int
    graph: str  # "fp32" | "int8" | "bf16"


OPTIONS = (Option("fp32, 256 tokens (reference)", 256, "fp32"), Option("fp32, 128 tokens", 128, "fp32"),
           Option("fp32, 64 tokens", 64, "fp32"), Option("int8, 256 tokens", 256, "int8"),
           Option("bf16, 256 tokens", 256, "bf16"))


def graph_for(option: Option, fp32: Path, work: Path) -> Path:
    """The ONNX file of an option's precision (int8 and bf16 are made from the fp32 graph into `work`)."""
    if option.graph == "fp32":
        return fp32
    out = work / f"minilm-{option.graph}.onnx"
    if not out.exists():
        if option.graph == "int8":
            quantize_int8(fp32, out)  # what `train` makes for [estimators] precision = "int8"
        else:
            _bf16_graph(out)
    return out


def _bf16_graph(out: Path) -> None:
    """Raise if onnxruntime's CPU provider has no bf16 kernel for the encoder's matrix product (onnxruntime
    1.32 has none: a bf16 graph cannot run here, and weights merely stored as bf16 would be cast back and
    computed in fp32, as slow as fp32); else make the bf16 graph (not reached on this runtime)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    x = [helper.make_tensor_value_info(n, TensorProto.BFLOAT16, [2, 2]) for n in ("a", "b")]
    probe = helper.make_model(helper.make_graph([helper.make_node("MatMul", ["a", "b"], ["y"])], "bf16", x,
                                                [helper.make_tensor_value_info("y", TensorProto.BFLOAT16, [2, 2])]),
                              opset_imports=[helper.make_opsetid("", 17)])
    ort.InferenceSession(probe.SerializeToString(), providers=["CPUExecutionProvider"])  # raises NOT_IMPLEMENTED
    raise NotImplementedError(f"onnxruntime {ort.__version__} runs bf16 MatMul on the CPU: convert the graph "
                              "(not written: no runtime here needed it)")


def timed_embeddings(embedder: Embedder, prompts: list[str]) -> tuple[np.ndarray, dict]:
    embedder.embed(prompts[:64])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    x = embedder.embed(prompts)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return x, {"cpu_ms_per_prompt": 1000 * cpu / len(prompts), "prompts_per_s": len(prompts) / wall}


@dataclass(frozen=True)
class Labelled:
    """A labelled file's arrays, the same for every option: labels, pricing, prompt groups, the pool's columns."""

    models: tuple[str, ...]
    quality: np.ndarray
    length: np.ndarray
    pricing: Pricing
    groups: np.ndarray  # each record's prompt hash: a repeated prompt stays in one fold
    cols: list[int]
    tpot_s: np.ndarray

    @classmethod
    def of(cls, records: list[Record], config, models: tuple[str, ...]) -> Labelled:
        quality, length = label_arrays(records, models)
        cols, pool = pool_columns(config.instances, models)
        return cls(models, quality, length, pricing_of(records, config, models),
                   np.array([prompt_hash(r.prompt) for r in records]), cols,
                   np.array([i.tpot_prior_ms / 1000 for i in pool]))


def outcomes(x: np.ndarray, data: Labelled, config) -> dict[str, dict]:
    """Each preset's per-prompt correctness and cost (mean over the repeats) on estimates cross-fitted on x."""
    est = config.estimators
    oof = out_of_fold(x, data.quality, data.length, data.pricing, data.models, est.cv_folds, est.cv_repeats,
                      groups=data.groups, quality_candidates=QUALITY_CANDIDATES[:1],
                      length_candidates=LENGTH_CANDIDATES[:1])
    correct = data.quality.astype(np.float64)
    rows = np.arange(len(correct))
    out = {}
    for name in config.scheduler.presets:
        w = config.weights(name)
        chosen = picks(oof.quality, oof.length, data.pricing, data.cols, data.tpot_s, (w.quality, w.latency, w.cost))
        out[name] = {"correct": correct[rows, chosen].mean(axis=0),
                     "usd": data.pricing.cost[rows, chosen].mean(axis=0) * PER}
    return out


def run(config, workload: str, options: tuple[Option, ...] = OPTIONS) -> dict:
    records = list(read_jsonl(workload))
    models = checked_workload(records, config, workload)
    prompts = [r.prompt for r in records]
    data = Labelled.of(records, config, models)
    est = config.estimators
    rows: list[dict] = []
    reference: dict[str, dict] | None = None
    with tempfile.TemporaryDirectory() as work:
        fp32 = export_minilm_onnx(Path(work) / "minilm-fp32.onnx")  # the graph `train` exports
        for option in options:
            row: dict = {"option": option.name}
            try:
                embedder = Embedder(graph_for(option, fp32, Path(work)), default_tokenizer_path(),
                                    max_tokens=option.max_tokens, threads=est.threads, batch_size=est.batch_size)
                x, timing = timed_embeddings(embedder, prompts)
            except Exception as e:  # an option this runtime cannot run is a result too
                row["error"] = f"{e.__class__.__name__}: {str(e).splitlines()[0][:200]}"
                log.warning("%s: %s", option.name, row["error"])
                rows.append(row)
                continue
            row.update(timing)
            figures = outcomes(x, data, config)
            if reference is None:
                reference = figures
            for preset, f in figures.items():
                dq = difference(f["correct"][None, :], reference[preset]["correct"][None, :], seed=est.seed)
                dc = difference(f["usd"][None, :], reference[preset]["usd"][None, :], seed=est.seed)
                row[preset] = {"correct": float(f["correct"].mean()), "usd_per_1k": float(f["usd"].mean()),
                               "d_correct": [float(v) for v in (dq.mean, dq.lo, dq.hi)],
                               "d_usd_per_1k": [float(v) for v in (dc.mean, dc.lo, dc.hi)],
                               "inside": bool(dq.lo <= 0 <= dq.hi and dc.lo <= 0 <= dc.hi)}
            log.info("%s: %.1f ms CPU per prompt", option.name, timing["cpu_ms_per_prompt"])
            rows.append(row)
    return {"workload": Path(workload).name, "prompts": len(records), "threads": est.threads,
            "batch_size": est.batch_size, "presets": list(config.scheduler.presets), "options": rows}


def format_table(result: dict) -> str:
    presets = result["presets"]
    lines = [f"{result['workload']}: {result['prompts']} prompts, threads {result['threads']}; differences to fp32 "
             "per prompt with 95% intervals (correct, USD per 1k requests)"]
    for row in result["options"]:
        if "error" in row:
            lines.append(f"{row['option']:<30} cannot run here: {row['error']}")
            continue
        head = f"{row['option']:<30} {row['cpu_ms_per_prompt']:6.1f} ms CPU/prompt {row['prompts_per_s']:6.1f}/s"
        parts = []
        for p in presets:
            f = row[p]
            dq, dc = f["d_correct"], f["d_usd_per_1k"]
            parts.append(f"{p}: {f['correct']:.3f} ({dq[0]:+.3f} [{dq[1]:+.3f}, {dq[2]:+.3f}]) "
                         f"{f['usd_per_1k']:.3f} USD ({dc[0]:+.3f} [{dc[1]:+.3f}, {dc[2]:+.3f}])"
                         f"{'' if f['inside'] else ' *'}")
        lines.append(head + "\n    " + "\n    ".join(parts))
    lines.append("* a difference whose interval excludes 0")
    return "\n".join(lines)


def main() -> None:
    import argparse
    import json

    from gateway.config.store import load_config, resolve_config_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", required=True, help="a labelled JSONL file (real prompts and labels)")
    parser.add_argument("--config", type=Path, help="config TOML (default: as `routebalance` finds it)")
    parser.add_argument("--out", type=Path, default=Path("loadtest/results/embedder_options.json"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    result = run(load_config(args.config or resolve_config_path()), args.workload)
    print(format_table(result))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
