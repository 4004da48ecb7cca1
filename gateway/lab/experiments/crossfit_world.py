"""A labelled file replayed in the simulator, cross-fitted: no replayed prompt is in the index that routes it.

`routebalance train --workload FILE` builds the served estimators from every
record, so replaying that file through them would let each prompt find its
own labels. Here the file's prompts are cut into k folds (by prompt, the
folds `train`'s report uses), and each fold is replayed with estimators
fitted on the other folds only, in memory: the estimator `train` would
choose on those folds (crossfit.choose: the KNN, shrunk or not, or learned
heads), its KNN index (which the pipeline baselines, Avengers-Pro and
BEST-Route, train on) and the built TPOT heads. Every policy of a cell sees
the same folds.

A fold replays its prompts in a fixed shuffled order, pass after pass, until
it has its share of the cell's requests; the seed changes the arrivals only.
Real answer lengths drive the engines, clipped at 1,024 tokens as the
emulator clips them; quality is the file's own score of the model that
answered.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from pathlib import Path

import numpy as np

from gateway.estimators.bundle import Estimators
from gateway.estimators.crossfit import choose, folds
from gateway.estimators.knn import KnnEstimator
from gateway.lab.sim.evalset import (
    EvalSet,
    cache_key,
    cached_cost,
    domain_of,
    labels_of,
    load_evalset,
    prompt_tokens_of,
)
from gateway.lab.training.build import checked_workload, label_arrays
from gateway.lab.training.routing_report import pricing_of
from gateway.learning.labels import prompt_hash
from gateway.records import Record, read_jsonl

log = logging.getLogger(__name__)
FOLDS = 5
FOLD_SEED = 0  # the folds `train`'s first repeat cuts
CACHE_VERSION = 1


def _cache_key(manifest: dict, cfg, records: list[Record]) -> str:
    """What the cached embeddings depend on: the embedder, its truncation and the prompts."""
    h = hashlib.sha256()
    h.update(json.dumps([CACHE_VERSION, manifest["embedder"], cfg.estimators.max_tokens], sort_keys=True).encode())
    for r in records:
        h.update(r.prompt.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def load_world(cfg, n: int, workload: str | None = None, estimators=None) -> list[tuple[EvalSet, object]]:
    """What a cell replays, as (evaluation set, estimators that route it) parts whose outcomes are pooled:
    the synthetic held-out set routed by the built estimators (one part), or a labelled file's folds, each
    routed by estimators fitted on the other folds (crossfit_folds)."""
    if estimators is None:
        estimators = Estimators.load(cfg)
    if workload:
        return crossfit_folds(cfg, workload, n, estimators)
    return [(load_evalset(cfg, n, estimators), estimators)]


def crossfit_folds(cfg, workload: str, requests: int, base) -> list:
    """[(EvalSet, Estimators)] one per fold: the fold's prompts (its share of `requests`, in passes) with
    estimates and an index fitted on the other folds. `base`: the built bundle (embedder, TPOT heads)."""
    records = read_jsonl(workload)
    models = checked_workload(records, cfg, workload)
    cache = Path(cfg.estimators.models_dir) / "sim" / f"embedded-{_cache_key(base.manifest, cfg, records)}.npz"
    if cache.is_file():
        with np.load(cache) as z:
            x = z["embeddings"]
    else:
        log.info("embedding %d prompts of %s once for the simulator (cached in %s)", len(records), workload,
                 cache.parent)
        x = base.embedder.embed([r.prompt for r in records])
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(".tmp.npz")
        np.savez(tmp, embeddings=x)
        tmp.replace(cache)
    quality, length = label_arrays(records, models)
    pricing = pricing_of(records, cfg, models)
    hashes = np.array([prompt_hash(r.prompt) for r in records])
    inputs = np.array([r.input_len for r in records], dtype=np.float32)
    tokens = prompt_tokens_of(records)
    score, answer = labels_of(records, cfg.instances)
    cut = folds(len(records), FOLDS, FOLD_SEED, groups=hashes)
    per_fold = math.ceil(requests / FOLDS)
    out = []
    for f, test in enumerate(cut):
        train = np.setdiff1d(np.arange(len(records)), test)
        choice = choose(x, quality, length, pricing, models, train, seed=cfg.estimators.seed, groups=hashes)
        knn = KnnEstimator.build(x[train], quality[train], length[train], models, k=choice.knn_k,
                                 input_tokens=inputs[train], prompt_hashes=hashes[train])
        quality_head, length_head = choice.heads(x[train], quality[train], length[train], models)
        est = Estimators(base.embedder, knn, base.heads, base.manifest, None, quality_head, length_head,
                         shrink=choice.shrink)
        log.info("fold %d: %d prompts replayed, routed by %s / %s fitted on %d others", f, len(test),
                 choice.quality.name, choice.length.name, len(train))
        rows = _passes(test, per_fold, seed=f)
        estimates = est.for_embedded(x[rows], cfg.instances)
        if f == 0:  # the scheduler's compute on these prompts, timed once and kept: every worker charges the same
            pool = cache_key(base.manifest, cfg)  # the build and the pool the cost was timed on
            cost = cached_cost(cache.with_name(f"cost-{cache.stem}-{pool}.json"), lambda est=est: est, cfg,
                               [records[r].prompt for r in test])
        out.append((EvalSet(tuple(records[r].prompt for r in rows), tokens[rows], score[rows], answer[rows],
                            estimates.quality, estimates.length, estimates.embeddings, cost,
                            tuple(domain_of(records[r]) for r in rows)), est))
    return out


def _passes(rows: np.ndarray, n: int, seed: int) -> np.ndarray:
    """n row indices: `rows` in one seeded shuffled order, repeated (the same order every pass)."""
    order = np.random.default_rng(seed).permutation(rows)
    return np.resize(order, n)
