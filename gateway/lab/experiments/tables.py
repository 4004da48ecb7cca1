"""Text tables of simulated cells and sweeps, and of their paired comparisons (what `routebalance sim` prints)."""

from __future__ import annotations


def format_rows(rows: list[dict], latency: bool = False) -> str:
    """A compact text table of a sweep's main figures (± half the 95% interval where there is one).
    The SLO columns appear when some row's requests carry that SLO (the figure is not NaN), the decode TPOT
    ones on a mixture-of-experts pool or with `latency`."""
    extra = [(name, title, fmt, width) for name, title, fmt, width, gate in SLO_COLUMNS
             if any(gate in r and r[gate] == r[gate] for r in rows)
             or (latency and name.startswith("decode_tpot") and name in rows[0])]
    head = (f"{'system':<12} {'label':<50} {'req/s':>5} {'quality':>15} {'E2E':>14} {'p99':>7} {'thru':>6} "
            f"{'cost':>9} {'refused':>7} {'resid':>6}" + "".join(f" {title:>{w}}" for _, title, _, w in extra))
    lines = [head]
    for r in rows:
        lines.append(f"{r['system']:<12} {_named(r, rows)[:50]:<50} {r['rate']:>5g} {_pm(r, 'quality', '.4f'):>15} "
                     f"{_pm(r, 'e2e_mean', '.2f') + 's':>14} {r['e2e_p99']:>6.1f}s {r['throughput']:>6.2f} "
                     f"{r['cost_mean']:>9.2e} {r.get('refused', 0.0):>7.1%} {1000 * r['residual_mean']:>4.0f}ms"
                     + "".join(f" {_pm(r, name, fmt) if name in r else '':>{w}}" for name, _, fmt, w in extra))
    return "\n".join(lines)


# Cell tags that tell apart cells of one label (the SLO sweeps' workloads, the QoS sweep's pool size N and
# bound L, W_A's tail share, the arrival process).
TELLING_TAGS = (("workload", ""), ("n", "N="), ("tpot_slo_ms", "L="), ("tail", "tail "), ("pool", ""),
                ("tau", "tau="), ("arrivals", ""))


def _named(row: dict, rows: list[dict]) -> str:
    """The row's label, with the tags whose values differ among the rows of that label."""
    same = [r for r in rows if r["label"] == row["label"]]
    extra = [f"{prefix}{row[tag]:g}" if isinstance(row[tag], float | int) else f"{prefix}{row[tag]}"
             for tag, prefix in TELLING_TAGS if tag in row and len({str(r.get(tag)) for r in same}) > 1]
    return " ".join([row["label"], *extra])


# (figure, column title, format, width, gate): format_rows shows the column when some row's gate figure
# is a number, i.e. its requests carry that SLO (end to end: slo_attainment; time per token: qos), its
# pool has GPUs shared by several models (swaps), or mixture-of-experts instances (experts_per_step: the
# decode TPOT, first token to last, and the experts a step loads)
SLO_COLUMNS = (("slo_attainment", "SLO met", ".3f", 13, "slo_attainment"), ("qos", "QoS", ".4f", 15, "qos"),
               ("tpot_mean", "TPOT (s)", ".4f", 15, "qos"), ("swaps", "swaps", ".0f", 6, "swaps"),
               ("decode_tpot_p50", "TPOT p50 (s)", ".4f", 15, "experts_per_step"),
               ("decode_tpot_p99", "TPOT p99 (s)", ".4f", 15, "experts_per_step"),
               ("experts_per_step", "experts", ".1f", 7, "experts_per_step"))


def format_pairs(pairs: list[dict]) -> str:
    """A text table of a sweep's paired comparisons: A - B with its paired 95% interval, and A / B - 1 where
    the pair asked for relative changes."""
    columns = [("quality_diff", "quality", "+.4f"), ("e2e_mean_diff", "mean E2E (s)", "+.2f"),
               ("slo_attainment_diff", "SLO attainment", "+.3f"), ("qos_diff", "QoS", "+.4f"),
               ("quality_rel", "quality, relative", "+.1%"), ("e2e_mean_rel", "mean E2E, relative", "+.1%"),
               ("e2e_p90_rel", "p90 E2E, relative", "+.1%"),
               ("decode_tpot_p50_rel", "median TPOT, relative", "+.1%"),
               ("decode_tpot_p99_rel", "p99 TPOT, relative", "+.1%")]
    shown = [c for c in columns if any(c[0] in p for p in pairs)]
    lines = [f"{'A - B':<58} " + " ".join(f"{title:>27}" for _, title, _ in shown)]
    for p in pairs:
        lines.append(f"{p['pair'][:58]:<58} " + " ".join(
            f"{_diff(p, key, fmt) if key in p else '':>27}" for key, _, fmt in shown))
    return "\n".join(lines)


def duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _pm(row: dict, name: str, fmt: str) -> str:
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    if lo is None or lo != lo:  # no interval, or NaN
        return format(row[name], fmt)
    return f"{row[name]:{fmt}}±{(hi - lo) / 2:{fmt}}"


def _diff(pair: dict, key: str, fmt: str) -> str:
    return f"{pair[key]:{fmt}} [{pair[f'{key}_lo']:{fmt}}, {pair[f'{key}_hi']:{fmt}}]"
