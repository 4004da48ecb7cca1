"""Refreshing the estimators without a restart: the label store's labels folded in, checked, swapped, versioned.

A refresh (POST /admin/refresh, `routebalance refresh`, or every [learning] refresh_interval_s) runs in a
worker thread while the gateway serves: it reads the store's labels, embeds their prompts, fits what
traffic adds to the built estimators (corrections, and heads for models the built labels lack) and checks
it out of fold against the procedures `train` chose (estimators/refit.py). A refit that routes worse is
refused and the running estimators stay. An accepted one gets the next version: it is written beside the
built artefacts (`refresh-v<N>.npz`, listed and hashed in the manifest with the version history) and
swapped in between two batches, as a config reload is. POST /admin/rollback swaps back to the version before.
Each answer's `X-Route-Estimator` header names the version whose estimates routed it.

If the models directory cannot be written, the refit still serves, in memory only, and says so.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.api.errors import ApiError
from gateway.config.sections import Config
from gateway.config.store import ConfigStore
from gateway.core.budget import predicted_cost, price_arrays
from gateway.estimators.bundle import Estimators
from gateway.estimators.crossfit import EstimatorCandidate, Pricing
from gateway.estimators.manifest import sha256_of, write_manifest
from gateway.estimators.refit import (
    Base,
    Refit,
    RefitSettings,
    TrafficLabels,
    built_procedure,
    load_traffic_fit,
    refit,
    save_traffic_fit,
)
from gateway.learning.labels import LENGTH, Label
from gateway.serving.driver import Scheduler
from gateway.serving.learner import TrafficLearner
from gateway.serving.metrics import GatewayMetrics

log = logging.getLogger("routebalance.refresh")
# What `train` chose when a manifest does not say (a synthetic build): the paper's KNN.
PAPER_CHOICE = {"quality": {"name": "knn k=10 shrunk", "kind": "knn", "params": {"k": 10, "shrink": True}},
                "length": {"name": "knn k=10", "kind": "knn", "params": {"k": 10}}}


@dataclass(frozen=True, slots=True)
class TrafficSet:
    """The store's labels made ready for a refit."""

    models: tuple[str, ...]
    quality: TrafficLabels
    length: TrafficLabels
    skipped: dict[str, int]  # why -> labels left out


class EstimatorRefresh:
    def __init__(self, scheduler: Scheduler, learner: TrafficLearner, store: ConfigStore, metrics: GatewayMetrics):
        self.scheduler = scheduler
        self.learner = learner
        self.store = store
        self.metrics = metrics
        self._running = asyncio.Lock()

    def _ready(self) -> Estimators:
        estimators = self.scheduler.estimators
        if estimators is None:
            raise ApiError(409, "this gateway routes without estimators (its policy needs none): nothing to refresh",
                           None, "no_estimators")
        return estimators

    async def refresh(self, reason: str) -> dict:
        """Refit, check, and swap in when accepted; the outcome as JSON-able figures."""
        current = self._ready()
        label_store = self.learner.store
        if label_store is None:
            raise ApiError(503, f"no labels to refresh from: {self.learner.unavailable}", None, "learning_off")
        if self._running.locked():
            raise ApiError(409, "a refresh is running: try again when it is done", None, "refresh_running")
        async with self._running:
            cfg = self.store.current
            started = time.perf_counter()
            try:
                outcome, fresh = await asyncio.to_thread(self._refit, cfg, current, label_store.labels)
            except Exception as e:
                self.metrics.refreshes.labels("failed").inc()
                log.exception("refresh (%s) failed", reason)
                raise ApiError(503, f"the refresh failed, the running estimators stay: {e}", None,
                               "refresh_failed") from None
            outcome["seconds"] = round(time.perf_counter() - started, 2)
            if fresh is None:
                self.metrics.refreshes.labels("refused").inc()
                log.warning("refresh (%s) refused: %s", reason, outcome["reason"])
                return outcome
            self.scheduler.estimators = fresh
            self.metrics.refreshes.labels("accepted").inc()
            self.metrics.estimator_version.set(fresh.version)
            log.info("refresh (%s): estimators version %d in %.1f s (traffic labels: %s)", reason, fresh.version,
                     outcome["seconds"], ", ".join(f"{m}: {n}" for m, n in outcome["traffic"].items()))
            return outcome

    async def rollback(self) -> dict:
        """Back to the version before the running one (as recorded in the manifest)."""
        current = self._ready()
        async with self._running:
            history = current.manifest.get("versions", [])
            older = [v for v in history if v["version"] < current.version]
            if not older:
                raise ApiError(409, f"estimators version {current.version} has no earlier version to roll back to",
                               None, "no_earlier_version")
            target = older[-1]
            fresh = await asyncio.to_thread(self._load_version, current, target)
            self.scheduler.estimators = fresh
            self.metrics.estimator_version.set(fresh.version)
            log.info("rolled back: estimators version %d -> %d", current.version, fresh.version)
            return {"version": fresh.version, "rolled_back_from": current.version}

    async def run_every(self) -> None:
        """Refresh on the config's schedule (refresh_interval_s, read each round; 0: wait for a change)."""
        while True:
            interval = self.store.current.learning.refresh_interval_s
            await asyncio.sleep(interval if interval > 0 else 5.0)
            if interval > 0 and self.learner.store is not None and self.scheduler.estimators is not None:
                try:
                    await self.refresh("schedule")
                except ApiError as e:
                    log.warning("scheduled refresh: %s", e.message)

    # ---- in the worker thread ----------------------------------------------------------------------
    def _refit(self, cfg: Config, current: Estimators, labels) -> tuple[dict, Estimators | None]:
        traffic = traffic_set(cfg, current, labels())
        base = base_of(current, cfg)
        choice = current.manifest.get("chosen", PAPER_CHOICE)
        procedure = built_procedure(base, candidate(choice["quality"]), candidate(choice["length"]),
                                    current.knn.models)
        learning = cfg.learning
        settings = RefitSettings(min_labels=learning.min_labels, tolerance=learning.refresh_tolerance,
                                 check_rows=learning.refresh_check_rows, seed=cfg.estimators.seed)
        result = refit(base, current.built_estimate, procedure, current.knn.models, traffic.quality, traffic.length,
                       traffic.models, settings)
        outcome = {"accepted": result.accepted, "traffic": {m: n for m, (n, _) in result.traffic.items()},
                   "headed": list(result.fit.headed),
                   "corrected": list(result.fit.quality_correction.models if result.fit.quality_correction else ()),
                   "check": {"built": result.check_built, "refit": result.check_refit, "tolerance": result.tolerance},
                   "traffic_labels": {"quality": len(traffic.quality), "length": len(traffic.length)},
                   "skipped": traffic.skipped, "version": current.version}
        if not result.accepted:
            outcome["reason"] = (f"the refit routes worse out of fold ({result.check_refit:+.4f} above the hull "
                                 f"against {result.check_built:+.4f} for the built estimators, tolerance "
                                 f"{result.tolerance:g})")
            return outcome, None
        fresh, persisted = self._versioned(current, result, cfg.learning.max_versions)
        outcome.update(version=fresh.version, persisted=persisted)
        return outcome, fresh

    def _versioned(self, current: Estimators, result: Refit, max_versions: int) -> tuple[Estimators, bool]:
        """The refit as the next version, written beside the artefacts when the directory allows."""
        manifest = {**current.manifest, "files": dict(current.manifest["files"])}
        history = list(manifest.get("versions") or [_first_version(manifest)])
        version = max(v["version"] for v in history) + 1
        entry = {"version": version, "file": f"refresh-v{version}.npz",
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                 "traffic": result.traffic, "check": [result.check_built, result.check_refit]}
        manifest.update(version=version, refreshed={"file": entry["file"]})
        fresh = current.refreshed(result.fit, manifest, result.traffic)
        directory = current.models_dir
        if directory is None:
            return fresh, False
        try:
            save_traffic_fit(directory / entry["file"], result.fit)
            manifest["files"][entry["file"]] = sha256_of(directory / entry["file"])
            history.append(entry)
            manifest["versions"] = _pruned(history, max_versions, manifest["files"], directory)
            write_manifest(directory, manifest)
        except OSError as e:
            log.warning("the refit serves in memory only: cannot write it to %s (%s); it is lost at a restart",
                        directory, e)
            return fresh, False
        return fresh, True

    def _load_version(self, current: Estimators, target: dict) -> Estimators:
        manifest = {**current.manifest, "version": target["version"]}
        fit = None
        if target.get("file"):
            if current.models_dir is None:
                raise ApiError(409, "the earlier version was never written to disk", None, "no_earlier_version")
            fit = load_traffic_fit(current.models_dir / target["file"])
            manifest["refreshed"] = {"file": target["file"]}
        else:
            manifest.pop("refreshed", None)
        fresh = current.refreshed(fit, manifest, {m: (int(n), float(s)) for m, (n, s) in
                                                  (target.get("traffic") or {}).items()})
        if current.models_dir is not None:
            try:
                write_manifest(current.models_dir, manifest)
            except OSError as e:
                log.warning("rolled back in memory only: cannot write %s (%s)", current.models_dir, e)
        return fresh


def candidate(spec: dict) -> EstimatorCandidate:
    return EstimatorCandidate(spec["name"], spec["kind"], dict(spec["params"]))


def _first_version(manifest: dict) -> dict:
    """The built estimators as version 1 of the history (nothing on top)."""
    return {"version": int(manifest.get("version", 1)), "file": None, "at": manifest.get("built_at"),
            "traffic": None, "check": None}


def _pruned(history: list[dict], keep: int, files: dict, directory: Path) -> list[dict]:
    """The history with at most `keep` refits on disk: the oldest refits' files deleted (the built version,
    the first, always stays)."""
    first, refits = history[:1], history[1:]
    for gone in refits[:-keep] if len(refits) > keep else []:
        files.pop(gone["file"], None)
        (directory / gone["file"]).unlink(missing_ok=True)
    return first + refits[-keep:]


def base_of(estimators: Estimators, cfg: Config) -> Base:
    """The built index's labelled rows, priced at the config's prices (a model the pool lacks: free, never
    the pick that matters)."""
    knn = estimators.knn
    x = knn.index.reconstruct_n(0, knn.index.ntotal)
    first = {i.model: i for i in reversed(cfg.instances)}
    cols = [j for j, m in enumerate(knn.models) if m in first]
    price_in, price_out = np.zeros(len(knn.models)), np.zeros(len(knn.models))
    if cols:
        price_in[cols], price_out[cols] = price_arrays([first[knn.models[j]] for j in cols])
    input_len = knn.input_tokens.astype(np.float64)
    cost = predicted_cost(input_len[:, None], knn.length.astype(np.float64), price_in, price_out)
    return Base(x, knn.quality, knn.length, knn.prompt_hashes, Pricing(price_in, price_out, input_len, cost))


def traffic_set(cfg: Config, estimators: Estimators, labels: Iterable[Label]) -> TrafficSet:
    """The store's labels for the pool's models, their prompts embedded (once each). Labels without their
    prompt's text (kept as hashes) cannot be embedded; sources weighted 0 and models the pool lacks are left
    out: each counted."""
    pool = cfg.models()
    models = estimators.knn.models + tuple(m for m in pool if m not in estimators.knn.models)
    column = {m: j for j, m in enumerate(models)}
    weights = cfg.learning.source_weights
    skipped: dict[str, int] = {}
    quality_rows: list[tuple[str, int, float, float]] = []
    length_rows: list[tuple[str, int, float, bool]] = []
    texts: dict[str, str] = {}
    for label in labels:
        why = _left_out(label, column, weights, texts)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        if label.prompt is not None:
            texts.setdefault(label.prompt_hash, label.prompt)
        if label.source == LENGTH:
            length_rows.append((label.prompt_hash, column[label.model], label.value, label.censored))
        else:
            quality_rows.append((label.prompt_hash, column[label.model], label.value, weights[label.source]))
    order = list(texts)
    vectors = estimators.embedder.embed([texts[h] for h in order]) if order else np.zeros((0, estimators.knn.index.d))
    row_of = {h: k for k, h in enumerate(order)}

    def labels_of(rows, censored: bool) -> TrafficLabels:
        if not rows:
            return TrafficLabels.empty(estimators.knn.index.d)
        hashes = np.array([r[0] for r in rows], dtype=object)
        return TrafficLabels(vectors[[row_of[h] for h in hashes]], np.array([r[1] for r in rows]),
                             np.array([r[2] for r in rows], dtype=np.float64),
                             np.ones(len(rows)) if censored else np.array([r[3] for r in rows], dtype=np.float64),
                             np.array([r[3] for r in rows], dtype=bool) if censored else np.zeros(len(rows), bool),
                             hashes)

    return TrafficSet(models, labels_of(quality_rows, False), labels_of(length_rows, True), skipped)


def _left_out(label: Label, column: dict, weights, texts: dict) -> str | None:
    """Why a label cannot be folded in (None: it can)."""
    if label.model not in column:
        return "model not in the pool"
    if label.prompt is None and label.prompt_hash not in texts:
        return "no prompt text (kept as a hash only)"
    if label.source != LENGTH and not weights.get(label.source):
        return f"source {label.source} weighted 0"
    return None
