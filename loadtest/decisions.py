"""Print the gateway's routing decisions from its /metrics: tier mix and decision overhead.

    python loadtest/decisions.py [http://127.0.0.1:8000]

Reads the counters and histograms the scheduler keeps (routebalance_routed,
routebalance_batch_size, routebalance_estimate_seconds, ...) once, so run it
right after a load run against a fresh gateway.
"""

from __future__ import annotations

import sys

import httpx
from prometheus_client.parser import text_string_to_metric_families


def histogram(family) -> tuple[float, float, list[tuple[float, float]]]:
    """(count, sum, cumulative buckets) summed over label sets."""
    count = total = 0.0
    buckets: dict[float, float] = {}
    for s in family.samples:
        if s.name.endswith("_count"):
            count += s.value
        elif s.name.endswith("_sum"):
            total += s.value
        elif s.name.endswith("_bucket"):
            le = float(s.labels["le"])
            buckets[le] = buckets.get(le, 0.0) + s.value
    return count, total, sorted(buckets.items())


def quantile(buckets: list[tuple[float, float]], count: float, q: float) -> float:
    """Upper bucket bound holding the q-quantile (a bound, as Prometheus histograms allow)."""
    for le, cum in buckets:
        if cum >= q * count:
            return le
    return float("inf")


def report(text: str) -> str:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    lines = []
    routed = families.get("routebalance_routed")
    if routed:
        by_model: dict[str, float] = {}
        for s in routed.samples:
            if s.name.endswith("_total"):
                by_model[s.labels["model"]] = by_model.get(s.labels["model"], 0.0) + s.value
        total = sum(by_model.values()) or 1.0
        lines.append(f"tier mix over {total:.0f} routed requests:")
        lines += [f"  {m:<28} {n:>6.0f}  {100 * n / total:5.1f}%" for m, n in sorted(by_model.items())]
    for name, label, per_batch in (("routebalance_batch_size", "batch size", False),
                                   ("routebalance_batch_wait_seconds", "batch wait", True),
                                   ("routebalance_estimate_seconds", "estimate (embed + KNN) per batch", True),
                                   ("routebalance_score_seconds", "scoring + assignment per batch", True),
                                   ("routebalance_decision_seconds", "arrival to decision per request", True)):
        fam = families.get(name)
        if fam is None:
            continue
        count, total, buckets = histogram(fam)
        if not count:
            continue
        scale, unit = (1000, " ms") if per_batch else (1, "")
        lines.append(f"{label:<36} mean {scale * total / count:7.2f}{unit}"
                     f"   p50 <= {scale * quantile(buckets, count, 0.5):g}{unit}"
                     f"   p99 <= {scale * quantile(buckets, count, 0.99):g}{unit}   ({count:.0f} observations)")
    return "\n".join(lines)


if __name__ == "__main__":
    url = (sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8000").rstrip("/")
    print(report(httpx.get(url + "/metrics", timeout=5).text))
