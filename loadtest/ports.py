"""Free loopback ports for the load tests' throwaway servers, a config's pool moved onto them, the wait
until those servers are ready for load, and their stop (every script here imports it, so it imports nothing
heavy)."""

from __future__ import annotations

import http.client
import re
import socket
import subprocess
import time
from urllib.parse import urlsplit

POOL_URL = re.compile(r'url = "http://127\.0\.0\.1:(\d+)"')


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (held open together while chosen, so none is handed out twice)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def pool_ports(text: str) -> list[str]:
    """The loopback ports a config's instance URLs name, each once, in order."""
    return sorted(set(POOL_URL.findall(text)))


def move_pool(text: str, ports: list[int]) -> str:
    """The config text with its instances' loopback ports moved to `ports` (one each, in pool_ports' order;
    the emulator serves each instance on its URL's port)."""
    old = pool_ports(text)
    if len(ports) < len(old):
        raise SystemExit(f"the pool has {len(old)} instance ports; {len(ports)} given")
    for before, after in zip(old, ports, strict=False):
        text = text.replace(f'127.0.0.1:{before}"', f'127.0.0.1:{after}"')
    return text


READY_POLL_S = 0.2


def _get(url: str) -> tuple[int | None, str]:
    """(status, the answer's start) of one GET within 2 s; (None, the error) when there was none. http.client,
    not urllib: no proxy from the environment comes between the script and its loopback server."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname or "127.0.0.1", parts.port, timeout=2.0)
    try:
        conn.request("GET", parts.path or "/")
        response = conn.getresponse()
        return response.status, f"{response.status} {response.read(300).decode(errors='replace')}"
    except (OSError, http.client.HTTPException) as e:
        return None, repr(e)
    finally:
        conn.close()


def wait_ready(urls: list[str], timeout_s: float, proc: subprocess.Popen | None = None) -> None:
    """Wait until each of `urls` answers GET with 200, in order, for at most timeout_s in all. Load starts
    after it: a gateway's /health/ready answers 503 while the gateway starts (`up` builds or loads its
    estimators), and a run that counted those answers as failures would measure the start, not the gateway.
    RuntimeError, with the last answer, when the time is up or `proc` (the server's process) exits."""
    t0 = time.monotonic()
    for url in urls:
        status, last = None, "no answer"
        for _ in range(int(timeout_s / READY_POLL_S) + 1):  # the clock bounds it too: one GET may take 2 s
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with status {proc.returncode} before GET {url} answered "
                                   f"200 (last: {last})")
            status, last = _get(url)
            if status == 200 or time.monotonic() - t0 >= timeout_s:
                break
            time.sleep(READY_POLL_S)
        if status != 200:
            raise RuntimeError(f"GET {url} did not answer 200 within {timeout_s:.0f} s (last: {last})")


def stop_all(procs: list[subprocess.Popen], timeout_s: float = 15.0) -> None:
    """Stop the servers a run started, the last started first (a gateway before the backends it drains to):
    SIGTERM to each still running, then each is waited for; one that outlives `timeout_s` (in all) is killed."""
    for proc in reversed(procs):
        if proc.poll() is None:
            proc.terminate()
    deadline = time.monotonic() + timeout_s
    for proc in reversed(procs):
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=5)
