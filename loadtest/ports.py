"""Free loopback ports for the load tests' throwaway servers, and a config's pool moved onto them (every
script here imports it, so it imports nothing heavy)."""

from __future__ import annotations

import re
import socket

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
