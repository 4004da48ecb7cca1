"""Real instances need no emulator fields: a missing or foreign /metrics is a clear, rate-limited
warning (not a crash), and config changes that leave the workload and the estimators alone
rebuild nothing (a new tier fits its own head, a GPU of unknown size is priced with its prior)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import json
import logging
import shutil
import tomllib
from types import SimpleNamespace

import numpy as np
import pytest
from aiohttp import ClientSession, web

from conftest import RECORDS, dump_toml, free_port
from gateway.config.sections import Config
from gateway.config.store import default_config_path, load_config
from gateway.core.pool_state import PoolState
from gateway.estimators.bundle import Estimators
from gateway.estimators.latency import FEATURES
from gateway.estimators.manifest import MANIFEST
from gateway.lab.training import build
from gateway.lab.training.build import ensure_built
from gateway.lab.training.traces import virtual_sweep, write_traces
from gateway.serving.telemetry import MetricsPageError, ScrapeLog, diagnose, scrape_forever

VLLM_PAGE = '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="m"} 2\n'
# What llama.cpp's server shows with --metrics: Prometheus text, but none of vLLM's names.
LLAMACPP_PAGE = "# TYPE llamacpp:prompt_tokens_total counter\nllamacpp:prompt_tokens_total 10\n"


# ---- /metrics that is missing, foreign, refused or slow ------------------------------------------

class MetricsServer:
    """A real HTTP server on loopback whose /metrics answers what the test sets, counting requests."""

    def __init__(self, status: int = 200, body: str = VLLM_PAGE, delay_s: float = 0.0):
        self.status, self.body, self.delay_s = status, body, delay_s
        self.hits = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._runner: web.AppRunner | None = None

    async def _metrics(self, _request: web.Request) -> web.Response:
        self.hits += 1
        await asyncio.sleep(self.delay_s)
        return web.Response(status=self.status, text=self.body)

    async def __aenter__(self) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        return self

    async def __aexit__(self, *exc) -> None:
        await self._runner.cleanup()


def pool_of(*urls: str):
    """The default config cut to one instance per url, scraped every 50 ms with a 0.3 s timeout."""
    cfg = load_config(default_config_path())
    first = cfg.instances[0]
    instances = tuple(dataclasses.replace(first, name=f"inst{i}", url=url) for i, url in enumerate(urls))
    fast = dataclasses.replace(cfg.telemetry, scrape_interval_s=0.05, scrape_timeout_s=0.3, stale_after_s=1.0)
    return dataclasses.replace(cfg, instances=instances, telemetry=fast)


@contextlib.asynccontextmanager
async def scraping(cfg):
    """scrape_forever over `cfg` while the block runs; yields the pool_state it fills."""
    pool_state = PoolState()
    async with ClientSession() as session:
        task = asyncio.create_task(scrape_forever(session, SimpleNamespace(current=cfg), pool_state))
        try:
            yield pool_state
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            assert task.cancelled(), "scrape_forever stopped by itself"


def telemetry_records(caplog, level: int) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "routebalance.telemetry" and r.levelno == level]


async def test_a_missing_metrics_page_is_one_clear_warning_and_is_asked_for_less_often(caplog):
    caplog.set_level(logging.INFO, "routebalance.telemetry")
    async with MetricsServer(status=404) as server:
        async with scraping(pool_of(server.url)):
            await asyncio.sleep(0.6)  # about a dozen scrape intervals
    [warning] = telemetry_records(caplog, logging.WARNING)
    assert "instance inst0" in warning and "answered 404" in warning
    assert "dead reckoning" in warning
    assert server.hits == 1  # the page will not appear by itself: asked again only after MISSING_PAGE_RETRY_S


async def test_a_page_that_is_not_vllms_is_named_for_what_it_is(caplog):
    caplog.set_level(logging.INFO, "routebalance.telemetry")
    async with MetricsServer(body="<html><body>It works!</body></html>") as html, \
               MetricsServer(body=LLAMACPP_PAGE) as llamacpp, \
               MetricsServer(body="vllm:num_requests_running{engine= garbage\n") as broken:
        async with scraping(pool_of(html.url, llamacpp.url, broken.url)):
            await asyncio.sleep(0.4)
    warnings = sorted(telemetry_records(caplog, logging.WARNING))
    assert len(warnings) == 3
    for name, warning in zip(("inst0", "inst1", "inst2"), warnings, strict=True):
        assert f"instance {name}" in warning and "not a vLLM metrics page" in warning and "dead reckoning" in warning
    assert "no vllm:num_requests_running" in warnings[0] and "no vllm:num_requests_running" in warnings[1]
    assert "not Prometheus text" in warnings[2]
    assert html.hits == llamacpp.hits == broken.hits == 1  # not vLLM's: asked again only after a while


async def test_refused_and_slow_instances_are_told_apart(caplog):
    caplog.set_level(logging.INFO, "routebalance.telemetry")
    nobody = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    async with MetricsServer(delay_s=1.0) as slow:
        async with scraping(pool_of(nobody, slow.url)):
            await asyncio.sleep(0.8)
    refused, timed_out = sorted(telemetry_records(caplog, logging.WARNING))
    assert "instance inst0" in refused and "refused the connection" in refused
    assert "instance inst1" in timed_out and "did not answer within 0.3 s" in timed_out


async def test_scraping_that_recovers_says_so_and_reads_the_instance_again(caplog):
    caplog.set_level(logging.INFO, "routebalance.telemetry")
    async with MetricsServer(status=503) as server:
        async with scraping(pool_of(server.url)) as pool_state:
            await asyncio.sleep(0.3)
            assert pool_state.of("inst0").last is None
            server.status = 200
            await asyncio.sleep(0.3)
            assert pool_state.of("inst0").last.running == 2
    [warning] = telemetry_records(caplog, logging.WARNING)
    assert "answered HTTP 503" in warning
    [recovered] = telemetry_records(caplog, logging.INFO)
    assert "instance inst0" in recovered and "readable again" in recovered


def test_a_lasting_problem_is_warned_again_only_every_repeat_interval(caplog):
    caplog.set_level(logging.INFO, "routebalance.telemetry")
    inst = SimpleNamespace(name="llama", url="http://127.0.0.1:1")
    missing = diagnose(MetricsPageError(404), inst.url, 1.0)
    failing = diagnose(MetricsPageError(500), inst.url, 1.0)
    scrape_log = ScrapeLog()
    for second in range(0, 1200, 30):  # 20 minutes of scrapes, each as soon as it is due
        assert scrape_log.due(inst, second)
        scrape_log.failed(inst, missing, second)
        assert not scrape_log.due(inst, second + 1)  # a missing page is asked for every 30 s only
    warnings = telemetry_records(caplog, logging.WARNING)
    assert len(warnings) == 2 and "still no metrics after 10 min" in warnings[1]
    scrape_log.failed(inst, failing, 1200)  # another problem is news at once
    assert len(telemetry_records(caplog, logging.WARNING)) == 3
    scrape_log.succeeded(inst, 1300)
    [recovered] = telemetry_records(caplog, logging.INFO)
    assert "after 1300.0 s" in recovered
    assert scrape_log.due(inst, 1300)


# ---- estimators rebuild only when they must ----------------------------------------------------

def config_data(models_dir) -> dict:
    """The default config as TOML data, pointed at `models_dir` with the suite's small training set."""
    data = tomllib.loads(default_config_path().read_text())
    data["estimators"].update(models_dir=str(models_dir), train_records=RECORDS)
    return data


def edited(tmp_path, data: dict, edit) -> Config:
    """The config a user gets by editing config.toml: `edit` changes a copy of `data` in place."""
    data = copy.deepcopy(data)
    edit(data)
    path = tmp_path / "edited.toml"
    path.write_text(dump_toml(data))
    return load_config(path)


@pytest.fixture
def own_build(built, tmp_path):
    """A private copy of the suite's build (tests here may add heads to it), and its config data."""
    models_dir = tmp_path / "models"
    shutil.copytree(built[0].estimators.models_dir, models_dir, ignore=shutil.ignore_patterns("sim"))
    return models_dir, config_data(models_dir)


@pytest.fixture
def fits(monkeypatch):
    """Records the tiers whose heads get fitted; a full build (`train`) fails the test."""
    fitted: list[str] = []
    real_fit = build.fit_tier_head

    def fit(tier, *args):
        fitted.append(tier.key)
        return real_fit(tier, *args)

    def full_build(*_args, **_kw):
        raise AssertionError("the embedder and the KNN index were rebuilt")

    monkeypatch.setattr(build, "fit_tier_head", fit)
    monkeypatch.setattr(build, "train", full_build)
    return fitted


def add_3b_instance(d: dict, **changes) -> None:
    """Append a copy of the config's last (3B) instance with `changes`, its memory read from its gpu name."""
    last = {k: v for k, v in d["instances"][-1].items() if k != "gpu_memory_gb"}
    d["instances"].append({**last, "url": "http://127.0.0.1:1", **changes})


def _prices(d):
    for inst in d["instances"]:
        inst["price_input_per_mtok"] *= 2
        inst["price_output_per_mtok"] *= 3


def _addresses_and_names(d):
    for i, inst in enumerate(d["instances"]):
        inst.update(url=f"http://10.1.0.{i}:8000", name=f"renamed-{i}")
    d["server"]["port"] = 9001


def _engine_settings(d):
    for inst in d["instances"]:
        inst.update(max_num_seqs=8, max_model_len=4096, gpu_memory_utilization=0.8)


def _one_more_of_a_known_tier(d):
    add_3b_instance(d, name="one-more")


def _without_the_72b_tier(d):
    d["instances"] = [i for i in d["instances"] if "72B" not in i["model"]]


def _serving_and_runtime_settings(d):
    d["batching"]["mode"] = "window"
    d["scheduler"]["preset"] = "cost"
    d["estimators"].update(threads=1, batch_size=4)  # how estimates run, not what they were built from


@pytest.mark.parametrize("edit", [_prices, _addresses_and_names, _engine_settings, _one_more_of_a_known_tier,
                                  _without_the_72b_tier, _serving_and_runtime_settings])
def test_a_config_change_outside_workload_and_estimators_rebuilds_nothing(own_build, fits, tmp_path, edit):
    models_dir, data = own_build
    manifest = models_dir / MANIFEST
    before = (manifest.read_bytes(), manifest.stat().st_mtime_ns)
    ensure_built(edited(tmp_path, data, edit))
    assert fits == []
    assert (manifest.read_bytes(), manifest.stat().st_mtime_ns) == before


def test_a_new_tier_fits_its_own_head_and_nothing_else(own_build, fits, tmp_path):
    models_dir, data = own_build
    knn_files = {name: (models_dir / name).stat().st_mtime_ns for name in ("minilm.onnx", "knn.faiss")}
    h100 = edited(tmp_path, data, lambda d: add_3b_instance(d, name="3b-h100", gpu="H100-80GB"))
    manifest = ensure_built(h100)
    new_tier = "Qwen/Qwen2.5-3B-Instruct@H100-80GB"
    assert fits == [new_tier]
    assert {name: (models_dir / name).stat().st_mtime_ns for name in knn_files} == knn_files
    assert len(manifest["heads"]) == 5 and manifest["report"]["heads"][new_tier]["head_mae_ms"] > 0
    heads = Estimators.load(h100).heads
    assert np.isfinite(heads.tpot(new_tier, np.zeros((2, len(FEATURES)), np.float32))).all()
    # Built once: the same pool, and the pool without the new tier, fit nothing more.
    ensure_built(h100)
    ensure_built(edited(tmp_path, data, lambda d: None))
    assert fits == [new_tier]


def test_a_changed_prior_refits_that_tiers_head_alone(own_build, fits, tmp_path):
    _, data = own_build

    def slower_3b(d):
        for inst in d["instances"]:
            if "3B" in inst["model"]:
                inst["tpot_prior_ms"] *= 1.5

    ensure_built(edited(tmp_path, data, slower_3b))
    assert len(fits) == 1 and fits[0].startswith("Qwen/Qwen2.5-3B-Instruct@")


def test_a_head_fitted_otherwise_is_refitted_alone(own_build, fits, tmp_path):
    models_dir, data = own_build
    path = models_dir / MANIFEST
    manifest = json.loads(path.read_text())
    tier = next(t for t in manifest["heads"] if "3B" in t)
    manifest["heads"][tier]["fit"]["params"].pop("monotone_constraints")  # as fitted before the heads were constrained
    path.write_text(json.dumps(manifest))
    assert ensure_built(edited(tmp_path, data, lambda d: None))["heads"][tier]["fit"] == build.TierInputs(
        tier, 0, None).fit()
    assert fits == [tier]


def test_a_gpu_of_unknown_size_gets_no_head_and_is_priced_with_its_prior(own_build, fits, tmp_path, caplog):
    caplog.set_level(logging.INFO, "routebalance.train")
    _, data = own_build
    cpu = edited(tmp_path, data, lambda d: add_3b_instance(d, name="llama-cpu", gpu="CPU"))
    assert cpu.instance("llama-cpu").gpu_memory_gb is None
    ensure_built(cpu)  # the engine model cannot sweep it: no build, and no crash
    assert fits == []
    cpu_tier = "Qwen/Qwen2.5-3B-Instruct@CPU"
    assert any(cpu_tier in r.getMessage() and "tpot_prior_ms" in r.getMessage() for r in caplog.records)
    # No head and no prior in the build: the scheduler takes the tier's configured prior (assign._fill_unknown).
    heads = Estimators.load(cpu).heads
    assert np.isnan(heads.tpot(cpu_tier, np.zeros((2, len(FEATURES)), np.float32))).all()


def test_a_profiled_head_is_kept_when_the_gateway_starts_without_the_traces(own_build, fits, tmp_path):
    models_dir, data = own_build
    cfg = edited(tmp_path, data, lambda d: None)
    inst = cfg.instances[-1]
    tier = f"{inst.model}@{inst.gpu}"
    traces = tmp_path / "traces.jsonl"
    write_traces(virtual_sweep(inst, [(60, 120), (200, 40)], requests_per_rate=40, seed=3), traces)
    manifest = ensure_built(cfg, trace_files=[traces])  # `routebalance train --if-stale --traces ...`
    assert fits == [tier] and manifest["report"]["heads"][tier]["source"] == "profiled"
    assert ensure_built(cfg)["heads"][tier]["traces_sha256"]  # `serve`: the measured head stays
    assert fits == [tier]


def test_workload_or_estimator_settings_rebuild_everything(own_build, tmp_path, monkeypatch):
    _, data = own_build
    full_builds = []
    monkeypatch.setattr(build, "train", lambda config, *_a, **_kw: full_builds.append(config.estimators))
    for edit in (lambda d: d["estimators"].update(train_records=RECORDS + 1),
                 lambda d: d["estimators"].update(seed=1),
                 lambda d: d["estimators"].update(max_tokens=128)):
        ensure_built(edited(tmp_path, data, edit))
    assert len(full_builds) == 3
