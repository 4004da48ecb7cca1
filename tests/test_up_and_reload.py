"""`routebalance up` as a user runs it: one command, live config reload, clean Ctrl-C."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import openai
import pytest

from conftest import ADMIN, ADMIN_TOKEN, dump_toml, pool_config, wait_for


def with_aliases(text: str, aliases) -> str:
    """The config text with [server] aliases set to `aliases` (a list, or anything else to make it invalid)."""
    data = tomllib.loads(text)
    data["server"]["aliases"] = aliases
    return dump_toml(data)


def model_ids(root: str) -> set[str]:
    return {m["id"] for m in httpx.get(root + "/v1/models", timeout=5).json()["data"]}


def command() -> list[str]:
    exe = shutil.which("routebalance", path=str(Path(sys.executable).parent)) or shutil.which("routebalance")
    return [exe] if exe else [sys.executable, "-m", "gateway.cli"]


@pytest.fixture
def up(tmp_path, request):
    path = pool_config(tmp_path, server={"config_watch_interval_s": request.param, "admin_token": ADMIN_TOKEN})
    proc = subprocess.Popen([*command(), "up", "--config", str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    text = path.read_text()
    port = int(text.split("port = ", 1)[1].split("\n", 1)[0])
    root = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx.get(root + "/health", timeout=1).status_code == 200, what="gateway up")
        yield proc, path, root
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


@pytest.mark.parametrize("up", [0.2], indirect=True)
def test_up_serves_and_the_file_watcher_reloads(up):
    proc, path, root = up
    client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=30)
    answer = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert answer.choices[0].message.content

    original = path.read_text()
    # A valid edit is picked up by the watcher...
    path.write_text(with_aliases(original, ["auto", "router"]))
    wait_for(lambda: "router" in model_ids(root), what="watcher reload")
    assert client.chat.completions.create(model="router", messages=[{"role": "user", "content": "x"}], max_tokens=1)

    # ...a bad one is rejected: the running config stays and the failure is counted.
    path.write_text(with_aliases(original, "auto"))
    wait_for(lambda: 'routebalance_config_reloads_total{result="error"} 1.0' in httpx.get(root + "/metrics").text,
             what="rejected reload counted")
    assert "router" in model_ids(root)
    assert client.chat.completions.create(model="router", messages=[{"role": "user", "content": "x"}], max_tokens=1)


@pytest.mark.parametrize("up", [0.0], indirect=True)
def test_sighup_and_admin_reload_then_ctrl_c_stops_cleanly(up):
    proc, path, root = up  # the file watcher is off: only SIGHUP and the endpoint reload
    original = path.read_text()
    path.write_text(with_aliases(original, ["auto", "router"]))
    time.sleep(0.3)
    assert "router" not in model_ids(root)
    proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "router" in model_ids(root), what="SIGHUP reload")

    path.write_text(with_aliases(original, "auto"))
    r = httpx.post(root + "/admin/reload", headers=ADMIN, timeout=5)
    assert r.status_code == 400 and "aliases" in r.json()["error"]["message"]
    assert "router" in model_ids(root)

    path.write_text(original)
    assert httpx.post(root + "/admin/reload", headers=ADMIN, timeout=5).status_code == 200
    assert "router" not in model_ids(root)

    # Ctrl-C stops emulator and gateway, with exit status 0.
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=15)
    assert proc.returncode == 0, out
    with pytest.raises(httpx.ConnectError):
        httpx.get(root + "/health", timeout=2)


def test_admin_reload_endpoint_swaps_config(stack, tmp_path):
    original = stack.config_path.read_text()
    try:
        stack.config_path.write_text(with_aliases(original, ["auto", "any"]))
        r = httpx.post(stack.root + "/admin/reload", headers=ADMIN, timeout=5)
        assert r.status_code == 200 and r.json()["reloaded"] is True
        assert "any" in model_ids(stack.root)
    finally:
        stack.config_path.write_text(original)
        assert httpx.post(stack.root + "/admin/reload", headers=ADMIN, timeout=5).status_code == 200
    assert "any" not in model_ids(stack.root)


def test_serve_refuses_to_start_on_a_bad_config(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[server]\nport = "eight thousand"\n')
    proc = subprocess.run([*command(), "serve", "--config", str(bad)], capture_output=True, text=True, timeout=30,
                          env={**os.environ})
    assert proc.returncode == 2
    assert "server.port" in proc.stderr


def interrupt(proc: subprocess.Popen) -> None:
    """Ctrl-C, as a user stops `up`; killed if it has not gone within 30 s."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def test_up_listens_while_it_builds_and_says_how_far_it_is(tmp_path):
    """A first `up`: the port answers at once (/health 200 "building" with the build's progress,
    /health/ready 503, requests an OpenAI-shaped 503 with Retry-After), and the gateway serves once built."""
    models = tmp_path / "models"
    path = pool_config(tmp_path, str(models), estimators={"train_records": 300})
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    root = f"http://127.0.0.1:{port}"
    log = tmp_path / "up.log"
    with log.open("w") as out:
        proc = subprocess.Popen([*command(), "up", "--config", str(path)], stdout=out, stderr=subprocess.STDOUT,
                                text=True)
    try:
        wait_for(lambda: httpx.get(root + "/health", timeout=1).status_code == 200, timeout=60, what="the port")
        health = httpx.get(root + "/health", timeout=5).json()
        assert health["status"] == "building" and {"phase", "done", "total", "elapsed_s"} <= health.keys(), health
        ready = httpx.get(root + "/health/ready", timeout=5)
        assert ready.status_code == 503 and ready.json()["status"] == "building"
        r = httpx.post(root + "/v1/chat/completions", timeout=5,
                       json={"model": "auto", "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "building" and int(r.headers["Retry-After"]) > 0
        wait_for(lambda: httpx.get(root + "/health", timeout=1).json()["status"] == "ok", timeout=300,
                 what="the build to end and the gateway to take the port")
        client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).choices
        text = log.read_text()
        assert "build: embedding the training prompts" in text and "estimators built in" in text, text[-3000:]
        assert (models / "manifest.json").is_file()
    finally:
        interrupt(proc)


def _free_run(n: int) -> int:
    """The first of `n` consecutive free loopback ports."""
    import socket

    for first in range(20000, 60000, 97):
        socks = []
        try:
            for p in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError(f"no {n} consecutive free ports")


def test_a_port_clash_names_the_instance_and_the_option_that_moves_the_emulator(tmp_path):
    import socket
    import tomllib
    from urllib.parse import urlsplit

    path = pool_config(tmp_path)
    data = tomllib.loads(path.read_text())
    taken = data["instances"][3]
    with socket.socket() as s:
        s.bind(("127.0.0.1", urlsplit(taken["url"]).port))
        s.listen()
        out = subprocess.run([*command(), "emulate", "--config", str(path)], capture_output=True, text=True,
                             timeout=60)
    assert out.returncode == 1
    assert f"emulated instance {taken['name']!r} cannot listen" in out.stderr and "--emulator-port" in out.stderr

    first = _free_run(len(data["instances"]))
    port = int(path.read_text().split("port = ", 1)[1].split("\n", 1)[0])
    proc = subprocess.Popen([*command(), "up", "--config", str(path), "--emulator-port", str(first)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        root = f"http://127.0.0.1:{port}"
        wait_for(lambda: httpx.get(root + "/health/ready", timeout=1).status_code == 200, timeout=60,
                 what="the gateway in front of the moved emulator")
        moved = httpx.get(f"http://127.0.0.1:{first + 3}/v1/models", timeout=5).json()
        assert moved["data"][0]["id"] == taken["model"]  # the fourth instance is on the fourth port
        client = openai.OpenAI(base_url=root + "/v1", api_key="x", max_retries=0, timeout=30)
        assert client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=3).choices
    finally:
        interrupt(proc)
