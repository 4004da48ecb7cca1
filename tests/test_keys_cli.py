"""`routebalance keys add | list`, and `routebalance serve` refusing to listen beyond loopback without keys,
run as a user would: the installed command in a subprocess, on a copy of the default config."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import free_port
from gateway.config.store import default_config_path, load_config
from gateway.tenancy.keys import KeyRing, hash_key
from gateway.tenancy.spend.sqlite import SpendLedger, SqliteSpendStore

ROUTEBALANCE = Path(sys.executable).with_name("routebalance")


def routebalance(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROUTEBALANCE), *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def config(tmp_path) -> Path:
    """A copy of the packaged default config (no keys; its [state] path is relative to tmp_path)."""
    path = tmp_path / "config.toml"
    shutil.copyfile(default_config_path(), path)
    path.chmod(0o640)
    return path


def printed_key(stdout: str) -> str:
    (key,) = re.findall(r"rb-[A-Za-z0-9_-]{40,}", stdout)  # exactly once
    return key


def test_add_prints_the_key_once_and_stores_only_its_hash(config, tmp_path):
    out = routebalance("keys", "add", "team-a", "--config", str(config), "--spend-limit-usd", "2.5",
                       "--period", "month", "--requests-per-minute", "60", "--models", "auto",
                       "--presets", "cost", "uniform", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    key = printed_key(out.stdout)
    assert "only its SHA-256 is stored" in out.stdout and "reload" in out.stdout
    text = config.read_text()
    assert key not in text and hash_key(key) in text
    assert "# added by `routebalance keys add` on " in text
    assert config.stat().st_mode & 0o777 == 0o640
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]

    (entry,) = load_config(config).auth.keys
    assert (entry.name, entry.spend_limit_usd, entry.period, entry.requests_per_minute) == ("team-a", 2.5, "month", 60)
    assert (entry.models, entry.presets) == (("auto",), ("cost", "uniform"))
    assert KeyRing(load_config(config).auth).lookup(key) == entry

    second = routebalance("keys", "add", "team-b", "--config", str(config), cwd=tmp_path)
    assert second.returncode == 0, second.stderr
    other = printed_key(second.stdout)
    assert other != key
    assert [k.name for k in load_config(config).auth.keys] == ["team-a", "team-b"]
    assert load_config(config).auth.keys[1].spend_limit_usd is None  # options not given are left out


def test_a_duplicate_name_is_refused_and_the_file_left_alone(config, tmp_path):
    assert routebalance("keys", "add", "team-a", "--config", str(config), cwd=tmp_path).returncode == 0
    before = config.read_bytes()
    out = routebalance("keys", "add", "team-a", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 2
    assert "already has a key named 'team-a'" in out.stderr
    assert "rb-" not in out.stdout
    assert config.read_bytes() == before


def test_a_key_the_config_would_reject_is_not_written(config, tmp_path):
    before = config.read_bytes()
    out = routebalance("keys", "add", "team-a", "--config", str(config), "--models", "no-such-model", cwd=tmp_path)
    assert out.returncode == 2
    assert "auth.keys[0].models[0]" in out.stderr
    out = routebalance("keys", "add", "team-a", "--config", str(config), "--spend-limit-usd", "inf", cwd=tmp_path)
    assert out.returncode == 2 and "finite" in out.stderr
    assert config.read_bytes() == before


def test_the_packaged_default_config_is_never_edited(tmp_path):
    before = default_config_path().read_bytes()
    for args in ((), ("--config", str(default_config_path()))):
        out = routebalance("keys", "add", "team-a", *args, cwd=tmp_path)
        assert out.returncode == 2
        assert "packaged default" in out.stderr and "cp " in out.stderr and "--config" in out.stderr
    assert default_config_path().read_bytes() == before


def test_list_shows_each_key_with_its_spend_this_period(config, tmp_path):
    for name, limit in (("team-a", "1.5"), ("team-b", None)):
        extra = ("--spend-limit-usd", limit, "--period", "day") if limit else ()
        assert routebalance("keys", "add", name, "--config", str(config), *extra, cwd=tmp_path).returncode == 0

    out = routebalance("keys", "list", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "team-a" in out.stdout and "team-b" in out.stdout and "no spend recorded yet" in out.stdout
    assert not (tmp_path / "data").exists()  # listing creates no database

    keys = load_config(config).auth.keys
    store = SqliteSpendStore(tmp_path / "data" / "state.db")  # the default [state] path, from tmp_path
    ledger = SpendLedger(store)
    ledger.settle(ledger.reserve(keys[0], 0.5, time.time()), 0.25)
    ledger.settle(ledger.reserve(keys[1], 9.0, time.time()), 7.0)
    ledger.settle(ledger.reserve(keys[1], 9.0, time.time()), 1.0)
    store.close()

    out = routebalance("keys", "list", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    rows = {line.split()[0]: line.split() for line in out.stdout.splitlines()[1:3]}
    assert rows["team-a"][1:] == ["1.500000", "day", time.strftime("%Y-%m-%d", time.gmtime()), "0.250000", "1",
                                  "1.250000", "-"]
    assert rows["team-b"][1:] == ["-", "total", "8.000000", "2", "-", "-"]


def test_list_with_an_in_memory_ledger_says_there_is_nothing_to_show(config, tmp_path):
    assert routebalance("keys", "add", "team-a", "--config", str(config), cwd=tmp_path).returncode == 0
    config.write_text(config.read_text().replace('backend = "sqlite"', 'backend = "memory"'))
    out = routebalance("keys", "list", "--config", str(config), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "team-a" in out.stdout and 'backend = "memory"' in out.stdout


def test_serve_refuses_a_non_loopback_address_without_keys_before_loading_anything(config, tmp_path):
    # Where the estimators would be built: the refusal must come before they load (seconds) or build (minutes).
    models_dir = tmp_path / "models-not-built"
    text = config.read_text()
    assert 'models_dir = "models"' in text
    config.write_text(text.replace('models_dir = "models"', f'models_dir = "{models_dir}"'))
    out = routebalance("serve", "--host", "0.0.0.0", "--port", str(free_port()), "--config", str(config),
                       cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    assert f"config loaded from {config.resolve()}" in out.stderr  # it says which file it read
    assert out.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "routebalance keys add" in out.stderr and "allow_anonymous = true" in out.stderr
    assert "listening on" not in out.stderr
    assert not models_dir.exists()
