"""`routebalance` command line: serve | emulate | up | train | profile | bench | sim | policies | keys."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import time
from pathlib import Path

from gateway.config import ConfigError, ConfigStore, default_config_path
from gateway.config_watch import watch_file

log = logging.getLogger("routebalance")


async def start_gateway(store: ConfigStore, host: str | None = None, port: int | None = None):
    """Start the gateway's HTTP server; returns (gateway, runners) for the caller to clean up in order.

    Raises ConfigError, before loading anything, when the config must not be
    served on the address (no API keys beyond loopback).
    """
    from gateway.trust.keys import exposure_problem

    problem = exposure_problem(store.current, host or store.current.server.host)
    if problem:
        raise ConfigError(problem)
    from gateway.server import Gateway, listen

    loop = asyncio.get_running_loop()
    estimators = await loop.run_in_executor(None, load_estimators, store.current)
    cfg = store.current.server
    gateway = Gateway(store, estimators, host or cfg.host)
    await loop.run_in_executor(gateway.scheduler.executor, gateway.warm_up)
    runners = await listen(gateway, host or cfg.host, port or cfg.port)
    log.info("gateway listening on http://%s:%d/v1", host or cfg.host, port or cfg.port)
    if cfg.metrics_port is not None:
        log.info("metrics on http://%s:%d/metrics", host or cfg.host, cfg.metrics_port)
    return gateway, runners


def load_estimators(cfg):
    """The estimators for the config's policy, built first if it needs them and they are missing.

    Returns None when the policy does not need them and they are not built:
    requests that ask for a policy needing them then get a clear 503.
    """
    from gateway.estimators import ArtefactError
    from gateway.estimators.bundle import Estimators
    from gateway.scheduling.policies import registry

    if registry.entry(cfg.scheduler.policy).needs_estimates:
        return Estimators.built(cfg)
    try:
        return Estimators.load(cfg)
    except ArtefactError as e:
        log.info("estimators not loaded (%s); policies that need them are unavailable", e)
        return None


def workload_lengths(cfg):
    """Answer lengths for the emulator: every prompt of the synthetic workload (the
    training records and the held-out ones the simulator and the load tests replay)
    is answered at its labelled length for the model that serves it."""
    from gateway.emulator.outputs import OutputLengths
    from gateway.engine.profiles import arch_for
    from gateway.sim.evalset import EVAL_PROMPTS
    from gateway.workload.synthetic import generate

    records = generate(cfg.estimators.train_records + EVAL_PROMPTS, seed=cfg.estimators.seed)
    means = {i.model: arch_for(i.model).mean_output_tokens for i in cfg.instances}
    # Kinds and scores too: a mixture-of-experts instance routes a known prompt's tokens to its kind's
    # experts, and logprobs follow the model's labelled quality on the prompt.
    return OutputLengths.from_records(means, records, seed=cfg.emulator.seed)


async def start_emulator(store: ConfigStore):
    """Start the emulated pool; it follows the fault knobs of every config reload."""
    from gateway.emulator.server import EmulatedPool

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

    pool = watcher = None
    runners: list = []
    try:
        if args.command in ("emulate", "up"):
            pool = await start_emulator(store)
        if args.command in ("serve", "up"):
            gateway, runners = await start_gateway(store, args.host, args.port)
            loop.add_signal_handler(signal.SIGHUP, lambda: gateway.reload("SIGHUP"))
        else:  # the emulator alone: reload faults on SIGHUP and on file changes
            loop.add_signal_handler(signal.SIGHUP, store.reload)
            watcher = asyncio.create_task(watch_file(store))
        if args.command == "up":
            server = store.current.server
            print(f"RouteBalance gateway on http://{args.host or server.host}:{args.port or server.port}/v1 "
                  f"in front of {len(store.current.instances)} emulated instances. Ctrl-C stops both.", flush=True)
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


def add_offline_commands(sub) -> None:
    from gateway.scheduling.policies import registry

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

    sub.add_parser("policies", help="list the registered routing policies (a Markdown table)")

    p = sub.add_parser("sim", help="simulate the gateway over the pool in virtual time: one cell, or a named sweep")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)
    p.add_argument("--sweep",
                   help="run a named sweep instead of one cell: frontier, arms, budget, batching, robustness, "
                        "qlm, qlm_cap, qlm_multi, qos, staleness, eldr, progressive")
    p.add_argument("--requests", type=int,
                   help="held-out prompts per cell (default 2500, the staleness sweep 1200; the paper's held-out set "
                        "is 3534; 2500 keeps the five sweeps at five seeds near 27 minutes on two cores, 3534 near 36)")
    p.add_argument("--seeds", type=int,
                   help="arrival seeds 0..N-1 per cell, reported as means with 95%% bootstrap intervals "
                        "(default: 5 for a sweep; one cell runs on --seed alone unless given)")
    p.add_argument("--workers", type=int, default=2, help="worker processes for a sweep")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"),
                   help="where a sweep writes NAME.{csv,json,png}, NAME_pairs.{csv,json} and NAME_seeds.csv")
    p.add_argument("--workload", help="labelled JSONL whose held-out split is replayed (default: synthetic)")
    p.add_argument("--policy", default="routebalance", choices=registry.names(), metavar="POLICY",
                   help="one cell: a registered policy (" + "; ".join(f"{e.name}: {e.summary}" for e in
                                                                         map(registry.entry, registry.names())) + ")")
    p.add_argument("--preset", default="uniform", help="one cell: RouteBalance preset from the config")
    p.add_argument("--rate", type=float, default=12.0, help="one cell: mean arrivals per second")
    p.add_argument("--arrivals", default="poisson", help="one cell: poisson, gamma or square")
    p.add_argument("--shape", type=float, default=0.5, help="one cell: gamma shape (below 1 is bursty)")
    p.add_argument("--budget-share", type=float, default=0.0, help="one cell: share of requests with a budget")
    p.add_argument("--model", help="one cell: every request names this pool model (default: the routing alias)")
    p.add_argument("--slos", default="",
                   help="one cell: end-to-end SLO mix as SECONDS:SHARE pairs, e.g. 25:0.5,300:0.5 (the rest: none); "
                        "requests with an SLO of 60 s or more do not stream")
    p.add_argument("--tpot-slo-ms", type=float, help="one cell: every request's time-per-output-token bound")
    p.add_argument("--mega-share", type=float, default=0.0,
                   help="one cell: share of mega prompts (3,000 prompt and 1,000 answer tokens: QLM's W_C)")
    p.add_argument("--tail", type=float,
                   help="one cell: QLM's multi-model W_A, four GPUs time-sharing five models; the three tail "
                        "models take this share of the requests (0..1)")
    p.add_argument("--pool",
                   help="one cell: a pool made for an experiment instead of the config's instances: moe (ELDR's "
                        "eight mixture-of-experts instances, gateway/examples/moe.toml), moe-shift (the same, half "
                        "the traffic one kind), W_A, or a config .toml whose instances to use")
    p.add_argument("--compare", default="",
                   help="one cell: also run these policies (comma-separated; `balancers`: round robin, shortest "
                        "queue and power of two choices) on the same prompts and arrivals, and print a table with "
                        "paired differences against --policy (TPOT, E2E)")
    p.add_argument("--progressive", action="store_true",
                   help="one cell: every request asks for progressive mode (PICE: the largest tier sketches, the "
                        "cheapest models expand; [progressive] sets the limits and the fallback rule)")
    p.add_argument("--seed", type=int, default=0, help="one cell: the arrival seed")
    p.add_argument("--replicas", type=int, default=1,
                   help="one cell: gateway replicas behind a round-robin balancer, sharing their in-flight work")
    p.add_argument("--staleness-ms", type=float, default=0.0,
                   help="one cell, replicas: what one replica publishes reaches the others this much later")
    p.add_argument("--sync-ms", type=float,
                   help="one cell, replicas: each publishes its share and reads the others' this often (default: "
                        "[state].sync_interval_s; 0: every decision reads the others' work as it is; inf: never)")

    p = sub.add_parser("calibrate", help="check the simulated world against the paper's testbed: target vs achieved")
    p.add_argument("--config", type=Path, default=default_config_path())
    p.add_argument("--requests", type=int, default=3534, help="held-out prompts per cell (paper: 3,534)")
    p.add_argument("--seeds", type=int, default=1, help="arrival seeds per cell (figures are their mean)")
    p.add_argument("--workers", type=int, default=2, help="worker processes")

    p = sub.add_parser("train-policy", help="train a learned routing policy in the simulator and export it "
                                            "(qos-rl: soft actor-critic -> ONNX; needs the [train] extra)")
    p.add_argument("policy", choices=("qos-rl", "eldr"),
                   help="the policy to train (eldr: fit its balanced k-means centroids, one per instance of each "
                        "model of the config, into <models_dir>/eldr/, and report them)")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)
    p.add_argument("--out", type=Path, default=Path("models/qos_rl"), help="where actor.onnx and its files go")
    p.add_argument("--seed", type=int,
                   help="qos-rl: seed of the networks, the episodes and the replay (default 0); eldr: of the k-means "
                        "and its calibration sample (default: [policies.eldr].seed)")
    p.add_argument("--budget-s", type=float, default=480.0,
                   help="wall-clock seconds of collecting and learning (evaluation and export come on top)")
    p.add_argument("--gain", choices=("eq16", "credited"), default="credited",
                   help="the reward's QoS term: eq16, the paper's (QoS completed since the last decision), or "
                        "credited (each request's own QoS, to its own decision)")
    p.add_argument("--penalty", choices=("eq16", "marginal"), default="marginal",
                   help="its impact term: eq16, the paper's (every running request on the chosen instance "
                        "predicted to miss its bound), or marginal (only those the action pushes over)")
    p.add_argument("--demo-episodes", type=int, default=12,
                   help="episodes of the qos heuristic's decisions the actor first imitates (0: SAC from scratch)")

    p = sub.add_parser("keys", help="API keys: add one (printed once, only its hash stored), list spend per key")
    keys = p.add_subparsers(dest="keys_command", required=True)
    p = keys.add_parser("add", help="make a key, print it once and append its [[auth.keys]] table to the config")
    p.add_argument("name", help="unique label of the key (metrics, ledger, `keys list`)")
    p.add_argument("--config", type=Path, default=default_config_path(),
                   help="config TOML to add the key to (a copy of the built-in one, not the built-in one itself)")
    p.add_argument("--spend-limit-usd", type=float, help="over it the key's requests get 402 (default: no limit)")
    p.add_argument("--period", choices=("day", "month", "total"),
                   help="the spend limit resets each UTC day or month, or never (default: total)")
    p.add_argument("--requests-per-minute", type=int, help="over it the key's requests get 429 (default: no limit)")
    p.add_argument("--models", nargs="+", default=(), metavar="MODEL",
                   help="models or aliases the key may name (default: all)")
    p.add_argument("--presets", nargs="+", default=(), metavar="PRESET",
                   help="presets the key may ask for (default: all)")
    p = keys.add_parser("list", help="each configured key with its limits and its spend this period")
    p.add_argument("--config", type=Path, default=default_config_path(), help=config_help)


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


def cmd_train_policy(args) -> int:
    from gateway.config import load_config

    if args.policy == "eldr":
        return _fit_eldr(load_config(args.config), args.seed)
    if args.seed is None:
        args.seed = 0
    try:
        from gateway.sim.qos_rl_train import TrainSettings, main
    except ImportError as e:
        print(f"error: training needs PyTorch ({e}): pip install 'routebalance-gateway[train]'", file=sys.stderr)
        return 2
    command = (f"routebalance train-policy {args.policy} --seed {args.seed} --budget-s {args.budget_s:g} "
               f"--gain {args.gain} --penalty {args.penalty} --demo-episodes {args.demo_episodes}")
    settings = TrainSettings(seed=args.seed, budget_s=args.budget_s, gain=args.gain, penalty=args.penalty,
                             demo_episodes=args.demo_episodes)
    result = main(load_config(args.config), settings, args.out, command)
    m = result.meta
    print(f"{m['episodes']} episodes, {m['env_steps']} decisions, {m['updates']} updates in {m['training_s']:.0f} s; "
          f"evaluation QoS {m['start_eval_qos']:.4f} -> {m['best_eval_qos']:.4f} (episode {m['best_episode']}; "
          f"the qos heuristic: {m['heuristic_eval_qos']:.4f})")
    print(f"actor in {result.out_dir}/actor.onnx, learning curve in {result.out_dir}/learning_curve.csv")
    return 0


def _fit_eldr(config, seed: int | None) -> int:
    """ELDR's centroids for the config's pool, fitted (or found) under its models_dir, and reported."""
    from gateway.estimators import ArtefactError
    from gateway.estimators.bundle import Estimators
    from gateway.estimators.centroids import fit_for_config, format_report

    try:  # loaded, not built: fitting centroids must not refit the TPOT heads of a config's new tiers
        estimators = Estimators.load(config)
    except ArtefactError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_report(fit_for_config(config, estimators, seed=seed)))
    return 0


def cmd_profile(args) -> int:
    from gateway.config import load_config
    from gateway.estimators.build import tier_lengths
    from gateway.estimators.profile import live_sweep
    from gateway.estimators.traces import write_traces
    from gateway.workload.synthetic import generate

    config = load_config(args.config)
    inst = config.instance(args.instance)
    rates = [float(r) for r in args.rates.split(",") if r.strip()]
    if not rates or any(r <= 0 for r in rates) or args.requests < 1:
        raise ValueError("--rates must be positive numbers and --requests at least 1")
    lengths = tier_lengths(generate(config.estimators.train_records, seed=config.estimators.seed), inst.model, 0)
    rows = asyncio.run(live_sweep(inst.url, inst.model, inst.gpu, lengths, rates=rates,
                                  requests_per_rate=args.requests))
    out = args.out or Path(config.estimators.models_dir) / "traces" / f"{inst.name}.jsonl"
    write_traces(rows, out)
    print(f"{len(rows)} traces from {inst.name} at {rates} req/s -> {out}")
    return 0


def cmd_bench(args) -> int:
    from gateway.config import load_config
    from gateway.estimators.bench import run_bench

    print(run_bench(load_config(args.config), prompts=args.prompts))
    return 0


def cmd_sim(args) -> int:
    import orjson

    from gateway.sim.catalog import REQUESTS
    from gateway.sim.sweeps import Cell, run_seeded

    if args.requests is None:
        args.requests = REQUESTS.get(args.sweep, 2500)
    if args.requests < 1 or args.workers < 1 or (args.seeds is not None and args.seeds < 1):
        raise ValueError("--requests, --workers and --seeds must be at least 1")
    if args.sweep:
        return _sim_sweep(args)
    from gateway.config import load_config
    from gateway.scheduling.slo import BATCH_SLO_S, parse_slo_mix
    from gateway.sim.arrivals import ArrivalSpec
    from gateway.sim.simulator import CellSpec

    models, tags = (), {}
    if args.pool:
        from gateway.sim.pools import named

        named(args.pool)  # an unknown pool is refused before anything runs
        tags = {"pool": args.pool}
    if args.tail is not None:
        from gateway.sim.slo_sweeps import w_a_mix

        if not 0 <= args.tail <= 1 or args.model or args.pool not in (None, "W_A"):
            raise ValueError("--tail is a share in 0..1, and W_A's requests name their own models (no --model, "
                             "no other --pool)")
        models, tags = w_a_mix(args.tail), {"pool": "W_A"}
    cfg = load_config(args.config)
    w = cfg.weights(args.preset)
    sync_s = cfg.state.sync_interval_s if args.sync_ms is None else args.sync_ms / 1000
    spec = CellSpec(args.policy, (w.quality, w.latency, w.cost),
                    ArrivalSpec(args.arrivals, args.rate, shape=args.shape), args.requests, args.seed,
                    budget_share=args.budget_share, model=args.model, models=models, slos=parse_slo_mix(args.slos),
                    tpot_slo_s=None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000,
                    mega_share=args.mega_share, stream_below_s=BATCH_SLO_S, replicas=args.replicas,
                    sync_interval_s=sync_s, staleness_s=args.staleness_ms / 1000, progressive=args.progressive)
    if args.progressive:
        tags |= {"mode": "progressive"}
    if args.replicas > 1:
        from gateway.sim.replicas import sharing_mode

        tags |= {"replicas": args.replicas, "sharing": sharing_mode(args.replicas, sync_s),
                 "sync_ms": 1000 * sync_s, "staleness_ms": args.staleness_ms}
    seeds = [args.seed] if args.seeds is None else list(range(args.seeds))
    if args.compare:
        return _sim_compare(args, spec, tags, seeds)
    result = run_seeded([Cell(args.policy, args.preset, spec, tags=tags)], str(args.config), args.requests,
                        seeds=seeds, workers=min(args.workers, len(seeds)), workload=args.workload)
    print(orjson.dumps(result.rows[0], option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
    return 0


BALANCERS = ("passthrough+round_robin", "passthrough+shortest_queue", "passthrough+power_of_two")
COMPARED = ("decode_tpot_p50", "decode_tpot_p99", "e2e_mean")  # what --compare's pairs report, relative too


def _sim_compare(args, spec, tags: dict, seeds: list[int]) -> int:
    """One cell under --policy and under each --compare policy (same prompts, arrivals and seeds): the rows,
    and --policy against each other, request by request (paired 95% intervals)."""
    import dataclasses

    from gateway.scheduling.policies import registry
    from gateway.sim.sweeps import Cell, Pair, run_seeded

    others = [p for name in args.compare.split(",") if name.strip()
              for p in (BALANCERS if name.strip() == "balancers" else (name.strip(),))]
    for name in others:
        registry.entry(name)  # ValueError naming the known ones
    policies = list(dict.fromkeys([args.policy, *others]))
    cells = [Cell(p.split("+")[0] if "+" in p else p, p, dataclasses.replace(spec, policy=p), tags=tags)
             for p in policies]
    pairs = [Pair(f"{args.policy} vs {p}", {"policy": args.policy}, {"policy": p}, COMPARED, relative=True)
             for p in policies[1:]]
    result = run_seeded(cells, str(args.config), args.requests, seeds=seeds, workers=min(args.workers, len(seeds)),
                        workload=args.workload, pairs=pairs)
    print(format_rows(result.rows, latency=True))
    if result.pairs:
        print(format_pairs(result.pairs))
    print(f"{len(seeds)} seed(s) of {args.requests} requests at {args.rate:g} req/s"
          + (f" on pool {args.pool}" if args.pool else "") + "; ± half the 95% interval")
    return 0


def _sim_sweep(args) -> int:
    from gateway.sim.catalog import PAIRS, SWEEPS
    from gateway.sim.plots import plot_sweep, require_matplotlib
    from gateway.sim.sweeps import estimate_seconds, run_seeded, write_sweep

    require_matplotlib()  # before the sweep's minutes, not after
    if args.sweep not in SWEEPS:
        raise ValueError(f"unknown sweep {args.sweep!r} (known: {', '.join(SWEEPS)})")
    seeds = 5 if args.seeds is None else args.seeds
    cells = SWEEPS[args.sweep](args.requests)
    pairs = PAIRS[args.sweep](cells)
    estimate = estimate_seconds(cells, args.requests, seeds, args.workers)
    print(f"{args.sweep}: {len(cells)} cells x {seeds} seeds of {args.requests} requests on {args.workers} workers, "
          f"{len(pairs)} paired comparisons; about {_duration(estimate)} (more if the cores are shared)", flush=True)
    started = time.perf_counter()
    step = max(1, len(cells) * seeds // 20)  # a line every 5%

    def progress(done: int, total: int, cell, seed: int) -> None:
        if done % step == 0 or done == total:
            print(f"  {done}/{total} runs, {time.perf_counter() - started:.0f} s", flush=True)

    result = run_seeded(cells, str(args.config), args.requests, seeds=seeds, workers=args.workers,
                        workload=args.workload, pairs=pairs, progress=progress)
    paths = [*write_sweep(result, args.out, args.sweep),
             *plot_sweep(args.sweep, result.rows, args.out, pairs=result.pairs)]
    print(format_rows(result.rows))
    if result.pairs:
        print(format_pairs(result.pairs))
    print(f"{time.perf_counter() - started:.0f} s; wrote {', '.join(str(p) for p in paths)}")
    return 0


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


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def _pm(row: dict, name: str, fmt: str) -> str:
    lo, hi = row.get(f"{name}_lo"), row.get(f"{name}_hi")
    if lo is None or lo != lo:  # no interval, or NaN
        return format(row[name], fmt)
    return f"{row[name]:{fmt}}±{(hi - lo) / 2:{fmt}}"


def _diff(pair: dict, key: str, fmt: str) -> str:
    return f"{pair[key]:{fmt}} [{pair[f'{key}_lo']:{fmt}}, {pair[f'{key}_hi']:{fmt}}]"


def cmd_calibrate(args) -> int:
    """Print the calibration table; exit 1 when a target is missed (the README says which, and why)."""
    from gateway.sim import calibrate

    checks = calibrate.run(str(args.config), args.requests, args.seeds, args.workers)
    print(calibrate.table(checks))
    missed = [c.target.what for c in checks if not c.ok]
    print(f"{len(checks) - len(missed)} of {len(checks)} targets met" + (f"; missed: {'; '.join(missed)}" if missed
                                                                        else ""))
    return 1 if missed else 0


def cmd_keys(args) -> int:
    return {"add": cmd_keys_add, "list": cmd_keys_list}[args.keys_command](args)


def cmd_keys_add(args) -> int:
    from gateway.trust.keyfile import add_key

    key = add_key(args.config, args.name, spend_limit_usd=args.spend_limit_usd, period=args.period,
                  requests_per_minute=args.requests_per_minute, models=args.models, presets=args.presets)
    print(f"Added key {args.name!r} to {args.config}. The key, shown this once (only its SHA-256 is stored):\n")
    print(f"    {key}\n")
    print("A running gateway picks it up on its next config reload (file watcher, SIGHUP or POST /admin/reload).")
    return 0


def cmd_keys_list(args) -> int:
    from gateway.config import load_config
    from gateway.trust.spend import SpendStoreError

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
    from gateway.trust.spend import SpendLedger, SqliteSpendStore

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
    from gateway.state.spend import RedisSpendLedger

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


def cmd_policies(args) -> int:
    from gateway.scheduling.policies import registry

    print(registry.table())
    return 0


OFFLINE = {"train": cmd_train, "train-policy": cmd_train_policy,
           "profile": cmd_profile, "bench": cmd_bench, "sim": cmd_sim, "policies": cmd_policies,
           "keys": cmd_keys, "calibrate": cmd_calibrate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="routebalance",
                                     description="Quality-, latency- and cost-aware gateway for vLLM pools")
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
