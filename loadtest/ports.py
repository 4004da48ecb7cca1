"""Free loopback ports for the load tests' throwaway servers (every script here imports it, so it imports
nothing heavy)."""

from __future__ import annotations

import socket


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
