"""`routebalance` command line: serve | emulate | up | train | profile | bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from pathlib import Path

from aiohttp import web

from gateway.config import ConfigError, ConfigStore, default_config_path
from gateway.config_watch import watch_file

log = logging.getLogger("routebalance")


async def start_gateway(store: ConfigStore, host: str | None = None, port: int | None = None):
    """Start the gateway's HTTP server; returns (gateway, runner) for the caller to stop."""
    from gateway.server import Gateway, build_app

    gateway = Gateway(store)
    runner = web.AppRunner(build_app(gateway), handler_cancellation=True, access_log=None)
    await runner.setup()
    cfg = store.current.server
    site = web.TCPSite(runner, host or cfg.host, port or cfg.port, backlog=1024, reuse_address=True)
    await site.start()
    log.info("gateway listening on http://%s:%d/v1", host or cfg.host, port or cfg.port)
    return gateway, runner


async def start_emulator(store: ConfigStore):
    """Start the emulated pool; it follows the fault knobs of every config reload."""
    from gateway.emulator.server import EmulatedPool

    pool = EmulatedPool(store.current)
    await pool.start()
    loop = asyncio.get_running_loop()
    tasks: set[asyncio.Task] = set()

    def on_reload(config) -> None:
        task = loop.create_task(pool.apply_config(config))
        tasks.add(task)  # keep a reference until done
        task.add_done_callback(tasks.discard)

    store.subscribe(on_reload)
    log.info("emulating %d vLLM instances (%s)", len(pool.instances),
             ", ".join(f"{n}@{h}:{p}" for n in pool.instances for h, p in [pool.address(n)]))
    return pool


async def run(args) -> int:
    try:
        store = ConfigStore(args.config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    pool = runner = watcher = None
    try:
        if args.command in ("emulate", "up"):
            pool = await start_emulator(store)
        if args.command in ("serve", "up"):
            gateway, runner = await start_gateway(store, args.host, args.port)
            loop.add_signal_handler(signal.SIGHUP, lambda: gateway.reload("SIGHUP"))
        else:  # the emulator alone: reload faults on SIGHUP and on file changes
            loop.add_signal_handler(signal.SIGHUP, store.reload)
            watcher = asyncio.create_task(watch_file(store))
        if args.command == "up":
            server = store.current.server
            print(f"RouteBalance gateway on http://{args.host or server.host}:{args.port or server.port}/v1 "
                  f"in front of {len(store.current.instances)} emulated instances. Ctrl-C stops both.", flush=True)
        await stop.wait()
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if watcher:
            watcher.cancel()
        if runner:
            await runner.cleanup()
        if pool:
            await pool.stop()
    log.info("stopped")
    return 0


def add_offline_commands(sub) -> None:
    config_help = "config TOML (default: the built-in 13-instance emulated pool)"
    p = sub.add_parser("train", help="build the estimator artefacts (index, labels, TPOT heads) and report accuracy")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)
    p.add_argument("--out", type=Path, help="output directory (default: [estimators].models_dir)")
    p.add_argument("--workload", help="labelled JSONL (default: the synthetic workload)")
    p.add_argument("--traces", nargs="*", default=[], help="trace files from `profile` (default: virtual sweeps)")
    p.add_argument("--if-stale", action="store_true", help="rebuild only if missing, stale or corrupt")

    p = sub.add_parser("profile", help="rate-sweep one live instance and record TPOT traces for `train`")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)
    p.add_argument("--instance", required=True, help="instance name from the config")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="request rates to sweep, req/s, comma-separated")
    p.add_argument("--requests", type=int, default=200, help="requests per rate (bounds the run)")
    p.add_argument("--out", type=Path, help="trace file (default: <models_dir>/traces/<instance>.jsonl)")

    p = sub.add_parser("bench", help="time the estimators per request at several batch sizes and truncations")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)
    p.add_argument("--prompts", type=int, default=512, help="prompts timed per setting")


def cmd_train(args) -> int:
    from gateway.config import load_config
    from gateway.estimators.build import ensure_built, format_report, train

    config = load_config(args.config)
    out = args.out or Path(config.estimators.models_dir)
    build = ensure_built if args.if_stale else train
    manifest = build(config, out, workload=args.workload, trace_files=args.traces)
    print(format_report(manifest))
    print(f"artefacts in {out}/")
    return 0


def cmd_profile(args) -> int:
    from gateway.config import load_config
    from gateway.estimators.build import tier_lengths
    from gateway.estimators.profile import live_sweep
    from gateway.estimators.traces import write_traces
    from gateway.workload import generate

    config = load_config(args.config)
    inst = config.instance(args.instance)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates) or args.requests < 1:
        raise ValueError("--rates must be positive numbers and --requests at least 1")
    lengths = tier_lengths(generate(config.estimators.train_records, seed=config.estimators.seed), inst.model, 0)
    rows = asyncio.run(live_sweep(inst.url, inst.model, inst.gpu, lengths, rates=rates, requests_per_rate=args.requests))
    out = args.out or Path(config.estimators.models_dir) / "traces" / f"{inst.name}.jsonl"
    write_traces(rows, out)
    print(f"{len(rows)} traces from {inst.name} at {rates} req/s -> {out}")
    return 0


def cmd_bench(args) -> int:
    from gateway.config import load_config
    from gateway.estimators.bench import run_bench

    print(run_bench(load_config(args.config), prompts=args.prompts))
    return 0


OFFLINE = {"train": cmd_train, "profile": cmd_profile, "bench": cmd_bench}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="routebalance", description="Quality-, latency- and cost-aware gateway for vLLM pools")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "serve": "run the gateway in front of the pool in the config",
        "emulate": "serve the config's instances as emulated vLLM servers",
        "up": "emulator and gateway together: try the gateway in one command",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", type=Path, default=default_config_path(),
                       help="config TOML (default: the built-in 13-instance emulated pool)")
        if name != "emulate":
            p.add_argument("--host", help="listen address (default: [server].host)")
            p.add_argument("--port", type=int, help="listen port (default: [server].port)")
    add_offline_commands(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it narrates its CPU-feature probing
    if args.command in OFFLINE:
        try:
            return OFFLINE[args.command](args)
        except (ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    import uvloop

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
