"""Arrival processes for the simulator and the live check: times in seconds from 0.

All three have the same mean rate, so cells compare at equal offered load:
- Poisson: exponential gaps (the vLLM benchmark harness's default);
- gamma: gamma gaps with shape k (coefficient of variation 1/sqrt(k)); k < 1 is bursty;
- square wave: Poisson whose rate alternates between a low and a high phase.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("poisson", "gamma", "square")


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = 12.0  # mean requests per second
    shape: float = 0.5  # gamma only
    low_high: tuple[float, float] = (0.5, 1.5)  # square only: phase rates as multiples of `rate`
    period_s: float = 20.0  # square only: one low phase plus one high phase

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r} (known: {', '.join(KINDS)})")
        if self.rate <= 0 or self.shape <= 0 or self.period_s <= 0 or min(self.low_high) <= 0:
            raise ValueError("rate, shape, period and phase rates must be positive")

    def label(self) -> str:
        if self.kind == "gamma":
            return f"gamma k={self.shape:g}"
        if self.kind == "square":
            lo, hi = self.low_high
            return f"square {lo * self.rate:g}/{hi * self.rate:g} per {self.period_s:g}s"
        return "poisson"


def arrival_times(spec: ArrivalSpec, n: int, seed: int) -> np.ndarray:
    """n increasing arrival times for `spec`, the same for the same seed."""
    rng = np.random.default_rng(seed)
    if spec.kind == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, n)
    elif spec.kind == "gamma":
        gaps = rng.gamma(spec.shape, 1.0 / (spec.rate * spec.shape), n)
    else:
        return _square_wave(spec, n, rng)
    return np.cumsum(gaps)


def _square_wave(spec: ArrivalSpec, n: int, rng: np.random.Generator) -> np.ndarray:
    """Poisson by thinning: candidates at the peak rate, each kept with its phase's share of it."""
    lo, hi = spec.low_high
    # Mean over a period is (lo + hi) / 2 x rate; scale so the mean is `rate`.
    scale = 2.0 / (lo + hi)
    peak = max(lo, hi) * scale * spec.rate
    times: list[float] = []
    t = 0.0
    while len(times) < n:
        t += rng.exponential(1.0 / peak)
        in_low = (t % spec.period_s) < spec.period_s / 2
        phase_rate = (lo if in_low else hi) * scale * spec.rate
        if rng.random() < phase_rate / peak:
            times.append(t)
    return np.array(times)
