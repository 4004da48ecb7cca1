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
import contextlib
import fcntl
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.api.errors import ApiError
from gateway.artefacts import ArtefactError
from gateway.config.sections import Config
from gateway.config.store import ConfigStore
from gateway.core.budget import predicted_cost
from gateway.estimators.bundle import Estimators
from gateway.estimators.crossfit import EstimatorCandidate, Pricing, model_prices
from gateway.estimators.manifest import MANIFEST, read_manifest, sha256_of, write_manifest
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
from gateway.serving.workers import FOLLOW_EVERY_S, SINGLE, Worker

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
    fingerprint: list  # [quality labels, length labels, newest label's time]: unchanged means nothing to refit


class EstimatorRefresh:
    def __init__(self, scheduler: Scheduler, learner: TrafficLearner, store: ConfigStore, metrics: GatewayMetrics,
                 worker: Worker = SINGLE):
        self.scheduler = scheduler
        self.learner = learner
        self.store = store
        self.metrics = metrics
        self.worker = worker
        self._running = asyncio.Lock()
        self._manifest_seen: float | None = None  # the manifest's mtime when `follow` last read it

    @contextlib.contextmanager
    def _host_lock(self, current: Estimators):
        """With `serve --workers`: one refresh or rollback at a time on the host (a lock file beside the
        artefacts), so two workers never write the same next version."""
        if not self.worker.shared or current.models_dir is None:
            yield
            return
        try:
            handle = open(current.models_dir / ".refresh.lock", "a")  # noqa: SIM115 (held across the yield)
        except OSError as e:
            log.warning("no host-wide refresh lock (%s): refreshing without it", e)
            yield
            return
        with handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ApiError(409, "a refresh or rollback is running in another worker of this gateway: try "
                                    "again when it is done", None, "refresh_running") from None
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _ready(self) -> Estimators:
        estimators = self.scheduler.estimators
        if estimators is None:
            raise ApiError(409, "this gateway routes without estimators (its policy needs none): nothing to refresh",
                           None, "no_estimators")
        return estimators

    async def refresh(self, reason: str) -> dict:
        """Refit, check, and swap in when accepted; the outcome as JSON-able figures."""
        label_store = self.learner.store
        if label_store is None:
            raise ApiError(503, f"no labels to refresh from: {self.learner.unavailable}", None, "learning_off")
        if self._running.locked():
            raise ApiError(409, "a refresh or rollback is running: try again when it is done", None,
                           "refresh_running")
        async with self._running:
            with self._host_lock(self._ready()):
                await self._follow()  # another worker's version first: what this one builds on
                await self.learner.flush()  # the lengths of the answers served so far, still being gathered
                return await self._refresh(reason, label_store)

    async def _refresh(self, reason: str, label_store) -> dict:
        current = self._ready()  # read under the lock: a rollback that ran first is what this builds on
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
            result = "unchanged" if outcome.get("unchanged") else "refused"
            self.metrics.refreshes.labels(result).inc()
            log.log(logging.INFO if result == "unchanged" else logging.WARNING, "refresh (%s) %s: %s", reason,
                    result, outcome["reason"])
            return outcome
        self._swap(fresh)
        self.metrics.refreshes.labels("accepted").inc()
        log.info("refresh (%s): estimators version %d in %.1f s (traffic labels: %s)", reason, fresh.version,
                 outcome["seconds"], ", ".join(f"{m}: {n}" for m, n in outcome["traffic"].items()))
        return outcome

    async def rollback(self) -> dict:
        """Back to the version before the running one (as recorded in the manifest)."""
        async with self._running:
            with self._host_lock(self._ready()):
                await self._follow()  # another worker's version first: what is rolled back
                current = self._ready()  # read under the lock: a refresh that ran first is what is rolled back
                history = current.manifest.get("versions", [])
                older = [v for v in history if v["version"] < current.version]
                if not older:
                    raise ApiError(409, f"estimators version {current.version} has no earlier version to roll back "
                                        "to", None, "no_earlier_version")
                target = older[-1]
                fresh = await asyncio.to_thread(self._load_version, current, target)
                self._swap(fresh)
                log.info("rolled back: estimators version %d -> %d", current.version, fresh.version)
                return {"version": fresh.version, "rolled_back_from": current.version}

    def _swap(self, fresh: Estimators) -> None:
        self.scheduler.estimators = fresh
        self.metrics.estimator_version.set(fresh.version)

    async def follow_every(self) -> None:
        """With `serve --workers`: take the version another worker's refresh or rollback made."""
        while True:
            await asyncio.sleep(FOLLOW_EVERY_S)
            if self._running.locked():
                continue  # this worker is refreshing: it follows first itself
            async with self._running:
                try:
                    await self._follow()
                except (ArtefactError, OSError, ValueError, KeyError) as e:
                    log.warning("cannot take the estimators version in the manifest: %s", e)

    async def _follow(self) -> None:
        """Swap in the version the manifest names, when another worker made it (the same build only: a
        rebuild takes a restart, as with a single gateway)."""
        current = self.scheduler.estimators
        if not self.worker.shared or current is None or current.models_dir is None:
            return
        try:
            seen = (current.models_dir / MANIFEST).stat().st_mtime
        except OSError:
            return
        if seen == self._manifest_seen:
            return
        self._manifest_seen = seen
        manifest = _read_quietly(current.models_dir)
        if manifest is None or manifest.get("built_at") != current.manifest.get("built_at"):
            return
        version = int(manifest.get("version", 1))
        target = _entry(manifest, version) or (_first_version(manifest) if version == 1 else None)
        if version == current.version or target is None:
            return
        fresh = await asyncio.to_thread(self._version_from, current, manifest, target)
        self._swap(fresh)
        log.info("estimators version %d -> %d (made by another worker)", current.version, fresh.version)

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
        running = _entry(current.manifest, current.version)
        traffic = traffic_set(cfg, current, labels(), unless=running.get("labels_seen") if running else None)
        if traffic is None:
            return {"accepted": False, "unchanged": True, "version": current.version,
                    "reason": f"no labels since version {current.version} was fitted"}, None
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
        fresh, persisted = self._versioned(current, result, traffic.fingerprint, cfg.learning.max_versions)
        outcome.update(version=fresh.version, persisted=persisted)
        return outcome, fresh

    def _versioned(self, current: Estimators, result: Refit, fingerprint: list, max_versions: int
                   ) -> tuple[Estimators, bool]:
        """The refit as the next version, written beside the artefacts when the directory allows. Old refits'
        files are deleted only once the manifest that no longer lists them is written."""
        directory = current.models_dir
        base = current.manifest
        on_disk = _read_quietly(directory) if directory is not None else None
        if on_disk is not None and on_disk.get("built_at") == base.get("built_at"):
            base = on_disk  # the same build, with whatever `train --if-stale` added meanwhile (a TPOT head)
        manifest = {**base, "files": dict(base["files"])}
        history = list(manifest.get("versions") or [_first_version(manifest)])
        version = max(max(v["version"] for v in history), current.version) + 1
        entry = {"version": version, "file": f"refresh-v{version}.npz",
                 "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "traffic": result.traffic,
                 "labels_seen": fingerprint, "check": [result.check_built, result.check_refit]}
        manifest.update(version=version, refreshed={"file": entry["file"]})
        history.append(entry)
        kept, gone = _pruned(history, max_versions)
        manifest["versions"] = kept
        for old in gone:
            manifest["files"].pop(old["file"], None)
        fresh = current.refreshed(result.fit, manifest, result.traffic)
        if directory is None or on_disk is None or base is not on_disk:
            if directory is not None:
                log.warning("the refit serves in memory only: the artefacts in %s were rebuilt since this gateway "
                            "loaded them (restart it to serve them)", directory)
            return fresh, False
        try:
            save_traffic_fit(directory / entry["file"], result.fit)
            manifest["files"][entry["file"]] = sha256_of(directory / entry["file"])
            write_manifest(directory, manifest)
        except OSError as e:
            log.warning("the refit serves in memory only: cannot write it to %s (%s); it is lost at a restart",
                        directory, e)
            return fresh, False
        for old in gone:  # no manifest lists them now
            (directory / old["file"]).unlink(missing_ok=True)
        return fresh, True

    def _load_version(self, current: Estimators, target: dict) -> Estimators:
        """The earlier version `target` (a rollback), recorded in the manifest as the running one."""
        manifest = {**current.manifest, "version": target["version"]}
        fresh = self._version_from(current, manifest, target)
        if current.models_dir is not None:
            try:
                write_manifest(current.models_dir, fresh.manifest)
            except OSError as e:
                log.warning("rolled back in memory only: cannot write %s (%s)", current.models_dir, e)
        return fresh

    @staticmethod
    def _version_from(current: Estimators, manifest: dict, target: dict) -> Estimators:
        """The built estimators with `target`'s refit on top (none: the built version), under `manifest`."""
        manifest = {**manifest, "version": target["version"]}
        fit = None
        if target.get("file"):
            if current.models_dir is None:
                raise ApiError(409, "the earlier version was never written to disk", None, "no_earlier_version")
            fit = load_traffic_fit(current.models_dir / target["file"])
            manifest["refreshed"] = {"file": target["file"]}
        else:
            manifest.pop("refreshed", None)
        return current.refreshed(fit, manifest, {m: (int(n), float(s)) for m, (n, s) in
                                                 (target.get("traffic") or {}).items()})


def candidate(spec: dict) -> EstimatorCandidate:
    return EstimatorCandidate(spec["name"], spec["kind"], dict(spec["params"]))


def _first_version(manifest: dict) -> dict:
    """The built estimators as version 1 of the history (nothing on top)."""
    return {"version": int(manifest.get("version", 1)), "file": None, "at": manifest.get("built_at"),
            "traffic": None, "check": None}


def _pruned(history: list[dict], keep: int) -> tuple[list[dict], list[dict]]:
    """(the history with at most `keep` refits, the refits left out); the built version, the first, stays."""
    first, refits = history[:1], history[1:]
    gone = refits[:-keep] if len(refits) > keep else []
    return first + refits[len(gone):], gone


def _entry(manifest: dict, version: int) -> dict | None:
    return next((v for v in manifest.get("versions", []) if v["version"] == version), None)


def _read_quietly(directory: Path) -> dict | None:
    try:
        return read_manifest(directory)
    except ArtefactError as e:
        log.warning("cannot read %s: %s", directory, e)
        return None


def base_of(estimators: Estimators, cfg: Config) -> Base:
    """The built index's labelled rows, priced at the config's prices; the check routes among the models the
    pool serves only (a model the pool lacks has no price)."""
    knn = estimators.knn
    x = knn.index.reconstruct_n(0, knn.index.ntotal)
    cols, price_in, price_out = model_prices(cfg.instances, knn.models)
    input_len = knn.input_tokens.astype(np.float64)
    cost = predicted_cost(input_len[:, None], knn.length.astype(np.float64), price_in, price_out)
    return Base(x, knn.quality, knn.length, knn.prompt_hashes, Pricing(price_in, price_out, input_len, cost),
                tuple(cols) if len(cols) < len(knn.models) else None)


def traffic_set(cfg: Config, estimators: Estimators, labels: Iterable[Label],
                unless: list | None = None) -> TrafficSet | None:
    """The store's labels for the pool's models, their prompts embedded (once each; the most recent
    refresh_max_prompts prompts at most, so a refresh's embedding stays bounded however large the store).
    Labels without their prompt's text (kept as hashes) cannot be embedded; sources weighted 0 and models the
    pool lacks are left out: each counted. None, before any embedding, when the labels' fingerprint is
    `unless` (nothing new since the running version)."""
    pool = cfg.models()
    models = estimators.knn.models + tuple(m for m in pool if m not in estimators.knn.models)
    column = {m: j for j, m in enumerate(models)}
    weights = cfg.learning.source_weights
    skipped: dict[str, int] = {}
    rows: list[tuple[str, int, float, float, bool, bool]] = []  # (prompt, column, value, weight, censored, length)
    texts: dict[str, str] = {}
    newest: dict[str, float] = {}
    for label in labels:
        why = _left_out(label, column, weights, texts)
        if why is not None:
            skipped[why] = skipped.get(why, 0) + 1
            continue
        if label.prompt is not None:
            texts.setdefault(label.prompt_hash, label.prompt)
        newest[label.prompt_hash] = max(newest.get(label.prompt_hash, 0.0), label.created)
        is_length = label.source == LENGTH
        rows.append((label.prompt_hash, column[label.model], label.value,
                     1.0 if is_length else weights[label.source], label.censored, is_length))
    quality_rows = sum(not r[5] for r in rows)
    fingerprint = [quality_rows, len(rows) - quality_rows, max(newest.values(), default=0.0)]
    if fingerprint == unless:
        return None
    cap = cfg.learning.refresh_max_prompts
    if len(texts) > cap:
        kept = set(sorted(texts, key=lambda h: newest[h], reverse=True)[:cap])
        dropped = [r for r in rows if r[0] not in kept]
        skipped[f"older than the {cap} most recent prompts"] = len(dropped)
        rows = [r for r in rows if r[0] in kept]
        texts = {h: t for h, t in texts.items() if h in kept}
    order = list(texts)
    d = estimators.knn.index.d
    vectors = estimators.embedder.embed([texts[h] for h in order]) if order else np.zeros((0, d), np.float32)
    row_of = {h: k for k, h in enumerate(order)}

    def labels_of(mine: list) -> TrafficLabels:
        if not mine:
            return TrafficLabels.empty(d)
        hashes = np.array([r[0] for r in mine], dtype=object)
        return TrafficLabels(vectors[[row_of[h] for h in hashes]], np.array([r[1] for r in mine]),
                             np.array([r[2] for r in mine], dtype=np.float64),
                             np.array([r[3] for r in mine], dtype=np.float64), np.array([r[4] for r in mine], bool),
                             hashes)

    quality, length = [r for r in rows if not r[5]], [r for r in rows if r[5]]
    return TrafficSet(models, labels_of(quality), labels_of(length), skipped, fingerprint)


def _left_out(label: Label, column: dict, weights, texts: dict) -> str | None:
    """Why a label cannot be folded in (None: it can)."""
    if label.model not in column:
        return "model not in the pool"
    if label.prompt is None and label.prompt_hash not in texts:
        return "no prompt text (kept as a hash only)"
    if label.source != LENGTH and not weights.get(label.source):
        return f"source {label.source} weighted 0"
    return None
