"""Per-request service-level objectives: which class a request's SLO falls in, and whether it was met.

Two kinds, after the seed papers: an end-to-end SLO in seconds (QLM: arrival
to the last answer token) and a bound on the time per output token (QoS
routing: the end-to-end time divided by the answer's tokens). Classes name
ranges of end-to-end SLOs for metrics and reports (e.g. interactive up to
30 s, batch up to 10 minutes).
"""

from __future__ import annotations

from collections.abc import Mapping

NO_SLO = "none"  # the class of a request that carries no end-to-end SLO


def slo_class(slo_s: float | None, classes: Mapping[str, float]) -> str:
    """The tightest class whose bound holds `slo_s`; the loosest one if it is longer than every bound."""
    if slo_s is None or not classes:
        return NO_SLO
    ordered = sorted(classes.items(), key=lambda kv: kv[1])
    for name, bound in ordered:
        if slo_s <= bound:
            return name
    return ordered[-1][0]


def slo_met(taken, bound):
    """Within its bound (seconds, or seconds per token): floats, or numpy arrays element by element."""
    return taken <= bound


def time_per_token(e2e_s: float, completion_tokens: int) -> float:
    """The QoS paper's latency per token: arrival to the end of the answer, over its tokens."""
    return e2e_s / max(completion_tokens, 1)


def tpot_met(e2e_s: float, completion_tokens: int, tpot_slo_s: float) -> bool:
    return slo_met(time_per_token(e2e_s, completion_tokens), tpot_slo_s)
