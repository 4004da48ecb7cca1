"""The policy registry is open: a policy written and registered here, outside the package,
with its own config table, routes live requests on the emulator and runs in the simulator.

The policy is earliest-deadline-first: its `order` hook sorts the waiting
requests by a deadline (arrival + slack per prompt token, the slack read from
its own table [policies.edf_test]) and its `assign` takes the candidate with
the fewest requests on it. Nothing in gateway/ knows its name.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading

import numpy as np
import openai
import pytest

from conftest import Stack, pool_config, wait_for
from gateway.config.sections import BatchRule
from gateway.config_schema import Section, option, section
from gateway.core.loop import SchedulingLoop
from gateway.core.policy import Policy, PolicyEntry
from gateway.core.pool_state import PoolState
from gateway.core.request import Completion, Decision, Estimates, RouteRequest, Ticket
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import load_evalset
from gateway.lab.sim.simulator import CellSpec, run_cell, with_batching
from gateway.policies import registry

NAME = "edf_test"


@section
class EdfOptions(Section):
    slack_s_per_token: float = option(0.5, gt=0)  # deadline = arrival + this x prompt tokens
    assign_s: float = option(0.0, ge=0)  # simulated compute per batch, so requests pile up


class EarliestDeadlineFirst(Policy):
    name = NAME

    built: list[EarliestDeadlineFirst] = []  # every object the registry built, newest last

    def __init__(self, options: EdfOptions):
        self.options = options
        self.built.append(self)
        self.waiting: list[list[str]] = []  # what waited, in arrival order, at every call of the hook
        self.orders: list[list[str]] = []  # every order the hook returned (prompts)
        self.batches: list[list[str]] = []  # every batch assign got (prompts)
        self.gate: threading.Event | None = None  # set by the live test to hold the worker once

    def deadline(self, ticket: Ticket) -> float:
        return ticket.arrived + self.options.slack_s_per_token * ticket.request.input_tokens

    def order(self, waiting, view, now):
        ordered = sorted(waiting, key=self.deadline)
        self.waiting.append([t.request.prompt_text for t in waiting])
        self.orders.append([t.request.prompt_text for t in ordered])
        return ordered

    def assign(self, batch, estimates, view):
        if self.gate is not None:
            gate, self.gate = self.gate, None
            gate.wait(10)
        self.batches.append([r.prompt_text for r in batch])
        out = []
        for req in batch:
            best = min(req.candidates, key=lambda i: (view.active[i], i))
            view.dispatched(best, 0.0, req.input_tokens)
            out.append(Decision((best, *(i for i in req.candidates if i != best))))
        return out

    def compute_s(self, batch_size, cost):
        return self.options.assign_s


@pytest.fixture
def edf():
    registry.register_options(NAME, EdfOptions)
    registry.register(PolicyEntry(NAME, lambda ctx: EarliestDeadlineFirst(ctx.options(NAME)), "test: EDF"))
    yield
    registry.unregister(NAME)


def built_policy(stack) -> EarliestDeadlineFirst:
    cfg = stack.store.current
    return stack.gateway.scheduler.scheduling_loop.policies(cfg).get(NAME)


def test_a_policy_registered_outside_the_package_routes_live_requests(edf, tmp_path):
    path = pool_config(tmp_path, scheduler={"policy": NAME}, policies={NAME: {"slack_s_per_token": 2.0}})
    stack = Stack(path)
    try:
        policy = built_policy(stack)
        assert policy.options.slack_s_per_token == 2.0  # its own table, validated by its own section
        client = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=60, max_retries=0)
        first = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": "warm"}], max_tokens=4)
        assert first.parse().choices[0].message.content
        assert first.headers["X-Route-Instance"] == stack.store.current.instances[0].name  # fewest, lowest index
        # Hold the worker on the next batch, so the following requests wait together in the queue.
        gate = policy.gate = threading.Event()
        prompts = ["a " * n for n in (300, 20, 150, 5, 80)]  # deadlines follow the prompt sizes
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            blocker = pool.submit(client.completions.create, model="auto", prompt="blocker", max_tokens=4)
            wait_for(lambda: policy.gate is None, what="the worker to take the blocking batch")
            waiting = [pool.submit(client.completions.create, model="auto", prompt=p, max_tokens=4) for p in prompts]
            queue = stack.gateway.scheduler.scheduling_loop.queue
            wait_for(lambda: len(queue) == len(prompts), what="the requests to queue")
            gate.set()
            answers = [f.result(30) for f in waiting]
            blocker.result(30)
        assert all(a.choices[0].text for a in answers)
        # The batch after the blocker took them earliest deadline first, not in arrival order.
        after = policy.batches[-1]
        assert after == sorted(prompts, key=len)
        assert policy.orders[-1][:len(prompts)] == after
    finally:
        stack.stop()


def test_the_same_policy_runs_in_the_simulator(edf, built):
    cfg, _, est = built
    # Batches of at most 4 and 50 ms of compute each: requests pile up, and the hook picks who goes first.
    cfg = with_batching(cfg.with_options(NAME, assign_s=0.05), rules=(BatchRule(below=1.01, size=4, window_ms=0.0),))
    ev = load_evalset(cfg, 200, estimators=est)
    result = run_cell(cfg, ev, CellSpec(NAME, arrivals=ArrivalSpec(rate=150.0), requests=200, seed=1), est)
    policy = EarliestDeadlineFirst.built[-1]
    assert all(o.instance >= 0 and np.isfinite(o.finished) for o in result.outcomes)
    assert sum(result.batches) == 200 and max(result.batches) == 4
    assert len(policy.batches) == len(result.batches)
    for order, batch in zip(policy.orders, policy.batches, strict=True):
        assert batch == order[:len(batch)]  # the loop took the policy's order
    assert any(order != waited
               for order, waited in zip(policy.orders, policy.waiting, strict=True))  # and it was not FCFS


class HoldWhileBusy(Policy):
    """Everything to instance 0, at most one request on it at a time: the others wait in the gateway."""

    name = "hold_test"

    def assign(self, batch, estimates, view):
        return [Decision((0,)) for _ in batch]

    def hold(self, ticket, view):
        return view.in_flight[0] >= 1


def test_hold_keeps_decided_requests_in_the_gateway_until_the_policy_lets_go(built):
    registry.register(PolicyEntry("hold_test", lambda ctx: HoldWhileBusy(), "test: request pulling"))
    try:
        cfg = built[0]
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, policy="hold_test"))
        pool_state = PoolState()
        scheduling = SchedulingLoop(registry, pool_state, max_queue=8, resolve=lambda _cfg, _model: (0,))
        tickets = [Ticket(RouteRequest((0,), f"p{k}", 10, 16, (1.0, 0.0, 0.0), policy="hold_test"), "auto", True, cfg)
                   for k in range(3)]
        for k, t in enumerate(tickets):
            assert scheduling.submit(t, float(k))
        batch, failed = scheduling.take(cfg, scheduling.limit(cfg, 3.0), 3.0)
        assert batch == tickets and not failed
        ready = scheduling.settle(batch, scheduling.decide(cfg, batch, scheduling.view(cfg, 3.0), estimate=None), 3.0)
        first = cfg.instances[0].name
        assert ready == tickets[:1] and scheduling.held == tickets[1:]
        assert set(pool_state.of(first).in_flight) == {tickets[0]}  # held requests are not on the instance
        assert scheduling.release_held(3.5) == []
        scheduling.complete(tickets[0], Completion(True, 0, 16), 4.0)
        assert scheduling.release_held(4.0) == tickets[1:2] and scheduling.held == tickets[2:]
        assert set(pool_state.of(first).in_flight) == {tickets[1]}
        scheduling.withdraw(tickets[2], 4.5)  # its client left while held
        assert scheduling.held == [] and scheduling.release_held(5.0) == []
    finally:
        registry.unregister("hold_test")


def test_the_cli_and_the_readme_list_what_is_registered(capsys):
    from pathlib import Path

    from gateway.cli import main

    assert main(["policies"]) == 0
    listed = capsys.readouterr().out.strip()
    assert listed == registry.table() and all(f"`{name}`" in listed for name in registry.names())
    assert listed in (Path(__file__).resolve().parent.parent / "README.md").read_text()


class Faulty(Policy):
    """A plug-in with bugs: each hook named in `broken` raises; `assign` may also choose nothing."""

    name = "faulty_test"

    def __init__(self, broken=(), choose_nothing=False):
        self.broken, self.choose_nothing = set(broken), choose_nothing
        self.completed: list[bool] = []

    def _maybe_raise(self, hook):
        if hook in self.broken:
            raise KeyError(hook)

    def admit(self, request, view):
        self._maybe_raise("admit")
        return None

    def order(self, waiting, view, now):
        self._maybe_raise("order")
        return []  # names nobody: the queue must still move, in arrival order

    def assign(self, batch, estimates, view):
        self._maybe_raise("assign")
        return [Decision(()) if self.choose_nothing else Decision((0, 99)) for _ in batch]  # 99: not a candidate

    def hold(self, ticket, view):
        self._maybe_raise("hold")
        return False

    def on_complete(self, ticket, completion, now):
        self._maybe_raise("on_complete")
        self.completed.append(completion.ok)


@pytest.mark.parametrize(("broken", "choose_nothing", "status"), [
    ((), False, None), (("order", "on_complete"), False, None), (("admit",), False, 500), (("assign",), False, 500),
    (("hold",), False, 500), ((), True, 503)])
def test_a_faulty_policy_costs_only_its_own_requests_and_never_stops_the_loop(built, broken, choose_nothing, status):
    faulty = Faulty(broken, choose_nothing)
    registry.register(PolicyEntry("faulty_test", lambda ctx: faulty, "test: a buggy plug-in"))
    try:
        cfg = built[0]
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, policy="faulty_test"))
        scheduling = SchedulingLoop(registry, PoolState(), max_queue=8, resolve=lambda _cfg, _model: (0, 1))
        tickets = [Ticket(RouteRequest((0, 1), f"p{k}", 10, 16, (1.0, 0.0, 0.0), policy=name), "auto", True, cfg)
                   for k, name in enumerate(["faulty_test", "passthrough+round_robin", "faulty_test"])]
        for k, t in enumerate(tickets):
            scheduling.submit(t, float(k))
        batch, _ = scheduling.take(cfg, None, 3.0)
        assert batch == tickets  # `order` named nobody (or raised): first come, first served
        back = scheduling.settle(batch, scheduling.decide(cfg, batch, scheduling.view(cfg, 3.0), estimate=None), 3.0)
        assert back == tickets and not scheduling.held
        mine, other = [tickets[0], tickets[2]], tickets[1]
        assert other.decision.refused is None and other.decision.ranked  # the other policy is untouched
        for t in mine:
            if status is None:
                assert t.decision.ranked == (0,)  # the instance outside the candidates was dropped
            else:
                assert t.decision.ranked == () and t.decision.refused.status == status
        for t in tickets:
            scheduling.complete(t, Completion(t.decision.refused is None, 0), 4.0)
        assert not any(scheduling.pool_state.of(i.name).in_flight for i in cfg.instances)  # nothing left booked
        if "on_complete" not in broken:
            assert faulty.completed == [status is None] * 2  # refused requests end in on_complete too
    finally:
        registry.unregister("faulty_test")


class Recording(Policy):
    """Remembers the predicted lengths `assign` was given."""

    name = "recording_test"
    needs_estimates = True

    def __init__(self):
        self.lengths: list[np.ndarray] = []

    def assign(self, batch, estimates, view):
        self.lengths.append(estimates.length.copy())
        return [Decision((0,)) for _ in batch]


def test_every_policy_sees_answer_lengths_bounded_by_the_request_max_tokens(built):
    recording = Recording()
    # The policy asks for estimates; the entry does not need built estimators: the test passes its own.
    registry.register(PolicyEntry("recording_test", lambda ctx: recording, "test: what assign is given"))
    try:
        cfg = built[0]
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, policy="recording_test"))
        scheduling = SchedulingLoop(registry, PoolState(), max_queue=8, resolve=lambda _cfg, _model: (0, 1))
        tickets = [Ticket(RouteRequest((0, 1), f"p{k}", 10, limit, (1.0, 0.0, 0.0), policy="recording_test",
                                       to_max_tokens=exact), "auto", False, cfg)
                   for k, (limit, exact) in enumerate([(20, False), (None, False), (500, False), (500, True)])]
        for t in tickets:
            scheduling.submit(t, 0.0)
        batch, _ = scheduling.take(cfg, None, 1.0)
        n = len(cfg.instances)

        def estimate(asked, blind):
            return Estimates(np.full((len(asked), n), 0.5), np.full((len(asked), n), 300.0))

        scheduling.decide(cfg, batch, scheduling.view(cfg, 1.0), estimate=estimate)
        [lengths] = recording.lengths
        assert (lengths[0] == 20).all() and (lengths[1] == 300).all() and (lengths[2] == 300).all()
        assert (lengths[3] == 500).all()  # it ignores end-of-sequence: it runs to its max_tokens
    finally:
        registry.unregister("recording_test")


# ---- a built-in policy is one package and one registry line ------------------------------------------------

THROWAWAY = {
    "__init__.py": '''"""A throwaway policy: every request to the candidate with the cheapest answers."""

from gateway.policies.always_cheapest.policy import ENTRIES, OPTIONS

__all__ = ["ENTRIES", "OPTIONS"]
''',
    "policy.py": '''from __future__ import annotations

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import Policy, PolicyEntry
from gateway.core.request import Decision


@section
class AlwaysCheapestOptions(Section):
    margin: float = option(0.0, ge=0)  # price differences below this (USD per token) are ties


class AlwaysCheapest(Policy):
    name = "always_cheapest"

    def __init__(self, options: AlwaysCheapestOptions):
        self.options = options

    def assign(self, batch, estimates, view):
        out = []
        for req in batch:
            cands = np.asarray(req.candidates)
            price = view.price_out[cands]
            cheap = cands[price <= price.min() + self.options.margin]
            out.append(Decision(tuple(int(i) for i in cheap)))
        return out


OPTIONS = {"always_cheapest": AlwaysCheapestOptions}
ENTRIES = (PolicyEntry("always_cheapest", lambda context: AlwaysCheapest(context.options("always_cheapest")),
                       "test: every request to its cheapest candidate"),)
''',
}


def test_a_new_policy_is_one_package_and_one_registry_line(built, tmp_path):
    """In a copy of the package: add gateway/policies/always_cheapest/ and its name in BUILTIN, change
    nothing else, and the policy is listed, configured from its own table and routes a simulated cell."""
    import filecmp
    import json
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    import gateway

    original = Path(gateway.__file__).parent
    copy = tmp_path / "site" / "gateway"
    shutil.copytree(original, copy, ignore=shutil.ignore_patterns("__pycache__"))
    package = copy / "policies" / "always_cheapest"
    package.mkdir()
    for name, text in THROWAWAY.items():
        (package / name).write_text(text)
    registry_file = copy / "policies" / "registry.py"
    lines = registry_file.read_text().splitlines(keepends=True)
    [at] = [i for i, line in enumerate(lines) if line.startswith("BUILTIN = (")]
    lines[at] = lines[at].replace(")", ', "always_cheapest")', 1)
    registry_file.write_text("".join(lines))

    def differing(cmp: filecmp.dircmp, where: Path) -> list[str]:
        out = [str(where / f) for f in cmp.diff_files + cmp.left_only + cmp.right_only]
        return out + [p for d, sub in cmp.subdirs.items() for p in differing(sub, where / d)]

    changed = differing(filecmp.dircmp(original, copy, ignore=["__pycache__"]), Path("gateway"))
    assert sorted(changed) == ["gateway/policies/always_cheapest", "gateway/policies/registry.py"]
    new_lines = [a for a, b in zip(registry_file.read_text().splitlines(),
                                   (original / "policies" / "registry.py").read_text().splitlines(), strict=True)
                 if a != b]
    assert len(new_lines) == 1

    config = pool_config(tmp_path, built[0].estimators.models_dir, scheduler={"policy": "always_cheapest"},
                         policies={"always_cheapest": {"margin": 0.0}})
    env = {"PYTHONPATH": str(copy.parent), "PATH": "/usr/bin:/bin"}
    run = [sys.executable, "-m", "gateway.cli", "--log-level", "WARNING"]
    # Run outside the repository, so that `-m` finds the copy first (the working directory comes first).
    listed = subprocess.run([*run, "policies"], capture_output=True, text=True, env=env, timeout=60, check=True,
                            cwd=tmp_path)
    assert "`always_cheapest` | test: every request to its cheapest candidate | no |" in listed.stdout
    cell = subprocess.run([*run, "sim", "--config", str(config), "--policy", "always_cheapest", "--requests", "60",
                           "--rate", "4", "--json"], capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert cell.returncode == 0, cell.stderr[-2000:]
    row = json.loads(cell.stdout)
    cheapest = min(built[0].instances, key=lambda i: i.price_output_per_mtok).model
    assert row["served"] == 60 and {m: s for m, s in row["mix"].items() if s} == {cheapest: 1.0}, row["mix"]
    (tmp_path / "bad").mkdir()
    bad = subprocess.run([*run, "sim", "--config", str(pool_config(tmp_path / "bad", built[0].estimators.models_dir,
                                                                      policies={"always_cheapest": {"margin": -1}})),
                          "--policy", "always_cheapest", "--requests", "10"], capture_output=True, text=True, env=env,
                         timeout=120, cwd=tmp_path)
    assert bad.returncode == 2 and "policies.always_cheapest.margin" in bad.stderr  # its own table is checked
