"""How far placement alone can take a prefix-sharing cell's time to first token: a floor under any router's.

    python -m gateway.lab.experiments.prefix_floor                      # the multi-turn mix, 30/60/90% load, 5 seeds
    python -m gateway.lab.experiments.prefix_floor --source trace --loads 0.6

For each load (a share of the pool's capacity on the source, as the prefix sweep measures it) and seed, RouteBalance
runs with the cache term off and on (`[scheduler] prefix_cache` "off" and "approximate"), as in the prefix sweep.
Per served request the floor is its own wait in the gateway (arrival to dispatch, as it ran) plus its time to first
token on an idle engine of the instance it ran on that holds exactly the request's ceiling prefix: the longest run
of its leading blocks that any earlier request had (what one unbounded cache serving everything would hold). No
placement on the models this run chose, after the same gateway wait, does better than that for a request: it cannot
hit more than the ceiling, and an engine with nothing running has no step in flight to wait for and no batch sharing
its first step.
The floor leaves the model choices as they are; a router choosing faster models would move quality and cost.

Printed per load and mode (means over the seeds; intervals paired per request, 95% bootstrap over seeds and requests):
mean TTFT and its floor, each relative to the cache term off's mean TTFT; the prefix hit rate against the ceiling;
what lies between TTFT and floor (the step in flight and the running batch's share of the first step, plus any
queue); and the share of requests whose instance had another request in flight when theirs was dispatched.
--out writes one CSV row per load and mode (loadtest/results/prefix_floor.csv).
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

import numpy as np

from gateway.config.store import load_config, resolve_config_path
from gateway.core.engine.engine import Engine
from gateway.lab.emulator.settings import engine_for
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.prefixed_cells import PrefixedRows, PrefixSource, prefixed_rows
from gateway.lab.sim.simulator import CellResult, CellSpec, run_cell
from gateway.lab.sim.stats import bootstrap_mean, differences

MODES = ("off", "approximate")
_IDLE_S = 1e4  # long enough for any one request on an idle engine: advancing this far leaves it idle


def ceiling_blocks(prefix: tuple[tuple[int, ...], ...]) -> list[int]:
    """Per request in arrival order, how many of its leading blocks appeared in an earlier request (chained
    hashes: block k appeared before exactly when an earlier prompt shared the first k + 1 blocks)."""
    seen: set[int] = set()
    out = []
    for hashes in prefix:
        k = 0
        while k < len(hashes) and hashes[k] in seen:
            k += 1
        out.append(k)
        seen.update(hashes)
    return out


def idle_ttft(engine_spec, prompt_tokens: int, hashes: tuple[int, ...], cached_blocks: int) -> tuple[float, int]:
    """Seconds to the first token, and the cached tokens, of a request on an idle engine whose cache holds its
    first `cached_blocks` blocks (put there by an earlier request of exactly those blocks and one token more)."""
    engine = Engine(engine_spec)
    if cached_blocks:
        engine.add("warm", prompt_tokens=cached_blocks * engine_spec.block_size + 1, max_tokens=1, output_tokens=1,
                   now=0.0, prefix=hashes[:cached_blocks])
        engine.advance(_IDLE_S)
    start = engine.clock
    seq = engine.add("floor", prompt_tokens=prompt_tokens, max_tokens=1, output_tokens=1, now=start, prefix=hashes)
    engine.advance(start + _IDLE_S)
    return seq.first_token_time - start, seq.cached_tokens


def per_request(cfg, rows: PrefixedRows, result: CellResult) -> dict[str, np.ndarray]:
    """Per request (NaN where it was not served): TTFT, its floor, cached and ceiling tokens over the cell's mean
    prompt, and 1 where another request was in flight on its instance when it was dispatched."""
    specs: dict[int, object] = {}
    blocks = ceiling_blocks(rows.prefix)
    mean_prompt = float(np.mean(rows.prompt_tokens))
    out = {k: np.full(len(result.outcomes), np.nan) for k in ("ttft", "floor", "hit", "ceiling", "busy")}
    spans: dict[int, list[tuple[float, float]]] = {}
    for o in result.outcomes:
        if o.instance >= 0:
            spans.setdefault(o.instance, []).append((o.dispatched, o.finished))
    for r, o in enumerate(result.outcomes):
        if o.instance < 0 or math.isnan(o.first_token):
            continue
        spec = specs.setdefault(o.instance, engine_for(cfg, cfg.instances[o.instance]))
        if o.prompt_tokens != rows.prompt_tokens[r]:
            raise ValueError("the outcomes are not in the rows' order")
        compute_s, ceiling = idle_ttft(spec, o.prompt_tokens, rows.prefix[r], blocks[r])
        out["ttft"][r] = o.first_token - o.arrival
        out["floor"][r] = o.dispatched - o.arrival + compute_s
        out["hit"][r] = o.cached_tokens / mean_prompt
        out["ceiling"][r] = ceiling / mean_prompt
        out["busy"][r] = float(any(start < o.dispatched < end for start, end in spans[o.instance]))
    return out


def run(config_path: str, source: PrefixSource, requests: int, loads: list[float], seeds: list[int]) -> list[dict]:
    from gateway.lab.experiments.crossfit_world import load_world
    from gateway.lab.experiments.prefix_sweeps import capacity
    from gateway.lab.training.build import ensure_built

    cfg = load_config(config_path)
    ensure_built(cfg)
    [(evalset, est)] = load_world(cfg, requests)
    cap = capacity(config_path, source, requests)
    block = cfg.scheduler.prefix_block_tokens
    window = min(i.max_model_len for i in cfg.instances)
    report = []
    for load in loads:
        rate = round(load * cap, 3)
        arrays: dict[str, dict[str, list[np.ndarray]]] = {m: {} for m in MODES}
        for seed in seeds:
            rows = prefixed_rows(source, requests, rate, seed, block, window)
            for mode in MODES:
                spec = CellSpec("routebalance", requests=requests, arrivals=ArrivalSpec(rate=rate), prefixed=source,
                                prefix_cache=mode, seed=seed)
                for name, values in per_request(cfg, rows, run_cell(cfg, evalset, spec, est)).items():
                    arrays[mode].setdefault(name, []).append(values)
        off_ttft = np.array(arrays["off"]["ttft"])
        for mode in MODES:
            a = {k: np.array(v) for k, v in arrays[mode].items()}
            rel = differences({"ttft": (a["ttft"], "mean"), "floor": (a["floor"], "mean")},
                              {"ttft": (off_ttft, "mean"), "floor": (off_ttft, "mean")}, relative=True)
            row = {"prompts": source.label(), "load": load, "rate": rate, "requests": requests, "seeds": len(seeds),
                   "prefix_cache": mode, "ttft_mean": float(np.nanmean(a["ttft"])),
                   "floor_mean": float(np.nanmean(a["floor"])),
                   **_interval("ttft_vs_off", rel["ttft"]), **_interval("floor_vs_off", rel["floor"]),
                   **_interval("above_floor", bootstrap_mean(a["ttft"] - a["floor"])),
                   "prefix_hit_rate": float(np.nanmean(a["hit"])), "ceiling": float(np.nanmean(a["ceiling"])),
                   "busy_share": float(np.nanmean(a["busy"]))}
            report.append(row)
            print(_line(row), flush=True)
    return report


def _interval(name: str, i) -> dict[str, float]:
    return {name: i.mean, f"{name}_lo": i.lo, f"{name}_hi": i.hi}


def _line(row: dict) -> str:
    t, f, g = ([row[k], row[f"{k}_lo"], row[f"{k}_hi"]] for k in ("ttft_vs_off", "floor_vs_off", "above_floor"))
    return (f"{row['prompts']} at {row['load']:g} ({row['rate']:g} req/s) prefix_cache={row['prefix_cache']:<12}"
            f" TTFT {1e3 * row['ttft_mean']:5.1f} ms ({t[0]:+.1%} [{t[1]:+.1%}, {t[2]:+.1%}])"
            f"  floor {1e3 * row['floor_mean']:5.1f} ms ({f[0]:+.1%} [{f[1]:+.1%}, {f[2]:+.1%}])"
            f"  above it {1e3 * g[0]:.1f} ms [{1e3 * g[1]:.1f}, {1e3 * g[2]:.1f}]"
            f"  hit {row['prefix_hit_rate']:.1%} of ceiling {row['ceiling']:.1%}"
            f"  busy at dispatch {row['busy_share']:.0%}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", help="config TOML (default: as `routebalance` finds it)")
    ap.add_argument("--source", choices=("synthetic", "trace"), default="synthetic")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--loads", default="0.3,0.6,0.9", help="shares of the pool's capacity on the source")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    loads = [float(x) for x in args.loads.split(",")]
    report = run(str(resolve_config_path(args.config)), PrefixSource(args.source), args.requests, loads,
                 list(range(args.seeds)))
    if args.out:
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(report[0]))
            writer.writeheader()
            writer.writerows(report)


if __name__ == "__main__":
    main()
