"""PNG pictures of the sweeps (matplotlib, no screen needed)."""

from __future__ import annotations

import importlib.util
from collections import defaultdict
from pathlib import Path


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


def _by_system(rows):
    out = defaultdict(list)
    for r in rows:
        out[r["system"]].append(r)
    return out


def _scatter(ax, rows, x: str, y: str) -> None:
    for system, rs in _by_system(rows).items():
        ax.scatter([r[x] for r in rs], [r[y] for r in rs], c=COLOURS.get(system, "k"),
                   marker=MARKERS.get(system, "."), label=system, alpha=0.8)


def _label_rb(ax, rows, x: str, y: str) -> None:
    for r in rows:
        if r["system"] == "routebalance":
            ax.annotate(r["label"], (r[x], r[y]), fontsize=7, xytext=(3, 3), textcoords="offset points")


def frontier(rows: list[dict], out_dir: Path) -> list[Path]:
    paths = []
    at12 = [r for r in rows if r["rate"] == 12]
    fig, axes = _pyplot().subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    _scatter(ax, at12, "e2e_mean", "quality")
    _label_rb(ax, at12, "e2e_mean", "quality")
    ax.set(xlabel="mean E2E (s)", ylabel="mean quality", title="(a) quality vs latency at 12 req/s")
    ax.legend()

    ax = axes[0][1]
    series = {("routebalance", "uniform"): "-", ("routebalance", "quality"): "--", ("routebalance", "cost"): ":"}
    for (system, label), style in series.items():
        rs = sorted((r for r in rows if r["system"] == system and r["label"] == label), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in rs], [r["e2e_mean"] for r in rs], style, c=COLOURS[system],
                marker="o", label=f"RouteBalance {label}")
    for system in ("avengers", "best_route", "passthrough", "single_model"):
        best = _peak_quality_label(rows, system)
        rs = sorted((r for r in rows if r["system"] == system and r["label"] == best), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in rs], [r["e2e_mean"] for r in rs], c=COLOURS[system],
                marker=MARKERS[system], label=f"{system} {best} (its peak quality)")
    ax.set_yscale("log")
    ax.set(xlabel="offered load (req/s)", ylabel="mean E2E (s, log)", title="(b) latency under load")
    ax.legend(fontsize=7)

    ax = axes[1][0]
    _scatter(ax, rows, "throughput", "quality")
    ax.set(xlabel="completed req/s", ylabel="mean quality", title="(c) quality vs throughput, all rates")

    ax = axes[1][1]
    _scatter(ax, rows, "cost_mean", "quality")
    ax.set(xlabel="mean cost per request (USD)", ylabel="mean quality", title="(d) quality vs cost, all rates")
    ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    fig.tight_layout()
    paths.append(_save(fig, out_dir / "frontier.png"))
    return paths


def _peak_quality_label(rows, system: str) -> str:
    at12 = [r for r in rows if r["system"] == system and r["rate"] == 12] or [r for r in rows if r["system"] == system]
    return max(at12, key=lambda r: r["quality"])["label"]


def by_rate(rows: list[dict], out_dir: Path, name: str, title: str) -> list[Path]:
    """Mean E2E against offered load, one line per label (arms, batching)."""
    fig, ax = _pyplot().subplots(figsize=(7, 4.5))
    labels = list(dict.fromkeys(r["label"] for r in rows))
    for label in labels:
        rs = sorted((r for r in rows if r["label"] == label), key=lambda r: r["rate"])
        ax.plot([r["rate"] for r in rs], [r["e2e_mean"] for r in rs], marker="o", label=label)
    ax.set(xlabel="offered load (req/s)", ylabel="mean E2E (s)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return [_save(fig, out_dir / f"{name}.png")]


def _save(fig, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    _pyplot().close(fig)
    return path


def plot_sweep(name: str, rows: list[dict], out_dir: Path) -> list[Path]:
    require_matplotlib()
    if name == "frontier":
        return frontier(rows, out_dir)
    if name == "arms":
        return by_rate(rows, out_dir, name, "Isolation arms at uniform weights")
    if name == "batching":
        return by_rate(rows, out_dir, name, "Batching ablation at uniform weights")
    return []  # budget and robustness are tables
