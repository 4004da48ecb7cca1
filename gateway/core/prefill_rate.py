"""A tier's prefill rate (seconds per prompt token computed): its profile's prior, refined by what its instances report.

vLLM records, as each request finishes, the seconds from its first scheduling to its first token
(`vllm:request_prefill_time_seconds`) and the prompt tokens it computed rather than found cached
(`vllm:request_prefill_kv_computed_tokens`): two histograms whose `_count`s grow together. Between two scrapes the
requests that finished give n requests, x tokens computed and y seconds. A request's prefill time is a part that does
not grow with its own prompt (the step's decodes beside it, other prompts' chunks in the same steps) plus its own
tokens at the rate, so y = a n + b x. The fit is least squares over the intervals, each weighed by 1/n (a sum of n
requests' times varies n times as much as one), old requests forgotten with a half-life, and both parameters pulled
towards their priors (a: one decode step at the tier's TPOT prior; b: the profile's prior) with the weight of
PRIOR_REQUESTS requests, so a handful of requests barely moves the rate and a wrong prior yields to what is measured.
The slope is what Eq. 1's prefill term needs: what the part the prefix cache saves costs.
"""

from __future__ import annotations

from dataclasses import dataclass

HALF_LIFE_REQUESTS = 512.0  # finished requests after which a past interval weighs half
PRIOR_REQUESTS = 16.0  # the priors weigh as much as this many measured requests
PRIOR_PROMPT_TOKENS = 512.0  # ... of this many computed tokens each (the slope's prior weight)
MAX_FACTOR = 10.0  # the fitted rate stays within this factor of the prior either way (a noisy fit cannot run away)


@dataclass(slots=True)
class PrefillFit:
    """The fit's weighted sums over the intervals seen: n requests, x tokens computed, y seconds."""

    nn: float = 0.0
    nx: float = 0.0
    xx: float = 0.0
    ny: float = 0.0
    xy: float = 0.0
    requests: float = 0.0  # requests seen, forgetting included (how much the data weighs)

    def observe(self, n: float, x: float, y: float) -> None:
        """n requests finished with x tokens computed and y seconds of prefill between them. An interval
        that makes no sense (a counter reset: an instance restarted) is skipped."""
        if n <= 0 or x < 0 or y < 0:
            return
        keep = 0.5 ** (n / HALF_LIFE_REQUESTS)
        self.nn = keep * self.nn + n  # n * n / n: each interval weighs 1/n
        self.nx = keep * self.nx + x
        self.xx = keep * self.xx + x * x / n
        self.ny = keep * self.ny + y
        self.xy = keep * self.xy + x * y / n
        self.requests = keep * self.requests + n

    def __add__(self, other: PrefillFit) -> PrefillFit:
        """The tier's fit: its instances' sums pooled."""
        return PrefillFit(self.nn + other.nn, self.nx + other.nx, self.xx + other.xx, self.ny + other.ny,
                          self.xy + other.xy, self.requests + other.requests)

    def rate(self, prior_s: float, step_prior_s: float) -> float:
        """Seconds per computed prompt token: the prior, moved by the measurements as far as they weigh."""
        if self.requests <= 0 or prior_s <= 0:
            return prior_s
        ka, kb = PRIOR_REQUESTS, PRIOR_REQUESTS * PRIOR_PROMPT_TOKENS ** 2
        # the ridge's normal equations: [[nn + ka, nx], [nx, xx + kb]] (a, b) = (ny + ka a0, xy + kb b0)
        a11, a12, a22 = self.nn + ka, self.nx, self.xx + kb
        r1, r2 = self.ny + ka * step_prior_s, self.xy + kb * prior_s
        det = a11 * a22 - a12 * a12
        if det <= 0:
            return prior_s
        slope = (a11 * r2 - a12 * r1) / det
        return min(max(slope, prior_s / MAX_FACTOR), prior_s * MAX_FACTOR)
