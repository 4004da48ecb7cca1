"""The serving path stays lean: starting the gateway imports nothing from the lab (emulator, simulator,
workload generator, training, experiments), plotting or PyTorch."""

from __future__ import annotations

import subprocess
import sys

from conftest import free_port, pool_config

# `routebalance serve` as a user runs it (the command line, the estimators loaded, one warm-up decision,
# the socket listening); once it answers /health, the modules it has imported are printed and it exits.
SERVE = """
import os, sys, threading, time, urllib.request
from gateway import cli

config, port, prefixes = sys.argv[1], sys.argv[2], tuple(sys.argv[3:])

def report():
    deadline = time.monotonic() + 100
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            break
        except OSError:
            time.sleep(0.1)
    print(sorted(m for m in sys.modules if m.startswith(prefixes)), flush=True)
    os._exit(0)

threading.Thread(target=report, daemon=True).start()
cli.main(["serve", "--config", config, "--port", port])
"""
OFF_THE_SERVING_PATH = ("gateway.lab", "matplotlib", "torch")


def test_a_started_gateway_imports_nothing_from_the_lab(built, tmp_path):
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    out = subprocess.run([sys.executable, "-c", SERVE, str(path), str(free_port()), *OFF_THE_SERVING_PATH],
                         capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    # The check can fail: the generator the emulator and `train` use does pull the templates in.
    probe = subprocess.run([sys.executable, "-c", "import sys, gateway.lab.workload.synthetic; "
                            "print([m for m in sys.modules if m.startswith('gateway.lab.workload.text')])"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout.strip() != "[]"


def test_no_two_classes_share_a_name():
    """One name means one thing: a config section, a runtime object and a policy's helper never share a
    class name anywhere in the package (a config section's class ends in Config)."""
    import ast
    from collections import defaultdict
    from pathlib import Path

    import gateway

    where: dict[str, list[str]] = defaultdict(list)
    root = Path(gateway.__file__).parent
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where[node.name].append(str(path.relative_to(root)))
    assert len(where) > 100  # the walk found the package
    assert {name: paths for name, paths in where.items() if len(paths) > 1} == {}
