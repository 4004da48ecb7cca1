"""The command line as a new user meets it: every option says what it does, and every command without
--config reads ./config.toml when there is one (and says so)."""

from __future__ import annotations

import argparse
import subprocess
import sys

from gateway import cli
from gateway.config.store import default_config_path


def options(p: argparse.ArgumentParser, where: str = "routebalance"):
    """(where, action) for every option and positional of `p` and of its subcommands, recursively."""
    for action in p._actions:  # argparse keeps them here; there is no public walk
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{where} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield where, action


def test_every_option_has_help_and_a_fixed_set_of_values_is_listed():
    parser, commands = cli.build_parser(with_lab=True)
    found = list(options(parser))
    # every command with options was walked (`policies` has none)
    assert {w.split()[1] for w, _ in found if " " in w} == (set(commands) | set(cli.SERVING)) - {"policies"}
    assert len(found) > 60  # the walk reached the subcommands' options
    assert [f"{w} {a.dest}" for w, a in found if not (a.help or "").strip()] == []
    # an option with a fixed set of values says which (argparse's choices, shown by --help)
    named = {(w, a.dest): a for w, a in found}
    assert named[("routebalance sim", "arrivals")].choices == ("poisson", "gamma", "square", "azure")
    assert "frontier" in named[("routebalance sim", "sweep")].choices
    assert named[("routebalance train-policy", "policy")].choices == ("qos-rl", "eldr")
    assert named[("routebalance", "log_level")].choices == cli.LOG_LEVELS
    assert ("routebalance up", "emulator_port") in named and ("routebalance serve", "port") in named


def test_the_log_level_lists_its_values():
    out = subprocess.run([sys.executable, "-m", "gateway.cli", "--help"], capture_output=True, text=True, timeout=60)
    assert "{DEBUG,INFO,WARNING,ERROR}" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "gateway.cli", "--log-level", "loud", "policies"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_without_config_a_command_reads_the_working_directorys_config_toml_and_says_so(tmp_path):
    here = tmp_path / "config.toml"
    here.write_text(default_config_path().read_text().replace('aliases = ["auto"]', 'aliases = ["auto", "mine"]'))
    key = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "add", "ci-key"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert key.returncode == 0, key.stderr
    assert "config: ./config.toml" in key.stderr and "ci-key" in here.read_text()  # this file, not the packaged one
    assert "ci-key" not in default_config_path().read_text()
    listed = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "list"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert "ci-key" in listed.stdout
    elsewhere = subprocess.run([sys.executable, "-m", "gateway.cli", "keys", "list"], cwd=tmp_path / "..",
                               capture_output=True, text=True, timeout=60)
    assert "the built-in" in elsewhere.stderr and "ci-key" not in elsewhere.stdout
