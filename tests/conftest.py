"""A real stack for the tests: the pool emulator and the gateway on loopback ports,
running on a uvloop in a background thread, driven by real clients."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time
import tomllib
from pathlib import Path

import httpx
import pytest
import uvloop
from tomli_w import dumps as dump_toml  # the tests write their configs with it

from gateway.cli import emulated, start_emulator, start_gateway
from gateway.config.store import ConfigStore, default_config_path, load_config
from gateway.estimators.bundle import Estimators
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import ComputeCost, load_evalset, subset
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.pools import pool_names
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.lab.training.build import ensure_built
from gateway.tenancy.spend.sqlite import SpendLedger, SqliteSpendStore, period_start

RECORDS = 2000  # a small synthetic training set: the whole suite shares one build of it
ADMIN_TOKEN = "test-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


_HANDED_OUT: set[int] = set()  # ports free_port() already returned in this process


def free_port() -> int:
    """A free loopback port, never one this process was already given (the OS may hand
    a just-closed port 0 binding out again, and two instances on one port is a duplicate url)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


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


def small_config(models_dir):
    """The default config with a small training set built into `models_dir`."""
    cfg = load_config(default_config_path())
    est = dataclasses.replace(cfg.estimators, train_records=RECORDS, models_dir=str(models_dir))
    return dataclasses.replace(cfg, estimators=est)


@pytest.fixture(scope="session")
def built(tmp_path_factory):
    """(config, manifest, Estimators) of one small build shared by the whole suite."""
    cfg = small_config(tmp_path_factory.mktemp("models"))
    manifest = ensure_built(cfg)
    return cfg, manifest, Estimators.load(cfg)


# The scheduler's compute per batch as measured on a quiet 2-core machine (gateway/lab/sim/evalset.py measures
# it when it builds an evaluation set, so a set built while other work loads the cores charges more).
STEADY_COST = ComputeCost(estimate_fixed_s=0.0025, estimate_per_request_s=0.0115, score_fixed_s=0.0041,
                          score_per_request_s=0.00064, plain_score_fixed_s=5e-5, plain_score_per_request_s=2.9e-5)


def steady(evalset):
    """The evaluation set with STEADY_COST: a simulated test's outcome must not depend on how busy the
    machine was when its set was built."""
    return dataclasses.replace(evalset, cost=STEADY_COST)


@pytest.fixture(scope="session")
def small_sim(built):
    """(config, estimators, evaluation set of 300 held-out prompts at STEADY_COST): the QoS policies' cells."""
    cfg, _, est = built
    return cfg, est, steady(load_evalset(cfg, 300, estimators=est))


def three_tier_qos_cell(small_sim, policy: str) -> dict:
    """The QoS tests' cell: three instances (72B, 14B, 7B) at 12 req/s with L = 50 ms; its summary row."""
    cfg, est, ev = small_sim
    pool_cfg, pool_ev = subset(cfg, ev, pool_names(cfg.instances, 3))
    r = run_cell(pool_cfg, pool_ev, CellSpec(policy, arrivals=ArrivalSpec(rate=12.0), requests=300, seed=3,
                                             tpot_slo_s=0.05), est)
    return summarise(r.outcomes, r.models)


def spent(state_db, name: str) -> float:
    """What the key `name` has booked in all, read from a gateway's SQLite spend ledger."""
    store = SqliteSpendStore(state_db)
    try:
        return SpendLedger(store).spent(name, period_start("total", time.time()))
    finally:
        store.close()


def pool_config(tmp: Path, models_dir: str | None = None, **overrides) -> Path:
    """The default 13-instance config, moved to free loopback ports, written to tmp.

    `models_dir` points it at built estimators (the `built` fixture's); without
    it the policy defaults to passthrough+round_robin, which needs none.
    """
    data = tomllib.loads(default_config_path().read_text())
    if models_dir:
        data["estimators"].update(models_dir=models_dir, train_records=RECORDS)
    else:
        data["scheduler"]["policy"] = "passthrough+round_robin"
    data["server"]["port"] = free_port()
    data["learning"]["path"] = str(tmp / "labels.db")  # each stack its own label store
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
        # As `up` loads it (the emulator's tables checked) when this stack emulates, as `serve` otherwise.
        self.store = ConfigStore(config_path, adjust=emulated(None) if emulate else None)
        self.pool, (self.gateway, self.runners) = self.call(self._start())
        server = self.store.current.server
        self.base_url = f"http://{server.host}:{server.port}/v1"
        self.root = f"http://{server.host}:{server.port}"

    async def _start(self):
        pool = await start_emulator(self.store) if self.emulate else None
        return pool, await start_gateway(self.store)

    def wait_routable(self, timeout: float = 10.0) -> None:
        """Until every instance is routable: one the first scrape found refusing (a server
        started after the gateway) cools down for a moment first."""
        names = [i.name for i in self.store.current.instances]
        wait_for(lambda: httpx.get(self.root + "/health/ready", timeout=2).json()["routable"] == len(names),
                 timeout, "every instance routable")

    def call(self, coro, timeout: float = 30.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def run(self, fn, *args):
        """Run a plain function on the stack's loop thread (engine state is not thread-safe)."""
        async def wrapper():
            return fn(*args)
        return self.call(wrapper())

    def stop(self) -> None:
        async def shutdown():
            for runner in self.runners:
                await runner.cleanup()
            if self.pool:
                await self.pool.stop()
        self.call(shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="session")
def stack(tmp_path_factory, built):
    """The default stack: RouteBalance over the emulated pool, with the shared small build."""
    s = Stack(pool_config(tmp_path_factory.mktemp("stack"), built[0].estimators.models_dir,
                          server={"admin_token": ADMIN_TOKEN}))
    yield s
    s.stop()
