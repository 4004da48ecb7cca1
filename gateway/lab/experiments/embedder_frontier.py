"""The synthetic half of the faster-embedder rule: RouteBalance's presets routed by estimators built with each option.

    python -m gateway.lab.experiments.embedder_frontier [--seeds 5] [--workers 2]

For each `[estimators]` option (fp32 at 256 tokens, the reference; fp32 at 128 tokens; int8 at 256) the
synthetic estimators are built by `train` with that option into a directory of their own (the config's
models_dir, suffixed with the option), the simulator's held-out prompts are estimated with them, and the
scheduler's compute is timed with them (a faster embedder also decides sooner: the simulator charges what
it measured). Then the frontier's preset cells (quality, uniform, cost and latency at 12 and 30 req/s) run on
each, on the same seeds, prompts and arrivals. Each option's cells are paired per request with the
reference's: quality and mean E2E, A - B with 95% bootstrap intervals. An option may become the default only
if every interval here and on the real labels (embedder_options.py) contains 0. Simulated world.

Writes loadtest/results/embedder_frontier.{json,csv}, _pairs.{json,csv} and _seeds.csv.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tempfile
from pathlib import Path

from gateway.lab.experiments.sweeps import (
    FULL_RATES,
    RB_WEIGHTS,
    Pair,
    SweepResult,
    _rb,
    compare,
    run_seeded,
    write_sweep,
)

REFERENCE = "fp32, 256 tokens"
OPTIONS = {REFERENCE: {}, "fp32, 128 tokens": {"max_tokens": 128}, "int8, 256 tokens": {"precision": "int8"}}
PRESETS = ("quality", "uniform", "cost", "latency")
REQUESTS = 2500


def option_config(text: str, models_dir: str, changes: dict) -> str:
    """The config TOML `text` with its [estimators] table's models_dir and `changes` set (the table must
    already name each key, as the built-in config does)."""
    head, sep, rest = text.partition("\n[estimators]\n")
    if not sep:
        raise ValueError("the config has no [estimators] table")
    table, nxt, tail = rest.partition("\n[")
    for key, value in {"models_dir": models_dir, **changes}.items():
        table, found = re.subn(rf"(?m)^{key} = .*$", f"{key} = {value!r}".replace("'", '"'), table)
        if found != 1:
            raise ValueError(f"[estimators] names {key} {found} times; expected once")
    return head + sep + table + nxt + tail


BUILT_WITH = ("max_tokens", "precision")  # the [estimators] keys a build depends on (threads do not)


def option_models_dir(base: str, changes: dict) -> str:
    """Where an option's estimators are built: the config's models_dir suffixed with the changes a build
    depends on ("models-precision-int8"); the base itself when there are none."""
    suffix = "-".join(f"{key}-{value}" for key, value in changes.items() if key in BUILT_WITH)
    return f"{base.rstrip('/')}-{suffix}" if suffix else base


def cells(option: str, n: int = REQUESTS, rates=FULL_RATES) -> list:
    return [dataclasses.replace(_rb(label, RB_WEIGHTS[label], rate, n), tags={"embedder": option})
            for rate in rates for label in PRESETS]


def pairs(rates=FULL_RATES) -> list[Pair]:
    return [Pair(f"{option} vs {REFERENCE}, {label} @{rate:g}", {"label": label, "rate": rate, "embedder": option},
                 {"label": label, "rate": rate, "embedder": REFERENCE})
            for option in OPTIONS if option != REFERENCE for rate in rates for label in PRESETS]


def run(config_path: Path, seeds: int, workers: int, requests: int = REQUESTS) -> SweepResult:
    """Every option's cells on `seeds` seeds, building each option's estimators first if needed."""
    from gateway.config.store import load_config

    base = load_config(config_path).estimators.models_dir
    text = config_path.read_text()
    results: list[SweepResult] = []
    with tempfile.TemporaryDirectory() as work:
        for k, (option, changes) in enumerate(OPTIONS.items()):
            path = config_path
            if changes:
                path = Path(work) / f"option{k}.toml"
                path.write_text(option_config(text, option_models_dir(base, changes), changes))
            print(f"{option}: {len(cells(option))} cells x {seeds} seeds", flush=True)
            results.append(run_seeded(cells(option, requests), str(path), requests, seeds=seeds, workers=workers))
    rows = [r for res in results for r in res.rows]
    arrays = [a for res in results for a in res.arrays]
    return SweepResult(rows, [r for res in results for r in res.seed_rows],
                       [compare(p, rows, arrays) for p in pairs()], arrays)


def main() -> None:
    from gateway.config.store import resolve_config_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, help="config TOML (default: as `routebalance` finds it)")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("loadtest/results"))
    args = parser.parse_args()
    result = run(args.config or resolve_config_path(), args.seeds, args.workers)
    for path in write_sweep(result, args.out, "embedder_frontier"):
        print(f"wrote {path}")
    for p in result.pairs:
        print(f"{p['pair']:<50} quality {p['quality_diff']:+.4f} [{p['quality_diff_lo']:+.4f}, "
              f"{p['quality_diff_hi']:+.4f}]  E2E {p['e2e_mean_diff']:+.3f} s [{p['e2e_mean_diff_lo']:+.3f}, "
              f"{p['e2e_mean_diff_hi']:+.3f}]")


if __name__ == "__main__":
    main()
