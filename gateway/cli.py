"""`routebalance` command line: serve | emulate | up | keys | labels | refresh | policies, and the lab's commands
(train | learning-curve | collect | judge | profile | bench | sim | calibrate | train-policy, gateway/lab/cli.py),
imported only when one of them is asked for."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

from gateway.config.store import ConfigStore, resolve_config_path
from gateway.config.watch import watch_file
from gateway.config_schema import ConfigError
from gateway.serving.workers import SINGLE, Worker, sharing, supervise, workers_problem

log = logging.getLogger("routebalance")


async def start_gateway(store: ConfigStore, host: str | None = None, port: int | None = None, *,
                        build: bool = False, worker: Worker = SINGLE):
    """Start the gateway's HTTP server; returns (gateway, runners) for the caller to clean up in order.

    Raises ConfigError, before loading anything, when the config must not be
    served on the address (no API keys beyond loopback), and when the
    estimators its policy needs are not built. `build` (what `up` does; `serve`
    never builds): build what is missing first, with the port already
    answering (/health says how far the build is, /health/ready is 503); the
    gateway takes over that listening socket, so the port never closes between.
    `worker`: this process's place among `serve --workers` (gateway/serving/workers.py).
    """
    from gateway.tenancy.keys import exposure_problem

    cfg = store.current.server
    host, port = host or cfg.host, port or cfg.port
    problem = exposure_problem(store.current, host)
    if problem:
        raise ConfigError(problem)
    from gateway.serving.app import Gateway, listen

    loop = asyncio.get_running_loop()
    placeholder = await _build_while_listening(store, host, port) if build else None
    try:
        estimators = await loop.run_in_executor(None, load_estimators, store.current, store.path)
        gateway = Gateway(store, estimators, host, worker)
        await loop.run_in_executor(gateway.scheduler.executor, gateway.warm_up)
    except BaseException:
        if placeholder is not None:
            await placeholder.cleanup()
        raise
    runners = await listen(gateway, host, port, reuse_port=worker.shared, listener=placeholder)
    log.info("gateway listening on http://%s:%d/v1", host, port)
    if cfg.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", host, cfg.metrics_port)
    return gateway, runners


async def _build_while_listening(store: ConfigStore, host: str, port: int):
    """Build what the config's estimators lack (lab code: `up` only), answering on the port meanwhile;
    returns the placeholder's listener, still listening, for the caller to hand over to the gateway."""
    from gateway.lab.training.build import BuildProgress, ensure_built
    from gateway.policies import registry
    from gateway.serving.building import listen_while_building

    cfg = store.current
    if not registry.entry(cfg.scheduler.policy).needs_estimates:
        return None
    progress = BuildProgress()
    listener = await listen_while_building(host, port, progress.as_dict, cfg.server.max_connections)
    log.info("checking the estimators in %s (a first build takes minutes; http://%s:%d/health shows how far "
             "it is)", cfg.estimators.models_dir, host, port)
    try:
        await asyncio.get_running_loop().run_in_executor(None, lambda: ensure_built(cfg, progress=progress))
    except BaseException:
        await listener.cleanup()
        raise
    return listener


def load_estimators(cfg, config_path: Path | None = None):
    """The estimators for the config's policy, as built (never built here: `routebalance train` builds them).

    When the policy needs estimators that are missing, corrupt or built by another format or package
    versions, ConfigError names the command that builds them. Returns None when the policy does not need
    them and they are not there: requests asking for a policy that needs them get a 503.
    """
    from gateway.artefacts import ArtefactError
    from gateway.estimators.bundle import Estimators
    from gateway.policies import registry

    needed = registry.entry(cfg.scheduler.policy).needs_estimates
    try:
        return Estimators.load(cfg)
    except ArtefactError as e:
        if needed:
            command = "routebalance train" + (f" --config {config_path}" if config_path else "")
            raise ConfigError(f"the estimators policy {cfg.scheduler.policy!r} needs are not usable ({e}); "
                              f"build them with `{command}`") from None
        log.info("estimators not loaded (%s); policies that need them are unavailable", e)
        return None


def workload_lengths(cfg):
    """Answer lengths for the emulator: every prompt of the synthetic workload (the
    training records and the held-out ones the simulator and the load tests replay)
    is answered at its labelled length for the model that serves it."""
    from gateway.core.engine.profiles import arch_for
    from gateway.lab.emulator.outputs import OutputLengths
    from gateway.lab.emulator.settings import emulator_of, label_constants
    from gateway.lab.sim.evalset import EVAL_PROMPTS
    from gateway.lab.workload.synthetic import generate

    records = generate(cfg.estimators.train_records + EVAL_PROMPTS, seed=cfg.estimators.seed,
                       world=label_constants(cfg))
    means = {i.model: arch_for(i.model).mean_output_tokens for i in cfg.instances}
    # Kinds and scores too: a mixture-of-experts instance routes a known prompt's tokens to its kind's
    # experts, and logprobs follow the model's labelled quality on the prompt.
    return OutputLengths.from_records(means, records, seed=emulator_of(cfg).seed)


async def start_emulator(store: ConfigStore):
    """Start the emulated pool; it follows the fault knobs of every config reload."""
    from gateway.lab.emulator.server import EmulatedPool

    loop = asyncio.get_running_loop()
    lengths = await loop.run_in_executor(None, workload_lengths, store.current)
    pool = EmulatedPool(store.current, lengths=lengths)
    await pool.start()
    tasks: set[asyncio.Task] = set()

    def on_reload(config) -> None:
        task = loop.create_task(pool.apply_config(config))
        tasks.add(task)  # keep a reference until done
        task.add_done_callback(tasks.discard)

    store.subscribe(on_reload)
    names = [*pool.instances, *pool.embedders]
    log.info("emulating %d vLLM instances (%s)", len(names),
             ", ".join(f"{n}@{h}:{p}" for n in names for h, p in [pool.address(n)]))
    return pool


def emulated(first_port: int | None):
    """What `emulate` and `up` do to every config they load: check the emulator's tables, and move the
    loopback instances to first_port, first_port + 1, ... (None: where their urls say)."""
    from gateway.lab.emulator.server import moved_ports
    from gateway.lab.emulator.settings import checked

    def adjust(config):
        config = checked(config)
        return config if first_port is None else moved_ports(config, first_port)

    return adjust


async def run(args) -> int:
    try:
        adjust = emulated(args.emulator_port) if args.command in ("emulate", "up") else None
        store = ConfigStore(args.config, adjust=adjust)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    watch = store.current.server.config_watch_interval_s
    log.info("config loaded from %s; %s", store.path.resolve(),
             f"watched for changes every {watch:g} s" if watch else "not watched (reload with SIGHUP or "
                                                                     "POST /admin/reload)")
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)

    pool = watcher = None
    runners: list = []
    try:
        if args.command in ("emulate", "up"):
            pool = await start_emulator(store)
        if args.command in ("serve", "up"):
            gateway, runners = await start_gateway(store, args.host, args.port, build=args.command == "up",
                                                   worker=getattr(args, "worker", SINGLE))
            loop.add_signal_handler(signal.SIGHUP, lambda: gateway.reload("SIGHUP"))
        else:  # the emulator alone: reload faults on SIGHUP and on file changes
            loop.add_signal_handler(signal.SIGHUP, store.reload)
            watcher = asyncio.create_task(watch_file(store))
        if args.command == "up":
            server, embedders = store.current.server, len(store.current.embedders)
            also = f" and {embedders} embedding instance{'s' * (embedders > 1)}" if embedders else ""
            print(f"RouteBalance gateway on http://{args.host or server.host}:{args.port or server.port}/v1 "
                  f"in front of {len(store.current.instances)} emulated instances{also}. Ctrl-C stops both.",
                  flush=True)
        await stop.wait()
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        if watcher:
            watcher.cancel()
        for runner in runners:
            await runner.cleanup()
        if pool:
            await pool.stop()
    log.info("stopped")
    return 0


def cmd_keys(args) -> int:
    return {"add": cmd_keys_add, "list": cmd_keys_list}[args.keys_command](args)


def cmd_keys_add(args) -> int:
    from gateway.tenancy.keyfile import add_key

    key = add_key(args.config, args.name, spend_limit_usd=args.spend_limit_usd, period=args.period,
                  requests_per_minute=args.requests_per_minute, models=args.models, presets=args.presets)
    print(f"Added key {args.name!r} to {args.config}. The key, shown this once (only its SHA-256 is stored):\n")
    print(f"    {key}\n")
    print("A running gateway picks it up on its next config reload (file watcher, SIGHUP or POST /admin/reload).")
    return 0


def cmd_keys_list(args) -> int:
    from gateway.config.store import load_config
    from gateway.tenancy.spend.sqlite import SpendStoreError

    config = load_config(args.config)
    keys = config.auth.keys
    if not keys:
        print(f"no API keys in {args.config}; `routebalance keys add NAME --config CONFIG` adds one")
        return 0
    state = config.state
    if state.backend == "memory":
        print(format_keys(keys, None))
        print('\n[state] backend = "memory": spend is kept inside the running gateway only; nothing to show here')
        return 0
    if state.backend == "sqlite" and not Path(state.path).exists():
        print(format_keys(keys, None))
        print(f"\nno spend recorded yet: {state.path} does not exist (relative paths are to the working directory)")
        return 0
    try:
        spends, source = _spend_report(state, keys)
    except SpendStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(format_keys(keys, spends))
    print(f"\nspend from {source}")
    return 0


def _spend_report(state, keys):
    """This period's spend of each key from the configured store, and where it was read."""
    from gateway.tenancy.spend.sqlite import SpendLedger, SqliteSpendStore

    if state.backend == "redis":
        spends = asyncio.run(_redis_report(state, keys))
        return spends, f"{state.url} (booked; what requests in flight hold is not shown)"
    store = SqliteSpendStore(state.path)
    try:
        return SpendLedger(store).report(keys, time.time()), state.path
    finally:
        store.close()


async def _redis_report(state, keys):
    from gateway.state.link import RedisLink
    from gateway.tenancy.spend.redis import RedisSpendLedger

    link = RedisLink(state.url, state.prefix, state.timeout_s)
    try:
        return await RedisSpendLedger(link, state.on_unavailable, hold_ttl_s=1).report(keys, time.time())
    finally:
        await link.close()


def format_keys(keys, spends) -> str:
    """A text table of the keys and their limits, with this period's spend when `spends`
    (KeySpend rows, in the keys' order) is given."""

    def usd(value: float | None) -> str:
        return "-" if value is None else f"{value:.6f}"

    width = max(4, *(len(k.name) for k in keys))
    lines = [f"{'name':<{width}} {'limit $':>12} {'period':<16} {'spent $':>12} {'requests':>9} "
             f"{'remaining $':>12} {'rpm':>6}"]
    for key, spend in zip(keys, spends or [None] * len(keys), strict=True):
        if spend is None:
            period, spent, requests, remaining = key.period, "-", "-", "-"
        else:
            period = key.period if key.period == "total" else f"{key.period} {spend.period_start}"
            spent, requests, remaining = usd(spend.spent_usd), str(spend.requests), usd(spend.remaining_usd)
        lines.append(f"{key.name:<{width}} {usd(key.spend_limit_usd):>12} {period:<16} {spent:>12} {requests:>9} "
                     f"{remaining:>12} {key.requests_per_minute or '-':>6}")
    return "\n".join(lines)


def cmd_labels(args) -> int:
    from gateway.config.store import load_config
    from gateway.learning.store import LabelStore, LabelStoreError

    config = load_config(args.config)
    path = Path(config.learning.path)
    if not path.exists():  # not created here: a read must not leave an empty store behind
        print(f"no labels yet: {path} does not exist (relative paths are to the working directory; the "
              f"gateway writes it while it serves, with [learning] enabled)")
        return 0 if args.labels_command == "stats" else 1
    try:
        store = LabelStore(path, config.learning.max_labels)
    except LabelStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        if args.labels_command == "stats":
            print(format_label_stats(store.stats(), path))
            return 0
        return _export_labels(store, config, args)
    except LabelStoreError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()


def format_label_stats(stats, path: Path) -> str:
    """`labels stats`: what the store holds, by source and model."""
    from datetime import UTC, datetime

    from gateway.learning.labels import SOURCES

    def when(t: float | None) -> str:
        return "-" if t is None else datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")

    lines = [f"{stats.total} labels in {path} (at most {stats.max_labels}), for {stats.prompts} prompts "
             f"({stats.prompts_with_text} with their text)",
             f"oldest {when(stats.oldest)}, newest {when(stats.newest)}"]
    if stats.total:
        width = max(5, *(len(m) for m in stats.by_model))
        lines.append("")
        lines.append(f"{'model':<{width}} " + " ".join(f"{s:>9}" for s in SOURCES))
        for model, counts in stats.by_model.items():
            lines.append(f"{model:<{width}} " + " ".join(f"{counts.get(s, 0):>9}" for s in SOURCES))
        lines.append(f"{'all':<{width}} " + " ".join(f"{stats.by_source.get(s, 0):>9}" for s in SOURCES))
    if stats.lengths:
        lines.append(f"\nanswer lengths: {stats.lengths}, of which {stats.censored_lengths} censored "
                     f"({stats.censored_share:.1%}: cut by max_tokens, a budget or a client leaving)")
    return "\n".join(lines)


def _export_labels(store, config, args) -> int:
    from gateway.tokens import TokenCounter

    models = args.models or store.quality_models()
    if not models:
        print("nothing to export: no model has a quality label yet (feedback, a judge or a file)", file=sys.stderr)
        return 1
    summary = store.export(args.out, config.learning.source_weights, TokenCounter().count, models)
    print(f"exported {summary.exported} prompts labelled for {', '.join(models)}"
          + (f" to {args.out}" if summary.exported else "; no file written"))
    if summary.censored_lengths:
        print(f"{summary.censored_lengths} labels have only a censored length (every answer seen was cut): "
              f"marked \"length_censored\": true")
    if summary.left_out:
        print(f"left out {sum(summary.left_out.values())} prompts:")
        for why, n in summary.left_out.most_common():
            print(f"  {n:>7}  {why}")
    return 0 if summary.exported else 1


def cmd_refresh(args) -> int:
    """Ask the running gateway (the config's host and port, its admin token) to refresh or roll back."""
    import json

    import httpx

    from gateway.config.store import load_config

    config = load_config(args.config)
    server = config.server
    if server.admin_token is None:
        print("error: the gateway's admin endpoints are off: set [server].admin_token", file=sys.stderr)
        return 2
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    url = f"http://{host}:{server.port}/admin/{'rollback' if args.rollback else 'refresh'}"
    try:
        reply = httpx.post(url, headers={"Authorization": f"Bearer {server.admin_token}"}, timeout=args.timeout)
    except httpx.HTTPError as e:
        print(f"error: no answer from the gateway at {url}: {e}", file=sys.stderr)
        return 1
    try:
        body = reply.json()
    except ValueError:
        print(reply.text)
        return 1
    print(json.dumps(body, indent=2))
    return 0 if reply.is_success and body.get("accepted", True) else 1


def cmd_policies(args) -> int:
    from gateway.policies import registry

    print(registry.table())
    return 0


def add_commands(sub) -> None:
    """The serving side's own commands besides serve | emulate | up: keys, labels and policies."""
    sub.add_parser("policies", help="list the registered routing policies (a Markdown table)")
    p = sub.add_parser("keys", help="API keys: add one (printed once, only its hash stored), list spend per key")
    keys = p.add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("add", help="make a key, print it once and append its [[auth.keys]] table to the config")
    p.add_argument("name", help="unique label of the key (metrics, ledger, `keys list`)")
    config_option(p, "config TOML to add the key to (a copy of the built-in one, not the built-in one itself)")
    p.add_argument("--spend-limit-usd", type=float, help="over it the key's requests get 402 (default: no limit)")
    p.add_argument("--period", choices=("day", "month", "total"),
                   help="the spend limit resets each UTC day or month, or never (default: total)")
    p.add_argument("--requests-per-minute", type=int, help="over it the key's requests get 429 (default: no limit)")
    p.add_argument("--models", nargs="+", default=(), metavar="MODEL",
                   help="models or aliases the key may name (default: all)")
    p.add_argument("--presets", nargs="+", default=(), metavar="PRESET",
                   help="presets the key may ask for (default: all)")
    p = keys.add_parser("list", help="each configured key with its limits and its spend this period")
    config_option(p)
    p = sub.add_parser("refresh", help="fold the stored labels into the running gateway's estimators now "
                                       "(POST /admin/refresh), or --rollback to the version before")
    config_option(p)
    p.add_argument("--rollback", action="store_true", help="return to the estimators' previous version instead")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds to wait for the gateway's answer (a refresh embeds the new prompts; default 600)")
    p = sub.add_parser("labels", help="the labels learned from traffic ([learning]): counts, or export them "
                                      "as a workload file for `train`")
    labels = p.add_subparsers(dest="labels_command", required=True)
    p = labels.add_parser("stats", help="labels by source and model, censored lengths, oldest and newest")
    config_option(p)
    p = labels.add_parser("export", help="write the prompts labelled for every chosen model as JSON Lines "
                                         "that `routebalance train --workload FILE` reads")
    config_option(p)
    p.add_argument("--out", type=Path, required=True, help="the workload file to write (replaced)")
    p.add_argument("--models", nargs="+", metavar="MODEL",
                   help="models to export (default: every model with a quality label); a prompt is exported "
                        "only with a score and a length for each")


COMMANDS = {"policies": cmd_policies, "keys": cmd_keys, "labels": cmd_labels, "refresh": cmd_refresh}
SERVING = ("serve", "emulate", "up")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def config_option(parser, text: str = "config TOML (default: ./config.toml if there is one, else the built-in "
                                      "13-instance emulated pool)") -> None:
    parser.add_argument("--config", type=Path, help=text)


def wanted(argv: list[str]) -> str | None:
    """The subcommand argv asks for (None: none yet, e.g. --help)."""
    return next((a for a in argv if not a.startswith("-") and a.upper() not in LOG_LEVELS), None)


def build_parser(with_lab: bool) -> tuple[argparse.ArgumentParser, dict]:
    """The command line's parser and the function of each command that is not a server (`with_lab`: the
    lab's commands too, which imports the lab)."""
    parser = argparse.ArgumentParser(prog="routebalance",
                                     description="Quality-, latency- and cost-aware gateway for vLLM pools")
    parser.add_argument("--log-level", default="INFO", type=str.upper, choices=LOG_LEVELS,
                        help="the least severe log lines shown")
    sub = parser.add_subparsers(dest="command", required=True)
    helps = {
        "serve": "run the gateway in front of the pool in the config (the estimators must be built: `train`)",
        "emulate": "serve the config's instances as emulated vLLM servers",
        "up": "emulator and gateway together: try the gateway in one command (builds the estimators if missing)",
    }
    for name, text in helps.items():
        p = sub.add_parser(name, help=text)
        config_option(p)
        if name != "emulate":
            p.add_argument("--host", help="listen address (default: [server].host)")
            p.add_argument("--port", type=int, help="listen port (default: [server].port)")
        if name == "serve":
            p.add_argument("--workers", type=int, default=1,
                           help="gateway processes sharing the port, one per core (they share key spend "
                                'through the [state] backend, "sqlite" or "redis"; default: 1)')
            p.add_argument("--worker", type=Worker.parse, default=SINGLE, help=argparse.SUPPRESS)
        else:
            p.add_argument("--emulator-port", type=int,
                           help="first port of the emulated instances, the others following it (default: the "
                                "ports of the instances' urls in the config)")
    add_commands(sub)
    commands = dict(COMMANDS)
    if with_lab:
        from gateway.lab import cli as lab

        lab.add_commands(sub, config_option)
        commands |= lab.COMMANDS
    return parser, commands


def serve_workers(args) -> int:
    """`serve --workers N`: check the config can be shared by N processes, then supervise them."""
    from gateway.config.store import load_config

    try:
        config = load_config(args.config)
    except (ConfigError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    problem = workers_problem(config, args.workers)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    log.info("%s", sharing(config, args.workers))
    worker_argv = ["--log-level", args.log_level, "serve", "--config", str(args.config)]
    for option in ("host", "port"):
        if getattr(args, option) is not None:
            worker_argv += [f"--{option}", str(getattr(args, option))]
    return supervise(worker_argv, args.workers, config.server.shutdown_timeout_s)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # A lab command, or the help: only then is the lab imported (`serve` never imports it).
    parser, commands = build_parser(with_lab=wanted(argv) not in (*SERVING, *COMMANDS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("faiss.loader").setLevel(logging.WARNING)  # it narrates its CPU-feature probing
    if getattr(args, "config", "absent") is None:
        args.config = resolve_config_path()
    if args.command in commands:
        try:
            return commands[args.command](args)
        except (ConfigError, ValueError, OSError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2

    if args.command == "serve" and args.workers != 1:
        return serve_workers(args)
    import uvloop

    with contextlib.suppress(KeyboardInterrupt), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(run(args))
    return 130


if __name__ == "__main__":
    sys.exit(main())
