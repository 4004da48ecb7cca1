"""A real stack for the tests: the pool emulator and the gateway on loopback ports,
running on a uvloop in a background thread, driven by real clients."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import uvloop

from gateway.cli import start_emulator, start_gateway
from gateway.config import ConfigStore, default_config_path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float = 20.0, what: str = "condition") -> None:
    """Poll `predicate` until it holds; an HTTP error counts as "not yet"."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if predicate():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def dump_toml(data: dict) -> str:
    """Just enough TOML writing for test configs (tables, arrays of tables, scalars)."""

    def scalar(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items()) + "}"
        return repr(v)

    lines: list[str] = []

    def table(prefix: str, d: dict, header: str | None) -> None:
        if header:
            lines.append(header)
        subs = []
        for k, v in d.items():
            if isinstance(v, dict):
                subs.append((k, v))
            elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v) and prefix == "":
                subs.append((k, v))
            else:
                lines.append(f"{k} = {scalar(v)}")
        for k, v in subs:
            name = f"{prefix}{k}"
            if isinstance(v, list):
                for item in v:
                    table(f"{name}.", item, f"[[{name}]]")
            else:
                table(f"{name}.", v, f"[{name}]")

    table("", data, None)
    return "\n".join(lines) + "\n"


def pool_config(tmp: Path, **overrides) -> Path:
    """The default 13-instance config, moved to free loopback ports, written to tmp."""
    data = tomllib.loads(default_config_path().read_text())
    data["server"]["port"] = free_port()
    for inst in data["instances"]:
        inst["url"] = f"http://127.0.0.1:{free_port()}"
    for section, values in overrides.items():
        data.setdefault(section, {}).update(values)
    path = tmp / "config.toml"
    path.write_text(dump_toml(data))
    return path


class Stack:
    """Emulator + gateway in one background event loop."""

    def __init__(self, config_path: Path, emulate: bool = True):
        self.config_path = config_path
        self.emulate = emulate
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.store = ConfigStore(config_path)
        self.pool, (self.gateway, self.runner) = self.call(self._start())
        server = self.store.current.server
        self.base_url = f"http://{server.host}:{server.port}/v1"
        self.root = f"http://{server.host}:{server.port}"

    async def _start(self):
        pool = await start_emulator(self.store) if self.emulate else None
        return pool, await start_gateway(self.store)

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn, *args):
        """Run a plain function on the stack's loop thread (engine state is not thread-safe)."""
        async def wrapper():
            return fn(*args)
        return self.call(wrapper())

    def stop(self) -> None:
        async def shutdown():
            await self.runner.cleanup()
            if self.pool:
                await self.pool.stop()
        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    s = Stack(pool_config(tmp_path_factory.mktemp("stack")))
    yield s
    s.stop()
