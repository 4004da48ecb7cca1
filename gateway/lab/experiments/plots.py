"""PNG pictures of the sweeps (matplotlib, no screen needed).

Every point carries its 95% interval from the row's `<figure>_lo` / `<figure>_hi`
columns (error bars on points and bars, shaded bands on curves); a row
without them (one seed of an older table) is drawn without.
"""

from __future__ import annotations

import importlib.util
import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def require_matplotlib() -> None:
    """Raise ValueError naming the install command when matplotlib (the `eval` extra) is missing."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError("plotting needs matplotlib: pip install 'routebalance-gateway[eval]' "
                         "(from a source checkout: pip install -e '.[eval]')")


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no screen), imported on first use: it is the `eval` extra."""
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")  # chosen before pyplot is imported
    import matplotlib.pyplot

    return matplotlib.pyplot


COLOURS = {"routebalance": "tab:blue", "avengers": "tab:orange", "best_route": "tab:green",
           "passthrough": "tab:grey", "single_model": "tab:red"}
MARKERS = {"routebalance": "o", "avengers": "s", "best_route": "^", "passthrough": "x", "single_model": "D"}
STYLES = ("-", "--", ":", "-.")  # line styles of the series of one system


# ---- intervals -------------------------------------------------------------------------------

def _bounds(row: dict, name: str) -> tuple[float, float]:
    """The row's 95% interval of a figure; the figure itself at both ends when it has none."""
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    if lo is None or hi is None or math.isnan(lo) or math.isnan(hi):
        return row[name], row[name]
    return lo, hi


def _err(rows: list[dict], name: str) -> np.ndarray:
    """matplotlib's asymmetric error bars (2 x n: below, above) from the rows' intervals."""
    spans = [(r[name] - lo, hi - r[name]) for r in rows for lo, hi in [_bounds(r, name)]]
    return np.nan_to_num(np.array(spans, dtype=float).reshape(-1, 2).T)


def _band(ax, rows: list[dict], x: str, y: str, colour, style: str = "-", label: str | None = None,
          marker: str = "o") -> None:
    """A curve of y against x with its interval shaded."""
    rows = sorted(rows, key=lambda r: r[x])
    xs = [r[x] for r in rows]
    ax.plot(xs, [r[y] for r in rows], style, c=colour, marker=marker, label=label)
    lows, highs = zip(*(_bounds(r, y) for r in rows), strict=True)
    ax.fill_between(xs, lows, highs, color=colour, alpha=0.15, linewidth=0)


def _log_scale(axis) -> None:
    """A log axis labelled in plain seconds (2, 5, 10, 20) rather than powers of ten."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    set_scale = axis.axes.set_xscale if axis.axis_name == "x" else axis.axes.set_yscale
    set_scale("log")
    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _by(rows, key: str) -> dict:
    out = defaultdict(list)
    for r in rows:
        out[r[key]].append(r)
    return out


def _scatter(ax, rows, x: str, y: str, legend: bool = True) -> None:
    """Every row as a point with error bars in both directions, one colour and marker per system."""
    for system, rs in _by(rows, "system").items():
        ax.errorbar([r[x] for r in rs], [r[y] for r in rs], xerr=_err(rs, x), yerr=_err(rs, y), fmt=MARKERS.get(
            system, "."), c=COLOURS.get(system, "k"), label=system if legend else None, alpha=0.8, capsize=2,
            elinewidth=0.8, markersize=5)


def _label_rb(ax, rows, x: str, y: str) -> None:
    for r in rows:
        if r["system"] == "routebalance":
            ax.annotate(r["label"], (r[x], r[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")


# ---- the sweeps -------------------------------------------------------------------------------

def frontier(rows: list[dict], out_dir: Path) -> list[Path]:
    """(a, b) quality against latency with every system at the two full rates, (c) the load curve of the
    headline cells, (d) quality against cost."""
    fig, axes = _pyplot().subplots(2, 2, figsize=(13, 10))
    full = _full_rates(rows)
    for ax, rate, tag in zip(axes[0], full[:2], "ab", strict=False):
        at = [r for r in rows if r["rate"] == rate]
        _scatter(ax, at, "e2e_mean", "quality")
        _label_rb(ax, at, "e2e_mean", "quality")
        _log_scale(ax.xaxis)
        ax.set(xlabel="mean E2E (s, log)", ylabel="mean quality", title=f"({tag}) quality vs latency at {rate:g} req/s")
        ax.legend(fontsize=7)

    ax = axes[1][0]
    per_system: dict[str, int] = defaultdict(int)  # series drawn so far per system: the next line style
    curves = _load_curves(rows)
    for (system, label), rs in curves.items():
        style = STYLES[per_system[system] % len(STYLES)]
        per_system[system] += 1
        _band(ax, rs, "rate", "e2e_mean", COLOURS.get(system, "k"), style, f"{system} {label}",
              MARKERS.get(system, "o"))
    _log_scale(ax.yaxis)
    ax.set(xlabel="offered load (req/s)", ylabel="mean E2E (s, log)", title="(c) latency under load (95% bands)")
    if curves:
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=3)  # below: curves fill the axes

    ax = axes[1][1]
    at = [r for r in rows if r["rate"] == (full[0] if full else r["rate"])]
    _scatter(ax, at, "cost_mean", "quality")
    ax.set(xlabel="mean cost per request (USD)", ylabel="mean quality",
           title=f"(d) quality vs cost at {full[0]:g} req/s" if full else "(d) quality vs cost")
    ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    fig.tight_layout()
    return [_save(fig, out_dir / "frontier.png")]


def _full_rates(rows: list[dict]) -> list[float]:
    """The rates at which the most cells ran (every system), lowest first."""
    counts = {rate: len(rs) for rate, rs in _by(rows, "rate").items()}
    most = max(counts.values())
    return sorted(rate for rate, n in counts.items() if n == most)


def _load_curves(rows: list[dict]) -> dict[tuple[str, str], list[dict]]:
    """The cells run at three rates or more (the headline cells of the load curve)."""
    series = defaultdict(list)
    for r in rows:
        series[r["system"], r["label"]].append(r)
    return {key: rs for key, rs in series.items() if len(rs) >= 3}


def by_rate(rows: list[dict], out_dir: Path, name: str, title: str) -> list[Path]:
    """Mean E2E and quality against offered load, one banded line per label (arms, batching)."""
    fig, axes = _pyplot().subplots(1, 2, figsize=(13, 4.8))
    for k, (label, rs) in enumerate(_by(rows, "label").items()):
        colour = f"C{k % 10}"
        _band(axes[0], rs, "rate", "e2e_mean", colour, label=label)
        _band(axes[1], rs, "rate", "quality", colour, label=label)
    axes[0].set(xlabel="offered load (req/s)", ylabel="mean E2E (s)", title=f"{title}: latency")
    axes[1].set(xlabel="offered load (req/s)", ylabel="mean quality", title=f"{title}: quality")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    return [_save(fig, out_dir / f"{name}.png")]


def budget(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per budget share and arm: quality, cost, and how many budgets ran out (refused or cut short)."""
    fig, axes = _pyplot().subplots(1, 3, figsize=(15, 4.6))
    labels = _by(rows, "label")
    for k, (label, rs) in enumerate(labels.items()):
        rs = sorted(rs, key=lambda r: r["budget_share"])
        shares = [r["budget_share"] + 0.006 * (k - (len(labels) - 1) / 2) for r in rs]  # side by side, not on top
        colour = f"C{k % 10}"
        for ax, figure in ((axes[0], "quality"), (axes[1], "cost_mean")):
            ax.errorbar(shares, [r[figure] for r in rs], yerr=_err(rs, figure), c=colour, marker="o", capsize=3,
                        label=label)
        axes[2].errorbar(shares, [r["budget_exhaustion"] for r in rs], yerr=_err(rs, "budget_exhaustion"), c=colour,
                         marker="o", capsize=3, label=f"{label}: exhausted")
        axes[2].errorbar(shares, [r["refused"] for r in rs], yerr=_err(rs, "refused"), c=colour, marker="x",
                         linestyle="--", capsize=3, label=f"{label}: refused")
    axes[0].set(xlabel="share of requests with a budget", ylabel="mean quality", title="quality")
    axes[1].set(xlabel="share of requests with a budget", ylabel="mean cost per request (USD)", title="cost")
    axes[1].ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
    axes[2].set(xlabel="share of requests with a budget", ylabel="share",
                title="budget exhaustion: budgeted requests refused or cut short (solid),\n"
                      "and refusals among all requests (dashed)")
    axes[2].title.set_fontsize(10)
    axes[0].legend(fontsize=8)
    axes[2].legend(fontsize=6)
    fig.tight_layout()
    return [_save(fig, out_dir / "budget.png")]


def robustness(rows: list[dict], out_dir: Path) -> list[Path]:
    """Mean E2E and quality of each system under each arrival process, and with the 72B tier down."""
    fig, axes = _pyplot().subplots(1, 2, figsize=(14, 5))
    groups = list(dict.fromkeys(_condition(r) for r in rows))
    systems = list(dict.fromkeys((r["system"], r["label"]) for r in rows))
    width = 0.8 / len(systems)
    for k, (system, label) in enumerate(systems):
        rs = {_condition(r): r for r in rows if (r["system"], r["label"]) == (system, label)}
        xs = [g + (k - (len(systems) - 1) / 2) * width for g, c in enumerate(groups) if c in rs]
        present = [rs[c] for c in groups if c in rs]
        for ax, figure in ((axes[0], "e2e_mean"), (axes[1], "quality")):
            ax.bar(xs, [r[figure] for r in present], width, yerr=_err(present, figure), capsize=3,
                   color=f"C{k % 10}", label=f"{system} {label}")
    for ax, ylabel in ((axes[0], "mean E2E (s)"), (axes[1], "mean quality")):
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set(ylabel=ylabel)
    axes[0].set(title="latency by arrival process (95% intervals)")
    axes[1].set(title="quality by arrival process")
    axes[1].set_ylim(bottom=min((r["quality"] for r in rows), default=0) * 0.9)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(systems), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    return [_save(fig, out_dir / "robustness.png")]


def slo_bars(rows: list[dict], out_dir: Path, name: str) -> list[Path]:
    """SLO attainment and mean E2E (and throughput, when the sweep varies the model mix) of each system
    per workload and load (the SLO sweeps)."""
    figures = [("slo_attainment", "SLO attainment"), ("e2e_mean", "mean E2E (s)")]
    if any("tail" in r for r in rows):
        figures.append(("throughput", "throughput (req/s)"))
    fig, axes = _pyplot().subplots(1, len(figures), figsize=(7.5 * len(figures), 5))

    def group(r: dict) -> str:
        tail = f", tail {r['tail']:.0%}" if "tail" in r else ""
        return f"{r['workload']}\n@{r['rate']:g} req/s{tail}"

    groups = list(dict.fromkeys(group(r) for r in rows))
    systems = list(dict.fromkeys(r["label"] for r in rows))
    width = 0.8 / len(systems)
    for k, label in enumerate(systems):
        rs = {group(r): r for r in rows if r["label"] == label}
        xs = [g + (k - (len(systems) - 1) / 2) * width for g, c in enumerate(groups) if c in rs]
        present = [rs[c] for c in groups if c in rs]
        for ax, (figure, _) in zip(axes, figures, strict=True):
            ax.bar(xs, [r[figure] for r in present], width, yerr=_err(present, figure), capsize=3,
                   color=f"C{k % 10}", label=label)
    for ax, (_, ylabel) in zip(axes, figures, strict=True):
        ax.set_xticks(range(len(groups)), groups, fontsize=8)
        ax.set(ylabel=ylabel, xlim=(-0.5, len(groups) - 0.5))
    e2e = [r["e2e_mean"] for r in rows if r["e2e_mean"] > 0]
    if e2e and max(e2e) > 50 * min(e2e):
        _log_scale(axes[1].yaxis)  # seconds and tens of minutes side by side
    axes[0].set(title="share of requests served within their SLO (95% intervals)")
    axes[0].set_ylim(bottom=min((r["slo_attainment"] for r in rows), default=0) * 0.9, top=1.0)
    axes[1].set(title="mean end-to-end latency")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(systems), 4), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    return [_save(fig, out_dir / f"{name}.png")]


def qos_curves(rows: list[dict], out_dir: Path) -> list[Path]:
    """The QoS sweep: mean QoS against pool size N (at the headline bound) and against the bound L
    (at the headline N), per system, Poisson and bursty arrivals side by side."""
    from gateway.lab.experiments.qos_eval import HEADLINE_MS, HEADLINE_N

    arrivals = list(dict.fromkeys(r["arrivals"] for r in rows))
    fig, axes = _pyplot().subplots(2, len(arrivals), figsize=(6.5 * len(arrivals), 9), squeeze=False)
    systems = list(dict.fromkeys(r["label"] for r in rows))
    for col, arr in enumerate(arrivals):
        for k, label in enumerate(systems):
            mine = [r for r in rows if r["label"] == label and r["arrivals"] == arr]
            style = STYLES[0] if label.startswith("qos") else STYLES[1]
            _band(axes[0][col], [r for r in mine if r["tpot_slo_ms"] == HEADLINE_MS], "n", "qos", f"C{k % 10}",
                  style, label)
            _band(axes[1][col], [r for r in mine if r["n"] == HEADLINE_N], "tpot_slo_ms", "qos", f"C{k % 10}",
                  style, label)
        axes[0][col].set(title=f"{arr}: L = {HEADLINE_MS:g} ms", xlabel="instances N", ylabel="mean QoS")
        axes[1][col].set(title=f"{arr}: N = {HEADLINE_N}", xlabel="bound L on time per output token (ms)",
                         ylabel="mean QoS")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=min(len(systems), 6), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    return [_save(fig, out_dir / "qos.png")]


STALENESS_FIGURES = (("quality", "mean quality", -1), ("e2e_mean", "mean E2E", 1), ("e2e_p90", "p90 E2E", 1))
THRESHOLD = 0.02  # the change that counts: 2% less quality or 2% more latency


def staleness(pairs: list[dict], out_dir: Path) -> list[Path]:
    """The staleness sweep: each figure's change against one replica, in %, against the delay with which the
    replicas read each other's work (banded, one curve per load); instant sharing on the left and none at all
    on the right as the bounds; the 2% line on the side where a change hurts."""
    fig, axes = _pyplot().subplots(1, len(STALENESS_FIGURES), figsize=(6.5 * len(STALENESS_FIGURES), 5.2))
    periodic = [p for p in pairs if p.get("sharing") == "periodic"]
    delays = sorted({p["staleness_ms"] for p in periodic})
    sync = periodic[0]["sync_ms"] if periodic else None
    # The x axis, evenly spaced: instant sharing, each delay, no sharing.
    ticks = ["instant", *(f"{d:g}" for d in delays), "not\nshared"]
    x_of = {("instant", None): 0, ("none", None): len(delays) + 1,
            **{("periodic", d): k + 1 for k, d in enumerate(delays)}}
    loads = list(dict.fromkeys((p.get("workload", ""), p["rate"]) for p in pairs))
    width = 0.25 / max(len(loads), 1)  # loads side by side at each x
    spans: list[list[float]] = [[] for _ in STALENESS_FIGURES]  # what each panel's y axis must show
    far: list[list[tuple[float, float, str]]] = [[] for _ in STALENESS_FIGURES]  # bounds beyond it: (x, y, colour)
    for k, (workload, rate) in enumerate(loads):
        colour, shift = f"C{k % 10}", (k - (len(loads) - 1) / 2) * width
        at = sorted((p for p in pairs if (p.get("workload", ""), p["rate"]) == (workload, rate)
                     and (p.get("sharing"), p.get("staleness_ms") if p.get("sharing") == "periodic" else None) in x_of),
                    key=lambda p: _x(x_of, p))
        curve = [p for p in at if p.get("sharing") == "periodic"]
        bounds = [p for p in at if p.get("sharing") != "periodic"]
        label = f"{workload}, {rate:g} req/s" if workload else f"{rate:g} req/s"
        for n, (ax, (figure, _, _)) in enumerate(zip(axes, STALENESS_FIGURES, strict=True)):
            spans[n] += [100 * p[f"{figure}_rel{end}"] for p in curve for end in ("_lo", "_hi")]
            xs = [_x(x_of, p) + shift for p in curve]
            ys = [100 * p[f"{figure}_rel"] for p in curve]
            ax.plot(xs, ys, "-o", c=colour, label=label, markersize=4)
            ax.fill_between(xs, [100 * p[f"{figure}_rel_lo"] for p in curve],
                            [100 * p[f"{figure}_rel_hi"] for p in curve], color=colour, alpha=0.15, linewidth=0)
            rows = [{"y": 100 * p[f"{figure}_rel"], "y_lo": 100 * p[f"{figure}_rel_lo"],
                     "y_hi": 100 * p[f"{figure}_rel_hi"]} for p in bounds]
            ax.errorbar([_x(x_of, p) + shift for p in bounds], [r["y"] for r in rows], yerr=_err(rows, "y"),
                        fmt="s", c=colour, capsize=3, markersize=5)
            far[n] += [(_x(x_of, p) + shift, r["y"], colour) for p, r in zip(bounds, rows, strict=True)]
    for n, (ax, (_, title, worse)) in enumerate(zip(axes, STALENESS_FIGURES, strict=True)):
        # The axis shows the curves and the 2% line; a bound far beyond them is written at the edge.
        low = min([*spans[n], -2 * 100 * THRESHOLD]) - 1
        high = max([*spans[n], 2 * 100 * THRESHOLD]) + 1
        ax.set_ylim(low, high)
        for x, y, colour in far[n]:
            if not low <= y <= high:
                edge = high if y > high else low
                ax.annotate(f"{y:+.1f}%", (x, edge), xytext=(x, edge - 0.12 * (high - low) * (1 if y > high else -1)),
                            ha="center", fontsize=8, color=colour, arrowprops={"arrowstyle": "->", "color": colour})
        ax.axhline(0, c="k", lw=0.6)
        ax.axhline(100 * THRESHOLD * worse, c="tab:red", ls="-.", lw=1, label=f"{THRESHOLD:.0%} worse")
        ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
        ax.set(xlabel="how the 3 replicas share their work: Δ in ms, from a publication to the others' read",
               ylabel=f"{title} against 1 replica (%)", title=f"{title}: change (95% paired intervals)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    head = "Gateway replicas behind a round-robin balancer, against one gateway (same prompts and arrivals)"
    if sync is not None:
        head += (f". Each publishes its in-flight work every {sync:g} ms, so the others' work a replica counts is "
                 f"Δ to Δ + {2 * sync:g} ms old, Δ + {sync:g} ms on average")
    fig.suptitle(head, fontsize=10)
    fig.tight_layout(rect=(0, 0.06, 1, 0.96))
    return [_save(fig, out_dir / "staleness.png")]


BALANCER_COLOURS = {"round_robin": "tab:orange", "shortest_queue": "tab:green", "power_of_two": "tab:red"}
ELDR_FIGURES = (("decode_tpot_p50", "median TPOT (ms)", 1000), ("decode_tpot_p99", "p99 TPOT (ms)", 1000),
                ("e2e_mean", "mean E2E (s)", 1), ("experts_per_step", "experts loaded per layer and step", 1))


def _scaled(rows: list[dict], name: str, scale: float) -> list[dict]:
    """Rows with `y` (and its interval) = the figure x scale."""
    out = []
    for r in rows:
        lo, hi = _bounds(r, name) if name in r else (math.nan, math.nan)
        out.append({**r, "y": scale * r.get(name, math.nan), "y_lo": scale * lo, "y_hi": scale * hi})
    return out


# ELDR's arms (each signature, the baselines that place requests by domain or cluster): solid lines.
ELDR_COLOURS = {"eldr": "tab:blue", "eldr count-idf": "tab:cyan", "domain oracle": "tab:purple",
                "plain k-means": "tab:brown"}


def _eldr_series(rows: list[dict]) -> dict[str, list[dict]]:
    """Each ELDR arm's rows (at its tau) and each load balancer's, by the name they are drawn under."""
    series: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        series[f"{r['label']}, tau={r['tau']:g}" if r["label"] in ELDR_COLOURS else r["label"]].append(r)
    return series


def _eldr_style(name: str) -> tuple[str, str]:
    arm = name.split(", tau=")[0]
    return (ELDR_COLOURS[arm], "-") if arm in ELDR_COLOURS else (BALANCER_COLOURS.get(name, "k"), "--")


def eldr(rows: list[dict], out_dir: Path) -> list[Path]:
    """ELDR's sweep: eldr.png, each system's TPOT (median, p99), mean E2E and experts per step against the
    load on the MoE pool; eldr_tau.png, the same figures against tau at one load, on the pool's usual mix and
    with the mix shifted, the load balancers as flat references."""
    from gateway.lab.experiments.eldr_eval import TAU, TAU_RATE

    plt = _pyplot()
    # the usual mix (pool moe, and its count-IDF and domain-oracle signatures), each arm at its headline tau
    curve = [r for r in rows if r["pool"].split("/")[0] == "moe"
             and ((r["label"] in ELDR_COLOURS and r["tau"] == TAU) or r["system"] == "passthrough")]
    fig, axes = plt.subplots(1, len(ELDR_FIGURES), figsize=(5.2 * len(ELDR_FIGURES), 5.2))
    for name, series in _eldr_series(curve).items():
        colour, style = _eldr_style(name)
        for ax, (figure, title, scale) in zip(axes, ELDR_FIGURES, strict=True):
            if any(figure in r for r in series):
                _band(ax, _scaled(series, figure, scale), "rate", "y", colour, style, name)
            ax.set(xlabel="arrivals (req/s) over 8 instances", title=title)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=(len(labels) + 1) // 2, fontsize=9,
               bbox_to_anchor=(0.5, 0.94))
    fig.suptitle("ELDR's arms against load balancers on the mixture-of-experts pool (8 x Qwen3-30B-A3B shape); 95% "
                 "intervals", fontsize=10, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.82))
    paths = [_save(fig, out_dir / "eldr.png")]

    # eldr_tau.png: one row per world (moe and its signature pools: the kind+subdomain world; moe-kind: the
    # kind-only world), each signature's tau curve, and every other system as a flat reference at its own setting
    at = [r for r in rows if r["rate"] == TAU_RATE]
    mixes = list(dict.fromkeys(r["pool"].split("/")[0] for r in at))
    taus = sorted({r["tau"] for r in at if r["label"] in ELDR_COLOURS})
    fig, axes = plt.subplots(len(mixes), 3, figsize=(16, 4.4 * len(mixes)), squeeze=False)
    for row_axes, mix in zip(axes, mixes, strict=True):
        mine = [r for r in at if r["pool"].split("/")[0] == mix]
        arms = defaultdict(list)
        for r in mine:
            arms[r["label"]].append(r)
        for ax, (figure, title, scale) in zip(row_axes, ELDR_FIGURES[:3], strict=True):
            for label, arm in arms.items():
                colour, style = _eldr_style(label)
                points = _scaled(sorted(arm, key=lambda r: r["tau"] if r["tau"] == r["tau"] else 0.0), figure, scale)
                if len(points) > 1:  # a tau curve
                    ax.errorbar([taus.index(r["tau"]) for r in points], [q["y"] for q in points],
                                yerr=_err(points, "y"), fmt="-o", c=colour, capsize=3, label=label)
                    continue
                ax.axhline(points[0]["y"], c=colour, ls=style if style == "--" else ":", lw=1, label=label)
                ax.axhspan(points[0]["y_lo"], points[0]["y_hi"], color=colour, alpha=0.08, lw=0)
            ax.set_xticks(range(len(taus)), [f"{t:g}" for t in taus])
            ax.set(xlabel="tau (0: nearest centroid only; 1: shortest queue)", title=f"{mix}: {title}")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=(len(labels) + 1) // 2, fontsize=9,
               bbox_to_anchor=(0.5, 0.965))
    fig.suptitle(f"ELDR's locality band at {TAU_RATE:g} req/s: moe, the kind+subdomain world; moe-kind, the kind-only "
                 "world; the flat lines are the other systems at their own setting; 95% intervals", fontsize=10,
                 y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return [*paths, _save(fig, out_dir / "eldr_tau.png")]


def _x(x_of: dict, pair: dict) -> int:
    sharing = pair.get("sharing")
    return x_of[sharing, pair["staleness_ms"] if sharing == "periodic" else None]


def _condition(row: dict) -> str:
    """The arrival process, and which tiers were down, on two lines (x tick labels)."""
    if not row.get("down"):
        return row["arrivals"]
    return f"{row['arrivals']}\n{', '.join(m.split('/')[-1] for m in row['down'].split(','))} down"


PROGRESSIVE_COLOURS = {"cloud-only": "tab:red", "progressive": "tab:blue", "routing": "tab:grey",
                       "progressive + routing": "tab:purple", "progressive, any length": "tab:cyan"}


def progressive(rows: list[dict], out_dir: Path) -> list[Path]:
    """PICE's sweep: progressive.png, mean E2E and TTFT against the load for each system, and each one's
    throughput and mean cost under the burst."""
    plt = _pyplot()
    curve = [r for r in rows if r["load"] == "curve"]
    burst = [r for r in rows if r["load"] == "burst"]
    fig, axes = plt.subplots(1, 4, figsize=(21, 5.2))
    for label in dict.fromkeys(r["label"] for r in rows):
        colour = PROGRESSIVE_COLOURS.get(label, "k")
        mine = [r for r in curve if r["label"] == label]
        for ax, figure in zip(axes[:2], ("e2e_mean", "ttft_mean"), strict=True):
            _band(ax, mine, "rate", figure, colour, "-" if label.startswith("progressive") else "--", label)
    axes[0].set(xlabel="arrivals (req/s)", ylabel="s", title="mean end-to-end latency")
    axes[1].set(xlabel="arrivals (req/s)", ylabel="s", title="mean time to first token (streamed)")
    labels = [r["label"] for r in burst]
    colours = [PROGRESSIVE_COLOURS.get(label, "k") for label in labels]
    for ax, figure, scale, title in ((axes[2], "throughput", 1.0, f"throughput under a burst of "
                                      f"{burst[0]['rate']:g} req/s (req/s)" if burst else "throughput"),
                                     (axes[3], "cost_mean", 1e6, "mean cost per request (micro-USD)")):
        points = _scaled(burst, figure, scale)
        ax.bar(range(len(points)), [p["y"] for p in points], yerr=_err(points, "y"), color=colours, capsize=3)
        ax.set_xticks(range(len(points)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(title)
    handles, names = axes[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper center", ncol=len(names), fontsize=9, bbox_to_anchor=(0.5, 0.95))
    fig.suptitle("Progressive mode (PICE) against normal routing on the default pool; 95% intervals", fontsize=10,
                 y=0.995)
    fig.tight_layout(rect=(0, 0, 1, 0.88))
    return [_save(fig, out_dir / "progressive.png")]


def labelled(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per load on a labelled file: every cell's correctness against its cost, the single models' upper hull
    as a line, and mean E2E against load for each system."""
    from gateway.estimators.crossfit import upper_hull

    loads = sorted({r["load"] for r in rows})
    fig, axes = _pyplot().subplots(1, len(loads) + 1, figsize=(5.2 * (len(loads) + 1), 4.8))
    palette = _pyplot().get_cmap("tab20")  # more systems than the ten default colours
    systems = {key: palette(k % 20) for k, key in enumerate(dict.fromkeys((r["system"], r["label"]) for r in rows))}
    for ax, load in zip(axes, loads, strict=False):
        here = [r for r in rows if r["load"] == load]
        for r in here:
            colour = systems[r["system"], r["label"]]
            ax.errorbar(1000 * r["cost_mean"], r["quality"], yerr=_err([r], "quality"), c=colour,
                        marker="s" if r["system"] == "single_model" else "o", capsize=3)
            ax.annotate(r["label"], (1000 * r["cost_mean"], r["quality"]), fontsize=6, xytext=(3, 3),
                        textcoords="offset points")
        hull = upper_hull([(1000 * r["cost_mean"], r["quality"]) for r in here if r["system"] == "single_model"])
        ax.plot(*zip(*hull, strict=True), c="grey", linestyle="--", linewidth=1)
        ax.set(xlabel="USD per 1k requests", ylabel="mean correct",
               title=f"{load:.0%} of capacity ({here[0]['rate']:g} req/s)")
    for (system, label), colour in systems.items():
        _band(axes[-1], [r for r in rows if (r["system"], r["label"]) == (system, label)], "rate", "e2e_mean",
              colour, label=label)
    axes[-1].set(xlabel="offered load (req/s)", ylabel="mean E2E (s)", yscale="log", title="latency")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    return [_save(fig, out_dir / "labelled.png")]


def prefix(rows: list[dict], out_dir: Path) -> list[Path]:
    """Per prompt source (a row of panels): mean TTFT, p99 TTFT and prefix hit rate against load, one banded line
    per cell label (RouteBalance's prefix modes and the baselines, alone and within RouteBalance's model)."""
    sources = _by(rows, "prompts")
    fig, axes = _pyplot().subplots(len(sources), 3, figsize=(15, 4.4 * len(sources)), squeeze=False)
    palette = _pyplot().get_cmap("tab20")  # more cells than the ten default colours
    for row, (source, rs) in zip(axes, sources.items(), strict=True):
        for k, (label, cells) in enumerate(_by(rs, "label").items()):
            for ax, figure in zip(row, ("ttft_mean", "ttft_p99", "prefix_hit_rate"), strict=True):
                _band(ax, cells, "load", figure, palette(k % 20), label=label)
        row[0].set(xlabel="share of the pool's capacity", ylabel="mean TTFT (s)", title=f"{source}: mean TTFT")
        row[1].set(xlabel="share of the pool's capacity", ylabel="p99 TTFT (s)", title=f"{source}: p99 TTFT")
        row[2].set(xlabel="share of the pool's capacity", ylabel="share of prompt tokens from cache",
                   title=f"{source}: prefix hit rate")
        row[0].legend(fontsize=8)
    fig.tight_layout()
    return [_save(fig, out_dir / "prefix.png")]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_sweep(name: str, rows: list[dict], out_dir: Path, pairs: Sequence[dict] = ()) -> list[Path]:
    """The sweep's PNG (`pairs`: its paired comparisons, which some sweeps plot)."""
    require_matplotlib()
    if name == "frontier":
        return frontier(rows, out_dir)
    if name == "arms":
        return by_rate(rows, out_dir, name, "Isolation arms at uniform weights")
    if name == "batching":
        return by_rate(rows, out_dir, name, "Batching ablation at uniform weights")
    if name == "budget":
        return budget(rows, out_dir)
    if name == "robustness":
        return robustness(rows, out_dir)
    if name in ("qlm", "qlm_cap", "qlm_multi"):
        return slo_bars(rows, out_dir, name)
    if name == "qos":
        return qos_curves(rows, out_dir)
    if name == "staleness":
        return staleness(list(pairs), out_dir)
    if name == "eldr":
        return eldr(rows, out_dir)
    if name == "progressive":
        return progressive(rows, out_dir)
    if name == "labelled":
        return labelled(rows, out_dir)
    if name == "prefix":
        return prefix(rows, out_dir)
    return []
