"""Opt-in: build the container image for real (deploy/build-image.sh: Debian base, podman) and
smoke-test it (deploy/smoke-image.sh). Minutes of CPU and a download of the Python dependencies,
so it runs only when asked:

    sudo ROUTEBALANCE_IMAGE_TEST=1 .venv/bin/python -m pytest tests/test_image.py -s
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
RUN = "sudo ROUTEBALANCE_IMAGE_TEST=1 .venv/bin/python -m pytest tests/test_image.py -s"


@pytest.fixture(scope="module")
def opted_in():
    if os.environ.get("ROUTEBALANCE_IMAGE_TEST") != "1":
        pytest.skip(f"builds and runs the container image (minutes): {RUN}")
    if shutil.which("podman") is None:
        pytest.skip(f"podman is not installed (apt-get install podman runc debootstrap), then: {RUN}")
    if os.geteuid() != 0:
        pytest.skip(f"needs root for debootstrap and rootful podman: {RUN}")


def _run(cmd: list[str], timeout: float) -> str:
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    print(result.stdout[-4000:])
    tail = f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    assert result.returncode == 0, f"{cmd} exited {result.returncode}:\n{tail}"
    return result.stdout


def test_build_and_smoke(opted_in):
    built = _run([str(DEPLOY / "build-image.sh")], timeout=1800)
    assert "image size" in built
    smoke = _run([str(DEPLOY / "smoke-image.sh")], timeout=600)
    for check in ("/health answers", "unknown key refused", "non-streamed:", "streamed:", "not root", "HEALTHCHECK"):
        assert f"ok   {check}" in smoke, check
