"""The serving path stays lean: starting the gateway imports no data-making or evaluation code."""

from __future__ import annotations

import subprocess
import sys

from conftest import pool_config

SERVE = """
import sys
from gateway.cli import load_estimators
from gateway.config import ConfigStore
from gateway.server import Gateway, build_app

store = ConfigStore(sys.argv[1])
gateway = Gateway(store, load_estimators(store.current))
gateway.warm_up()  # one real decision: embedder, KNN, TPOT heads, scoring
build_app(gateway)
print(sorted(m for m in sys.modules if m.startswith(tuple(sys.argv[2:]))))
"""
OFF_THE_SERVING_PATH = ("gateway.workload.text", "gateway.workload.synthetic", "matplotlib", "gateway.sim",
                        "gateway.emulator")


def test_serving_imports_no_prompt_templates_plotting_simulator_or_emulator(built, tmp_path):
    path = pool_config(tmp_path, built[0].estimators.models_dir)
    out = subprocess.run([sys.executable, "-c", SERVE, str(path), *OFF_THE_SERVING_PATH], capture_output=True,
                         text=True, timeout=120, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout
    # The check can fail: the generator the emulator and `train` use does pull the templates in.
    probe = subprocess.run([sys.executable, "-c", "import sys, gateway.workload.synthetic; "
                            "print([m for m in sys.modules if m.startswith('gateway.workload.text')])"],
                           capture_output=True, text=True, timeout=60, check=True)
    assert probe.stdout.strip() != "[]"
