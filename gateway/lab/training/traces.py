"""Latency traces for the TPOT heads: one row per request of a tier-local rate sweep.

Each row holds the features the gateway saw when it dispatched the request
(latency.FEATURES) and the TPOT the request then got. `virtual_sweep` drives
the emulator's engine model in virtual time (seconds of work for the built-in
pool); `profile.live_sweep` does the same over HTTP against any
OpenAI-compatible instance. Both feed the same InstanceState bookkeeping, so a
head trained on either sees features computed the same way as at serve time.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np
import orjson

from gateway.core.engine.engine import Engine, EngineSpec
from gateway.core.engine.profiles import arch_for, spec_for_instance
from gateway.core.pool_state import EngineSnapshot, InstanceState
from gateway.core.view import tier_key
from gateway.estimators.latency import FEATURES

# Shares of the tier's estimated request capacity. The lowest three are there for the nearly idle instance
# (none or one request on it), which the others hardly visit: a tier of several instances at light load is all
# such instances, and a head that has seen few of them prices them wrongly (estimators/latency.py, RISING).
SWEEP_LOAD = (0.005, 0.01, 0.02, 0.05, 0.2, 0.4, 0.6, 0.8, 0.95)


class SweepTarget(NamedTuple):
    """What a sweep reads of an instance beside its engine spec: its tier's names. A build sends this to its sweep
    processes, since a config's Instance holds read-only mappings that do not pickle."""

    model: str
    gpu: str


def capacity_rps(spec: EngineSpec, mean_output_tokens: float) -> float:
    """Rough request ceiling of one instance: its decode ceiling over the mean answer."""
    return 1.0 / (spec.tpot_s * spec.batch_slope) / mean_output_tokens


def virtual_sweep(inst, lengths: list[tuple[int, int]], *, requests_per_rate: int = 400,
                  loads: Iterable[float] = SWEEP_LOAD, scrape_interval_s: float = 0.5, seed: int = 0,
                  engine: EngineSpec | None = None) -> list[dict]:
    """Poisson sweeps against one instance's engine model (`engine`, default its profile's), in virtual time.
    `inst`: an Instance, or its SweepTarget with `engine` given.

    `lengths` are (prompt_tokens, output_tokens) pairs drawn in turn; rates are
    shares of the instance's estimated capacity."""
    spec = engine or spec_for_instance(inst)
    rng = random.Random(seed)
    mean_out = float(np.mean([o for _, o in lengths])) if lengths else arch_for(inst.model).mean_output_tokens
    rows: list[dict] = []
    for load in loads:
        rate = load * capacity_rps(spec, mean_out)
        offset = int(load * 1000)  # each rate starts at a different place in `lengths`
        rows += _sweep_at(inst, spec, rate, lengths[offset % len(lengths):] + lengths[:offset % len(lengths)],
                          requests_per_rate, scrape_interval_s, rng)
    return rows


def _sweep_at(inst, spec: EngineSpec, rate: float, lengths, requests: int, scrape_interval_s: float,
              rng: random.Random) -> list[dict]:
    tier = tier_key(inst.model, inst.gpu)
    engine, state = Engine(spec), InstanceState()
    rows: list[dict] = []
    dispatch_features: dict[int, list[float]] = {}
    generated_total = 0
    next_scrape = 0.0

    def run_engine(until: float) -> None:
        nonlocal generated_total
        report = engine.advance(until)
        generated_total += report.generation_tokens
        for s in report.progressed:
            state.streamed(s.rid, s.generated)
        for s in report.finished:
            state.done(s.rid)
            if s.generated > 1:
                rows.append(trace_row(tier, rate, dispatch_features.pop(s.rid), arrival=s.arrival,
                                      first_token=s.first_token_time, finish=s.finish_time, tokens=s.generated))

    def advance(until: float) -> None:
        nonlocal next_scrape
        while next_scrape <= until:  # scrapes happen on their own clock
            run_engine(next_scrape)
            state.scraped(EngineSnapshot(engine.num_running, engine.num_waiting, engine.kv_usage(),
                                        generated_total, 0), next_scrape)
            next_scrape += scrape_interval_s
        run_engine(until)

    t = 0.0
    for k in range(requests):
        t += rng.expovariate(rate)
        advance(t)
        prompt_tokens, output_tokens = lengths[k % len(lengths)]
        dispatch_features[k] = state.features(prompt_tokens, output_tokens)
        state.dispatched(k, prompt_tokens, output_tokens)
        engine.add(k, prompt_tokens=prompt_tokens, max_tokens=output_tokens, output_tokens=output_tokens, now=t)
    while engine.busy:
        t += scrape_interval_s
        advance(t)
    return rows


def trace_row(tier: str, rate: float, feats: list[float], *, arrival: float, first_token: float, finish: float,
              tokens: int) -> dict:
    """One request's trace: its dispatch features and the latencies it got (tokens >= 2)."""
    return {
        "tier": tier, "rate": rate, **dict(zip(FEATURES, feats, strict=True)),
        "tpot_s": (finish - first_token) / (tokens - 1),
        "ttft_s": first_token - arrival, "e2e_s": finish - arrival,
    }


def write_traces(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))


def read_traces(path: Path) -> list[dict]:
    rows = []
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = orjson.loads(line)
            missing = [k for k in ("tier", "tpot_s", *FEATURES) if k not in row]
        except orjson.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON: {e}") from None
        if missing:
            raise ValueError(f"{path}:{n}: trace row lacks {', '.join(missing)}")
        rows.append(row)
    return rows


def to_arrays(rows: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    x = np.array([[r[f] for f in FEATURES] for r in rows], dtype=np.float32)
    y = np.array([r["tpot_s"] for r in rows], dtype=np.float64)
    return x, y
