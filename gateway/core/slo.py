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
# The load generators' batch jobs (the simulator's and locust's): a request with an end-to-end SLO this
# long or longer is a job whose client reads the whole answer, so it does not stream.
BATCH_SLO_S = 60.0


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


def parse_slo_mix(text: str) -> tuple[tuple[float, float], ...]:
    """An SLO mix written as SECONDS:SHARE pairs, `25:0.5,300:0.5` -> ((25.0, 0.5), (300.0, 0.5)); the
    shares sum to at most 1 (the rest of the requests carry no SLO). ValueError naming the bad part."""
    mix = []
    for item in filter(None, (p.strip() for p in text.split(","))):
        seconds, sep, share = item.partition(":")
        try:
            pair = (float(seconds), float(share))
        except ValueError:
            pair = None
        if not sep or pair is None:
            raise ValueError(f"SLO mix: {item!r} is not SECONDS:SHARE")
        mix.append(pair)
    return check_slo_mix(tuple(mix))


def check_slo_mix(mix: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
    """The mix, if its seconds are positive and its shares >= 0 sum to at most 1; else ValueError."""
    if sum(share for _, share in mix) > 1 + 1e-9 or any(s <= 0 or w < 0 for s, w in mix):
        raise ValueError(f"SLO mix {mix}: positive seconds, shares >= 0 summing to at most 1")
    return mix
