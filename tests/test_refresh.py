"""Refreshing the estimators without a restart, through the real gateway and the emulated pool, with the
openai SDK as the client: feedback and a refresh change later picks, the answer says which version routed
it, a rollback returns to the version before, a refresh survives a restart, and a refit that would route
worse (poisoned feedback) is refused."""

from __future__ import annotations

import asyncio
import shutil
import tomllib
from types import SimpleNamespace

import httpx
import openai
import pytest

from conftest import ADMIN, RECORDS, Stack, dump_toml, pool_config
from gateway.cli import main
from gateway.config.store import load_config
from gateway.estimators.bundle import Estimators
from gateway.estimators.manifest import read_manifest
from gateway.lab.workload.synthetic import generate
from gateway.records import split
from gateway.serving.metrics import GatewayMetrics
from gateway.serving.refresh import EstimatorRefresh
from gateway.serving.workers import Worker

NEW = "acme/Qwen2.5-3B-new"  # a pool model the built labels do not know (the 3B tier, renamed)
SMALL, BIG = "Qwen/Qwen2.5-3B-Instruct", "Qwen/Qwen2.5-72B-Instruct"


def start(tmp_path, built, rename_small: bool, **learning) -> Stack:
    models = tmp_path / "models"
    shutil.copytree(built[0].estimators.models_dir, models)  # a refresh writes there: not the shared build's
    path = pool_config(tmp_path, str(models), server={"admin_token": "test-admin-token"},
                       learning={"path": str(tmp_path / "labels.db"), "min_labels": 10, **learning},
                       scheduler={"preset": "quality"})
    if rename_small:
        data = tomllib.loads(path.read_text())
        for inst in data["instances"]:
            if inst["model"] == SMALL:
                inst["model"] = NEW
        path.write_text(dump_toml(data))
    stack = Stack(path)
    stack.wait_routable()
    return stack


def ask(client: openai.OpenAI, prompt: str, model: str = "auto"):
    """(answering model, X-Route-Estimator header, completion id) of one short chat completion."""
    raw = client.chat.completions.with_raw_response.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=4)
    answer = raw.parse()
    return answer.model, raw.headers.get("x-route-estimator"), answer.id


def rate(client: openai.OpenAI, completion_id: str, score: float) -> None:
    assert client.post("/feedback", body={"id": completion_id, "score": score}, cast_to=object)["accepted"]


def share(client: openai.OpenAI, model: str, prompts: list[str]) -> tuple[float, set]:
    picks = [ask(client, p) for p in prompts]
    return sum(m == model for m, _, _ in picks) / len(picks), {v for _, v, _ in picks}


def follower(cfg) -> EstimatorRefresh:
    """What another worker of the host holds of the refresh: its estimators (as loaded now) and their refresher."""
    scheduler = SimpleNamespace(estimators=Estimators.load(cfg))
    return EstimatorRefresh(scheduler, None, None, GatewayMetrics(), Worker(1, 2))  # type: ignore[arg-type]


PROBES = [f"Explain step {k} of brewing tea, briefly." for k in range(16)]


def test_feedback_and_a_refresh_change_later_picks_and_a_rollback_undoes_it(tmp_path, built, capsys):
    stack = start(tmp_path, built, rename_small=True)
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=30)
        before, versions = share(client, NEW, PROBES)
        assert versions == {"v1"}
        # A second worker of the same host (`serve --workers 2`), loaded before the refresh: it follows.
        other = follower(load_config(stack.config_path))
        assert other.scheduler.estimators.version == 1
        # Clients rate the new model's answers as right, every time: 30 labels of a model no build labelled.
        for k in range(30):
            _, _, cid = ask(client, f"Explain part {k} of making coffee, briefly.", model=NEW)
            rate(client, cid, 1.0)
        out = httpx.post(stack.root + "/admin/refresh", headers=ADMIN, timeout=120).json()
        assert out["accepted"] and out["version"] == 2 and out["persisted"], out
        assert NEW in out["headed"] and out["traffic"][NEW] == 30
        # nothing new since v2: no new version that would push useful ones out
        again = httpx.post(stack.root + "/admin/refresh", headers=ADMIN, timeout=120).json()
        assert again["accepted"] is False and again["unchanged"] and again["version"] == 2, again
        after, versions = share(client, NEW, PROBES)
        assert versions == {"v2"}
        assert before <= 0.3 and after >= 0.8
        manifest = read_manifest(tmp_path / "models")
        assert manifest["version"] == 2 and [v["version"] for v in manifest["versions"]] == [1, 2]
        # what a restart loads: the refreshed version, from disk
        assert Estimators.load(load_config(stack.config_path)).version == 2
        metrics = httpx.get(stack.root + "/metrics").text
        assert 'routebalance_estimator_refreshes_total{result="accepted"} 1.0' in metrics
        assert 'routebalance_estimator_refreshes_total{result="unchanged"} 1.0' in metrics
        assert "routebalance_estimator_version 2.0" in metrics
        asyncio.run(other._follow())
        assert other.scheduler.estimators.version == 2
        assert other.scheduler.estimators.manifest["refreshed"] == manifest["refreshed"]

        assert main(["refresh", "--rollback", "--config", str(stack.config_path)]) == 0  # one command
        assert '"rolled_back_from": 2' in capsys.readouterr().out
        again, versions = share(client, NEW, PROBES)
        assert versions == {"v1"} and again == pytest.approx(before, abs=0.2)
        assert read_manifest(tmp_path / "models")["version"] == 1
        asyncio.run(other._follow())  # the rollback reaches the other worker too
        assert other.scheduler.estimators.version == 1 and "refreshed" not in other.scheduler.estimators.manifest
        refused = httpx.post(stack.root + "/admin/rollback", headers=ADMIN, timeout=30)
        assert refused.status_code == 409 and "no earlier version" in refused.json()["error"]["message"]
    finally:
        stack.stop()


def test_a_refit_that_routes_worse_is_refused(tmp_path, built):
    """Feedback on prompts of the build that calls the 3B always right and the 72B always wrong, weighted far above
    the built labels: the refit routes the built prompts worse out of fold, so it is refused (tolerance 0 here)
    and v1 keeps routing."""
    stack = start(tmp_path, built, rename_small=False, refresh_tolerance=0.0, source_weights={"feedback": 200.0})
    try:
        client = openai.OpenAI(base_url=stack.base_url, api_key="none", max_retries=0, timeout=30)
        prompts = [r.prompt for r in split(generate(RECORDS))[0][:60:2]]  # prompts the index was built from
        for prompt in prompts:
            for model, score in ((SMALL, 1.0), (BIG, 0.0)):
                rate(client, ask(client, prompt, model=model)[2], score)
        out = httpx.post(stack.root + "/admin/refresh", headers=ADMIN, timeout=120).json()
        assert out["accepted"] is False and "routes worse out of fold" in out["reason"], out
        assert out["check"]["refit"] < out["check"]["built"]
        assert read_manifest(tmp_path / "models")["version"] == 1
        assert ask(client, PROBES[0])[1] == "v1"
        assert 'routebalance_estimator_refreshes_total{result="refused"} 1.0' in httpx.get(stack.root + "/metrics").text
    finally:
        stack.stop()


def test_refresh_needs_the_admin_token(stack):
    assert httpx.post(stack.root + "/admin/refresh", timeout=10).status_code == 401
