"""A real redis-server on a loopback port for the shared-state tests (Debian's package).

The tests that need it skip, saying why and how to install it, when the
binary is absent; they never pass without it. fakeredis would not do: the
point is the server running the scripts atomically.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest
import redis

from conftest import free_port

INSTALL = "apt-get install -y redis-server"


def redis_binary() -> str:
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(f"redis-server is not installed (the shared-state tests need a real one): {INSTALL}")
    return binary


class RedisServer:
    """One redis-server process, stoppable and restartable on the same port (an outage)."""

    def __init__(self, workdir: Path):
        self.binary = redis_binary()
        self.port = free_port()
        self.workdir = workdir
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        # No snapshots or AOF: each test starts empty; the outage tests restart it on purpose.
        self.proc = subprocess.Popen([self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)
        client.close()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
