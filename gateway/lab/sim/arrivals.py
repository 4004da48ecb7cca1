"""Arrival processes for the simulator and the load tests: times in seconds from 0.

All four have the same mean rate, so cells compare at equal offered load:
- Poisson: exponential gaps (the vLLM benchmark harness's default);
- gamma: gamma gaps with shape k (coefficient of variation 1/sqrt(k)); k < 1 is bursty;
- square wave: Poisson whose rate alternates between a low and a high phase;
- azure: a real trace's gaps replayed in order, by default the Azure LLM inference trace (one hour of a
  production conversational service, 2023-11-16; ../shared/data/arrivals/ beside the repository, CC-BY 4.0:
  P. Patel et al., "Splitwise: Efficient generative LLM inference using phase splitting", ISCA 2024). The
  seed picks where in the trace a cell starts (wrapping round at its end).

What an arrival carries is the same for every process: arrival i is the cell's held-out prompt i, in the
same order for every policy and seed. The trace's own prompt and answer lengths are not used (it has no
prompt text, and a prompt's length is the labelled record's own), so only the timing is the trace's.
"""

from __future__ import annotations

import csv
import functools
from dataclasses import dataclass
from pathlib import Path

import numpy as np

KINDS = ("poisson", "gamma", "square", "azure")
AZURE_TRACE = (Path(__file__).resolve().parents[4] / "shared" / "data" / "arrivals"
               / "azure_llm_inference_2023_conv.csv")


@dataclass(frozen=True, slots=True)
class ArrivalSpec:
    kind: str = "poisson"
    rate: float = 12.0  # mean requests per second
    shape: float = 0.5  # gamma only
    low_high: tuple[float, float] = (0.5, 1.5)  # square only: phase rates as multiples of `rate`
    period_s: float = 20.0  # square only: one low phase plus one high phase
    trace: Path = AZURE_TRACE  # azure only: a CSV whose TIMESTAMP column holds the arrivals

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown arrival process {self.kind!r} (known: {', '.join(KINDS)})")
        if self.rate <= 0 or self.shape <= 0 or self.period_s <= 0 or min(self.low_high) <= 0:
            raise ValueError("rate, shape, period and phase rates must be positive")
        if self.kind == "azure" and not self.trace.is_file():  # now, not minutes into a sweep
            raise FileNotFoundError(
                f"no arrival trace at {self.trace}: the azure arrivals replay the Azure LLM inference trace, kept "
                "in ../shared/data/arrivals/ beside the repository (its README.md says where it comes from): copy "
                "data/AzureLLMInferenceTrace_conv.csv of github.com/Azure/AzurePublicDataset to that path")

    def label(self) -> str:
        if self.kind == "gamma":
            return f"gamma k={self.shape:g}"
        if self.kind == "square":
            lo, hi = self.low_high
            return f"square {lo * self.rate:g}/{hi * self.rate:g} per {self.period_s:g}s"
        if self.kind == "azure":
            return "azure trace"
        return "poisson"


def arrival_times(spec: ArrivalSpec, n: int, seed: int) -> np.ndarray:
    """n increasing arrival times for `spec`, the same for the same seed."""
    rng = np.random.default_rng(seed)
    if spec.kind == "poisson":
        gaps = rng.exponential(1.0 / spec.rate, n)
    elif spec.kind == "gamma":
        gaps = rng.gamma(spec.shape, 1.0 / (spec.rate * spec.shape), n)
    elif spec.kind == "azure":
        gaps = trace_gaps(spec.trace)
        window = gaps[(rng.integers(len(gaps)) + np.arange(n)) % len(gaps)]
        # Scaled by the window's own mean, not the hour's: a window of 2,500 arrivals runs at 0.7-1.4x the
        # hour's rate, and a cell's load must be its rate on every seed, as with the other processes.
        gaps = window / ((window.mean() or gaps.mean()) * spec.rate)  # `or`: all at one timestamp
    else:
        return _square_wave(spec, n, rng)
    return np.cumsum(gaps)


@functools.lru_cache(maxsize=2)  # every cell of a sweep reads the same file
def trace_gaps(path: Path) -> np.ndarray:
    """Seconds between a trace's consecutive arrivals, in time order (read-only: it is shared)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        if "TIMESTAMP" not in (reader.fieldnames or ()):
            raise ValueError(f"{path}: no TIMESTAMP column (found {reader.fieldnames})")
        # numpy parses "2023-11-16 18:15:46.6805900" (7 fractional digits) exactly, at nanoseconds.
        times = np.sort(np.array([row["TIMESTAMP"].strip() for row in reader], dtype="datetime64[ns]"))
    gaps = np.diff(times).astype(np.int64) / 1e9  # equal timestamps give zero gaps: arrivals together
    if not gaps.any():
        raise ValueError(f"{path}: a trace needs arrivals at two different times at least")
    gaps.setflags(write=False)
    return gaps


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
