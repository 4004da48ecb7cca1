"""`routebalance serve --workers N`: N gateway processes on one port, so routing uses every core.

Each worker is a whole gateway listening with SO_REUSEPORT; the kernel spreads new connections over them.
What they share, and how:

- key spend and reservations: with the default SQLite backend, the SQLite file (its holds taken in
  transactions that hold across processes, tenancy/spend/host.py); with the Redis backend, Redis, exactly
  as replicas on several hosts share them (docs/operations/replicas.md). The memory backend is refused:
  it keeps spend inside one process, so two workers could each grant a key its last dollar;
- completion ids for feedback, so a feedback is taken by whichever worker its connection reaches: Redis
  (gateway/learning/shared_completions.py), else a SQLite file beside the state file
  (gateway/learning/host_completions.py);
- with Redis only: the pool view, the cooldowns and the approximate prefix index (gateway/state/). Without
  Redis each worker keeps its own: each scrapes every instance's /metrics, so its view of the pool lags
  the others' dispatches by a scrape (`sharing` below says so at start);
- the estimators' version: a refresh or rollback runs in one worker at a time (a lock file beside the
  artefacts) and writes the manifest; every worker follows the manifest's version within
  FOLLOW_EVERY_S (serving/refresh.py). Scheduled refreshes run in worker 0 only;
- the learning caps: each worker takes its part of the daily spend caps of exploration and shadow
  answers and of the shadow calls in flight (`Worker.part`), so the host stays within each cap;
- /metrics: prometheus_client's multiprocess mode over a directory the supervisor makes and removes,
  so the page any worker renders counts the whole host.

The supervisor starts the workers, passes SIGHUP on (each reloads its config) and SIGTERM/SIGINT (each
stops as a single gateway does), and stops every worker when one exits: a service manager restarts the
whole, as it would a single process.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

from gateway.config.sections import Config

log = logging.getLogger("routebalance.workers")
FOLLOW_EVERY_S = 1.0  # how often a worker checks the manifest for a version another worker made
_STOP_GRACE_S = 10.0
_PR_SET_PDEATHSIG = 1  # prctl(2)  # beyond [server].shutdown_timeout_s, before a worker that has not stopped is killed


@dataclass(frozen=True, slots=True)
class Worker:
    """This process's place among the host's workers (0 of 1: a single gateway)."""

    index: int = 0
    count: int = 1

    @classmethod
    def parse(cls, text: str) -> Worker:
        """From the supervisor's "INDEX/COUNT"."""
        index, count = (int(part) for part in text.split("/"))
        if not 0 <= index < count:
            raise ValueError(f"worker {text!r}: the index must be in [0, count)")
        return cls(index, count)

    @property
    def shared(self) -> bool:
        return self.count > 1

    def part(self, total: float) -> float:
        """This worker's share of a host-wide cap on money."""
        return total / self.count

    def part_of_count(self, total: int) -> int:
        """This worker's share of a host-wide cap on a count; the shares add up to `total` exactly."""
        return total // self.count + (self.index < total % self.count)


SINGLE = Worker()  # a gateway alone on its host


def workers_problem(config: Config, workers: int) -> str | None:
    """Why the config cannot be served by `workers` processes, or None."""
    if workers < 1:
        return f"--workers must be at least 1, got {workers}"
    if workers > 1 and config.state.backend == "memory":
        return (f"--workers {workers} needs a state backend the workers share: they must share key spend and "
                '[state] backend = "memory" keeps it inside one process. Use "sqlite" (the default: the '
                'workers share its file) or "redis", or serve with one worker.')
    return None


def sharing(config: Config, workers: int) -> str:
    """What the workers share and what each keeps to itself, for the log at start."""
    if config.state.backend == "redis":
        return f"{workers} workers share key spend, the pool view, cooldowns, the prefix index and feedback ids " \
               f"through redis at {config.state.url}"
    return (f"{workers} workers share key spend and reservations through {config.state.path} and feedback ids "
            "through a file beside it; each keeps its own pool view, cooldowns and approximate prefix index "
            '([state] backend = "redis" shares those too)')


def _stop_with_parent() -> None:
    """In a worker, before it runs: SIGTERM it when the supervisor dies, even by SIGKILL (Linux's
    PR_SET_PDEATHSIG), so no worker is left holding the port."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def supervise(worker_argv: list[str], workers: int, shutdown_timeout_s: float) -> int:
    """Run `workers` gateway processes (each `python -m gateway.cli <worker_argv> --worker I/N`) until a
    signal stops them or one of them exits; the exit code is the first worker's to end that was not asked to."""
    metrics_dir = tempfile.mkdtemp(prefix="routebalance-metrics-")
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
    children: list[subprocess.Popen] = []
    stopping = False

    def forward(signum, _frame) -> None:
        nonlocal stopping
        if signum != signal.SIGHUP:
            stopping = True
        for child in children:
            if child.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGHUP if signum == signal.SIGHUP else signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    code = 0
    try:
        for index in range(workers):
            if stopping:  # a signal came while they started: the ones started have it
                break
            children.append(subprocess.Popen([sys.executable, "-m", "gateway.cli", *worker_argv,
                                              "--worker", f"{index}/{workers}"], env=env,
                                             preexec_fn=_stop_with_parent))
        if stopping:
            forward(signal.SIGTERM, None)
        if not children:
            return 0
        log.info("%d gateway workers started (pids %s)", workers, ", ".join(str(c.pid) for c in children))
        pid, status = os.wait()  # the first worker to end; a signal's handler runs meanwhile
        first = next(c for c in children if c.pid == pid)
        first.returncode = os.waitstatus_to_exitcode(status)
        asked = stopping  # (a signal), else the worker ended on its own
        if not asked:
            code = first.returncode or 1
            log.error("worker %d exited (code %s): stopping the others", children.index(first), first.returncode)
            forward(signal.SIGTERM, None)
        deadline = time.monotonic() + shutdown_timeout_s + _STOP_GRACE_S
        for child in children:
            try:
                child.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.error("worker pid %d did not stop in time: killed", child.pid)
                child.kill()
                child.wait()
        if asked:
            code = next((c.returncode for c in children if c.returncode not in (0, -signal.SIGTERM)), 0)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        for child in children:
            if child.poll() is None:
                child.kill()
                child.wait()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return code
