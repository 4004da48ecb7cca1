"""The lab's commands: train | learning-curve | collect | judge | profile | bench | sim | calibrate | train-policy.

gateway/cli.py registers them only when one of them (or the help) is asked for,
so `routebalance serve` never imports the lab.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from gateway.lab.experiments.tables import duration, format_pairs, format_rows


def add_commands(sub, config_option) -> None:
    """The lab's subcommands; `config_option(parser)` adds the shared --config option."""
    from gateway.lab.experiments.catalog import ON_CAPACITY, PREFIX_SWEEPS, SWEEPS
    from gateway.policies import registry

    sweep_names = (*SWEEPS, *ON_CAPACITY, *PREFIX_SWEEPS)
    p = sub.add_parser("train", help="build the estimator artefacts (index, labels, TPOT heads) and report accuracy")
    config_option(p)
    p.add_argument("--out", type=Path, help="output directory (default: [estimators].models_dir)")
    p.add_argument("--workload", help="labelled JSONL (default: the synthetic workload)")
    p.add_argument("--traces", nargs="*", default=[], help="trace files from `profile` (default: virtual sweeps)")
    p.add_argument("--if-stale", action="store_true", help="rebuild only if missing, stale or corrupt")

    p = sub.add_parser("learning-curve", help="replay a labelled file as traffic, learning from each answer's label "
                                              "after it is scored: quality and cost against prompts served")
    config_option(p)
    p.add_argument("--workload", required=True, help="labelled JSONL whose prompts arrive as traffic")
    p.add_argument("--seeds", type=int, default=5, help="arrival orders 0..N-1 (default 5)")
    p.add_argument("--start", nargs="+", choices=("none", "synthetic"), default=["none", "synthetic"],
                   help="what the estimators know before the first prompt (default: both)")
    p.add_argument("--weights", default="0.8,0,0.2", help="Eq. 1 weights quality,latency,cost (default 0.8,0,0.2)")
    p.add_argument("--refresh-every", type=int, default=50, help="prompts between refits (default 50)")
    p.add_argument("--explore-share", type=float, default=0.1, help="share of prompts that explore (default 0.1)")
    p.add_argument("--min-labels", type=int, default=20, help="labels a model needs for its own head (default 20)")
    p.add_argument("--added", help="a model of the file that joins the pool late, unlabelled")
    p.add_argument("--added-at", type=int, default=300, help="prompts served before it joins (default 300)")
    p.add_argument("--block", type=int, default=100, help="prompts per row of the table (default 100)")
    p.add_argument("--out", type=Path, help="write learning_curve{,_added}.{csv,png} there")

    p = sub.add_parser("collect", help="send every prompt of a file to every pool model and store the answers "
                                       "and their lengths for `judge` (a cost estimate first; resumable)")
    config_option(p)
    p.add_argument("prompts", type=Path, help='JSON Lines, one {"id"?, "prompt", "reference"?, "task"?} a line')
    p.add_argument("--out", type=Path, required=True,
                   help="the answers file (JSON Lines), appended to as answers arrive; a rerun asks only for the "
                        "(prompt, model) pairs not in it yet")
    p.add_argument("--models", nargs="+", default=(), metavar="MODEL", help="pool models to ask (default: all)")
    p.add_argument("--max-tokens", type=int, default=1024, help="answer tokens a request at most (default 1024)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once (default 8)")
    p.add_argument("--max-cost", type=float, metavar="USD", help="refuse when the cost estimate is above this")
    p.add_argument("--yes", action="store_true", help="send the requests (without it: print the estimate, send "
                                                      "nothing)")
    p.add_argument("--timeout", type=float, help="seconds a request may take, whole (default: [upstream] "
                                                 "response_timeout_s)")
    p.add_argument("--retries", type=int, default=2, help="tries after a failed one, each on the model's next "
                                                          "instance (default 2)")

    p = sub.add_parser("judge", help="score collected answers (a reference rule, else the [judge] endpoint) and "
                                     "write a workload file for `train --workload`")
    config_option(p)
    p.add_argument("answers", type=Path, help="the answers file `collect` wrote")
    p.add_argument("--out", type=Path, required=True,
                   help="the workload file (JSON Lines, replaced); the judge's scores are cached beside it in "
                        "OUT.scores.jsonl, so a rerun asks it only for answers it has not scored")

    p = sub.add_parser("profile", help="rate-sweep one live instance and record TPOT traces for `train`")
    config_option(p)
    p.add_argument("--instance", required=True, help="instance name from the config")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="request rates to sweep, req/s, comma-separated")
    p.add_argument("--requests", type=int, default=200, help="requests per rate (bounds the run)")
    p.add_argument("--out", type=Path, help="trace file (default: <models_dir>/traces/<instance>.jsonl)")

    p = sub.add_parser("bench", help="time the estimators per request at several batch sizes and truncations")
    config_option(p)
    p.add_argument("--prompts", type=int, default=512, help="prompts timed per setting")

    p = sub.add_parser("sim", help="simulate the gateway over the pool in virtual time: one cell, or a named sweep")
    config_option(p)
    p.add_argument("--sweep", choices=sweep_names, metavar="SWEEP",
                   help="run a named sweep instead of one cell: " + ", ".join(sweep_names))
    p.add_argument("--json", action="store_true", help="one cell: print every figure as JSON instead of the table")
    p.add_argument("--requests", type=int,
                   help="held-out prompts per cell (default 2500, the staleness sweep 1200; the paper's held-out set "
                        "is 3534; 2500 keeps the five sweeps at five seeds near 27 minutes on two cores, 3534 near 36)")
    p.add_argument("--seeds", type=int,
                   help="arrival seeds 0..N-1 per cell, reported as means with 95%% bootstrap intervals "
                        "(default: 5 for a sweep; one cell runs on --seed alone unless given)")
    p.add_argument("--workers", type=int, default=2, help="worker processes for a sweep")
    p.add_argument("--out", type=Path, default=Path("loadtest/results"),
                   help="where a sweep writes NAME.{csv,json,png}, NAME_pairs.{csv,json} and NAME_seeds.csv")
    p.add_argument("--workload", help="labelled JSONL replayed cross-fitted: each fold routed by estimators fitted "
                   "on the other folds (default: the synthetic held-out prompts)")
    p.add_argument("--policy", default="routebalance", choices=registry.names(), metavar="POLICY",
                   help="one cell: a registered policy (`routebalance policies` describes each): "
                        + ", ".join(registry.names()))
    p.add_argument("--preset", default="uniform", help="one cell: RouteBalance preset from the config "
                                                           "(quality, uniform, cost, latency, or one of its own)")
    p.add_argument("--rate", type=float, default=12.0, help="one cell: mean arrivals per second")
    p.add_argument("--arrivals", default="poisson", choices=("poisson", "gamma", "square", "azure"),
                   help="one cell: the arrival process (azure: the Azure LLM inference trace's gaps in order, "
                        "scaled to --rate, from ../shared/data/arrivals/; the seed picks where it starts)")
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
                        "the traffic one kind), moe-kind (experts that prefer by kind only, not within it), "
                        "POOL/count-idf or POOL/domain (an moe pool routed by ELDR on the count-IDF signature of "
                        "simulated prefill, or on the domain oracle), W_A (QLM's multi-model GPUs), qos-similar "
                        "(six 7B-like experts), or a config .toml whose instances to use")
    p.add_argument("--compare", default="",
                   help="one cell: also run these policies (comma-separated; `balancers`: round robin, shortest "
                        "queue and power of two choices) on the same prompts and arrivals, and print a table with "
                        "paired differences against --policy (TPOT, E2E)")
    p.add_argument("--progressive", action="store_true",
                   help="one cell: every request asks for progressive mode (PICE: the largest tier sketches, the "
                        "cheapest models expand; [progressive] sets the limits and the fallback rule)")
    p.add_argument("--seed", type=int, default=0, help="one cell: the arrival seed (with --trace, the arrivals' "
                   "jitter within the trace's milliseconds and the tie-breaks; with --multi-turn, the workload)")
    p.add_argument("--trace", type=Path, metavar="FILE",
                   help="one cell: replay a trace in the Mooncake format (prompts as block ids that share prefixes, "
                        "e.g. ../shared/data/prefix-traces/mooncake_conversation_trace.jsonl); --requests: its first "
                        "N rows (default all)")
    p.add_argument("--trace-scale", type=float, default=1 / 8,
                   help="with --trace: prompt lengths and the trace's block size times this (default 1/8: a "
                        "512-token block becomes 64 tokens, to fit 8,192-token windows)")
    p.add_argument("--multi-turn", nargs="?", const="", metavar="MIX",
                   help="one cell: the synthetic prefix-sharing workload (conversations, agent loops, shared system "
                        "prompts and documents, single prompts); MIX as conversation=0.4,agent=0.15,... (default mix)")
    p.add_argument("--prefix-cache", choices=("approximate", "events", "off"),
                   help="one cell: what the gateway knows of the instances' prefix caches (default: the config's "
                        "[scheduler] prefix_cache); the instances cache either way")
    p.add_argument("--load", type=float,
                   help="with --trace or --multi-turn: the arrival rate as a share of the pool's capacity on those "
                        "prompts (measured once with a dispatcher that ignores the cache), instead of --rate")
    p.add_argument("--max-tokens", type=int, dest="answer_cap", metavar="N",
                   help="one cell: every request asks for at most N answer tokens (as loadtest/prefix_live.py "
                        "asks for 128); default: 1024 for the held-out prompts, a trace row's own answer")
    p.add_argument("--replicas", type=int, default=1,
                   help="one cell: gateway replicas behind a round-robin balancer, sharing their in-flight work")
    p.add_argument("--staleness-ms", type=float, default=0.0,
                   help="one cell, replicas: what one replica publishes reaches the others this much later")
    p.add_argument("--sync-ms", type=float,
                   help="one cell, replicas: each publishes its share and reads the others' this often (default: "
                        "[state].sync_interval_s; 0: every decision reads the others' work as it is; inf: never)")

    p = sub.add_parser("calibrate", help="check the simulated world against the paper's testbed: target vs achieved")
    config_option(p)
    p.add_argument("--requests", type=int, default=3534, help="held-out prompts per cell (paper: 3,534)")
    p.add_argument("--seeds", type=int, default=1, help="arrival seeds per cell (figures are their mean)")
    p.add_argument("--workers", type=int, default=2, help="worker processes")
    p.add_argument("--out", type=Path, help="also write the table as CSV here (the docs' calibration page reads "
                                            "loadtest/results/calibration.csv)")

    p = sub.add_parser("train-policy", help="train a learned routing policy in the simulator and export it "
                                            "(qos-rl: soft actor-critic -> ONNX; needs the [train] extra)")
    p.add_argument("policy", choices=("qos-rl", "eldr"),
                   help="the policy to train (eldr: fit its balanced k-means centroids, one per instance of each "
                        "model of the config, into <models_dir>/eldr/, and report them)")
    config_option(p)
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
    p.add_argument("--baseline-rl", action="store_true",
                   help="qos-rl: train the QoS paper's Baseline RL instead (expert-level features only, the QoS "
                        "completed since each decision as reward, no demonstrations; overrides --gain, --penalty "
                        "and --demo-episodes)")
    p.add_argument("--no-drop", action="store_true",
                   help="qos-rl: train with the drop action masked (every request is placed)")
    p.add_argument("--similar-share", type=float, default=0.0,
                   help="qos-rl: share of training episodes on the qos-similar pool of like experts")

def cmd_train(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.training.build import BuildProgress, ensure_built, format_report, train

    config = load_config(args.config)
    out = args.out or Path(config.estimators.models_dir)
    build = ensure_built if args.if_stale else train
    manifest = build(config, out, workload=args.workload, trace_files=args.traces, progress=BuildProgress())
    print(format_report(manifest))
    print(f"artefacts in {out}/")
    return 0


def cmd_collect(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.labelling.collect import CollectSettings, run

    settings = CollectSettings(tuple(args.models), args.max_tokens, args.concurrency, args.max_cost, args.yes,
                               args.timeout, args.retries)
    return run(load_config(args.config), args.prompts, args.out, settings)


def cmd_judge(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.labelling.judging import run

    return run(load_config(args.config), args.answers, args.out)


def cmd_train_policy(args) -> int:
    from gateway.config.store import load_config

    if args.policy == "eldr":
        return _fit_eldr(load_config(args.config), args.seed, args.config)
    if args.seed is None:
        args.seed = 0
    try:
        from gateway.lab.training.qos_rl import TrainSettings, main
    except ImportError as e:
        print(f"error: training needs PyTorch ({e}): pip install 'routebalance-gateway[train]'", file=sys.stderr)
        return 2
    command = (f"routebalance train-policy {args.policy} --seed {args.seed} --budget-s {args.budget_s:g} "
               f"--similar-share {args.similar_share:g} --out {args.out} {'--no-drop ' if args.no_drop else ''}"
               + ("--baseline-rl" if args.baseline_rl else
                  f"--gain {args.gain} --penalty {args.penalty} --demo-episodes {args.demo_episodes}"))
    if args.baseline_rl:
        from gateway.lab.training.qos_rl import baseline_settings

        settings = baseline_settings(seed=args.seed, budget_s=args.budget_s, similar_share=args.similar_share,
                                     drop=not args.no_drop)
    else:
        settings = TrainSettings(seed=args.seed, budget_s=args.budget_s, gain=args.gain, penalty=args.penalty,
                                 demo_episodes=args.demo_episodes, similar_share=args.similar_share,
                                 drop=not args.no_drop)
    result = main(load_config(args.config), settings, args.out, command)
    m = result.meta
    print(f"{m['episodes']} episodes, {m['env_steps']} decisions, {m['updates']} updates in {m['training_s']:.0f} s; "
          f"evaluation QoS {m['start_eval_qos']:.4f} -> {m['best_eval_qos']:.4f} (episode {m['best_episode']}; "
          f"the qos heuristic: {m['heuristic_eval_qos']:.4f})")
    print(f"actor in {result.out_dir}/actor.onnx, learning curve in {result.out_dir}/learning_curve.csv")
    return 0


def _fit_eldr(config, seed: int | None, config_path) -> int:
    """ELDR's centroids for the config's pool, fitted (or found) under its models_dir, and reported."""
    from gateway.artefacts import ArtefactError
    from gateway.estimators.bundle import Estimators
    from gateway.lab.training.centroids import fit_for_config, format_report

    try:  # loaded, not built: fitting centroids must not refit the TPOT heads of a config's new tiers
        estimators = Estimators.load(config)
    except ArtefactError as e:
        print(f"error: {e}: build the estimators first with `routebalance train --config {config_path}`",
              file=sys.stderr)
        return 2
    print(format_report(fit_for_config(config, estimators, seed=seed)))
    return 0


def cmd_profile(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.training.build import tier_lengths
    from gateway.lab.training.profile import live_sweep
    from gateway.lab.training.traces import write_traces
    from gateway.lab.workload.synthetic import generate

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


def cmd_learning_curve(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.experiments.learning_curve import CurveSpec, run

    weights = tuple(float(w) for w in args.weights.split(","))
    if len(weights) != 3 or min(weights) < 0 or sum(weights) <= 0:
        raise ValueError(f"--weights must be three numbers >= 0, not all 0: {args.weights!r}")
    if args.seeds < 1 or args.refresh_every < 1 or args.block < 1 or not 0 <= args.explore_share <= 1:
        raise ValueError("--seeds, --refresh-every and --block must be at least 1, --explore-share in [0, 1]")
    total = sum(weights)
    spec = CurveSpec(tuple(w / total for w in weights), args.refresh_every, args.explore_share, args.min_labels,
                     args.added, args.added_at)
    print(run(load_config(args.config), args.workload, args.seeds, spec, tuple(args.start), args.out, args.block))
    return 0


def cmd_bench(args) -> int:
    from gateway.config.store import load_config
    from gateway.lab.training.bench import run_bench

    print(run_bench(load_config(args.config), prompts=args.prompts))
    return 0


def cmd_sim(args) -> int:
    import orjson

    from gateway.lab.experiments.catalog import REQUESTS
    from gateway.lab.experiments.sweeps import Cell, run_seeded

    if args.trace is not None and args.requests is None:
        from gateway.lab.workload.prefixed import read_mooncake

        args.requests = len(read_mooncake(args.trace, scale=args.trace_scale).rows)  # the whole trace
    if args.requests is None:
        args.requests = REQUESTS.get(args.sweep, 2500)
    if args.requests < 1 or args.workers < 1 or (args.seeds is not None and args.seeds < 1):
        raise ValueError("--requests, --workers and --seeds must be at least 1")
    if args.sweep:
        return _sim_sweep(args)
    from gateway.config.store import load_config
    from gateway.core.slo import BATCH_SLO_S, parse_slo_mix
    from gateway.lab.sim.arrivals import ArrivalSpec
    from gateway.lab.sim.simulator import CellSpec

    models, tags = (), {}
    if args.pool:
        from gateway.lab.sim.pools import named

        named(args.pool)  # an unknown pool is refused before anything runs
        tags = {"pool": args.pool}
    if args.tail is not None:
        from gateway.lab.experiments.slo_sweeps import w_a_mix

        if not 0 <= args.tail <= 1 or args.model or args.pool not in (None, "W_A"):
            raise ValueError("--tail is a share in 0..1, and W_A's requests name their own models (no --model, "
                             "no other --pool)")
        models, tags = w_a_mix(args.tail), {"pool": "W_A"}
    cfg = load_config(args.config)
    w = cfg.weights(args.preset)
    sync_s = cfg.state.sync_interval_s if args.sync_ms is None else args.sync_ms / 1000
    prefixed = _prefix_source(args)
    if prefixed is not None:
        tags |= {"prompts": prefixed.label()}
        if args.load is not None:
            from gateway.lab.experiments.prefix_sweeps import capacity

            if args.answer_cap is not None:
                raise ValueError("--load is a share of the capacity measured with whole answers: give --rate with "
                                 "--max-tokens")
            args.rate = round(args.load * capacity(str(args.config), prefixed, args.requests), 3)
            tags |= {"load": args.load}
    if args.prefix_cache:
        tags |= {"prefix_cache": args.prefix_cache}
    spec = CellSpec(args.policy, (w.quality, w.latency, w.cost),
                    ArrivalSpec(args.arrivals, args.rate, shape=args.shape), args.requests, args.seed,
                    budget_share=args.budget_share, model=args.model, models=models, slos=parse_slo_mix(args.slos),
                    tpot_slo_s=None if args.tpot_slo_ms is None else args.tpot_slo_ms / 1000,
                    mega_share=args.mega_share, stream_below_s=BATCH_SLO_S, replicas=args.replicas,
                    sync_interval_s=sync_s, staleness_s=args.staleness_ms / 1000, progressive=args.progressive,
                    prefixed=prefixed, prefix_cache=args.prefix_cache, answer_cap=args.answer_cap)
    if args.answer_cap is not None:
        tags |= {"max_tokens": args.answer_cap}
    if args.progressive:
        tags |= {"mode": "progressive"}
    if args.replicas > 1:
        from gateway.lab.sim.replicas import sharing_mode

        tags |= {"replicas": args.replicas, "sharing": sharing_mode(args.replicas, sync_s),
                 "sync_ms": 1000 * sync_s, "staleness_ms": args.staleness_ms}
    seeds = [args.seed] if args.seeds is None else list(range(args.seeds))
    if args.compare:
        return _sim_compare(args, spec, tags, seeds)
    result = run_seeded([Cell(args.policy, args.preset, spec, tags=tags)], str(args.config), args.requests,
                        seeds=seeds, workers=min(args.workers, len(seeds)), workload=args.workload)
    if args.json:
        print(orjson.dumps(result.rows[0], option=orjson.OPT_INDENT_2 | orjson.OPT_SERIALIZE_NUMPY).decode())
        return 0
    print(format_rows(result.rows, latency=args.pool is not None))
    print(f"{len(seeds)} seed(s) of {args.requests} requests at {args.rate:g} req/s"
          + (f" on pool {args.pool}" if args.pool else "") + "; ± half the 95% interval where there is one; "
          "--json prints every figure")
    return 0


def _prefix_source(args):
    """The prefix-sharing prompts a one-cell run asks for (--trace, --multi-turn), or None."""
    from gateway.lab.sim.prefixed_cells import PrefixSource

    if args.trace is not None and args.multi_turn is not None:
        raise ValueError("give --trace or --multi-turn, not both")
    if args.load is not None and not 0 < args.load <= 2:
        raise ValueError("--load is a share of the pool's capacity, in (0, 2]")
    if args.trace is not None:
        if not args.trace.is_file():
            raise ValueError(f"--trace: no file at {args.trace}")
        return PrefixSource("trace", str(args.trace), args.trace_scale)
    if args.multi_turn is not None:
        return PrefixSource("synthetic", mix=args.multi_turn)
    if args.load is not None:
        raise ValueError("--load needs --trace or --multi-turn (elsewhere give --rate)")
    return None


BALANCERS = ("passthrough+round_robin", "passthrough+shortest_queue", "passthrough+power_of_two")
COMPARED = ("decode_tpot_p50", "decode_tpot_p99", "e2e_mean")  # what --compare's pairs report, relative too


def _sim_compare(args, spec, tags: dict, seeds: list[int]) -> int:
    """One cell under --policy and under each --compare policy (same prompts, arrivals and seeds): the rows,
    and --policy against each other, request by request (paired 95% intervals)."""
    import dataclasses

    from gateway.lab.experiments.sweeps import Cell, Pair, run_seeded
    from gateway.policies import registry

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
    from gateway.lab.experiments.catalog import ON_CAPACITY, PAIRS, PREFIX_SWEEPS, SWEEPS
    from gateway.lab.experiments.plots import plot_sweep, require_matplotlib
    from gateway.lab.experiments.sweeps import estimate_seconds, run_seeded, write_sweep

    require_matplotlib()  # before the sweep's minutes, not after
    seeds = 5 if args.seeds is None else args.seeds
    if args.sweep in PREFIX_SWEEPS:  # shares of the pool's capacity on prompts that share prefixes
        make_cells, make_pairs, measure = PREFIX_SWEEPS[args.sweep]
        capacity = measure(str(args.config), args.requests)
        print("the pool's capacity: " + ", ".join(f"{k} {v:.2f} req/s" for k, v in capacity.items()), flush=True)
        cells = make_cells(args.requests, capacity)
        pairs = make_pairs(cells)
    elif args.sweep in ON_CAPACITY:
        if not args.workload:
            raise ValueError(f"--sweep {args.sweep} replays a labelled file: give it with --workload FILE")
        make_cells, make_pairs, capacity_cell = ON_CAPACITY[args.sweep]
        probe_cell = capacity_cell(args.requests)
        probe = run_seeded([probe_cell], str(args.config), probe_cell.spec.requests, workload=args.workload).rows[0]
        capacity = probe["throughput"]
        print(f"the pool's capacity on {args.workload}: {capacity:.2f} req/s ({probe['label']} dispatch, "
              f"{probe['rate']:g} req/s offered)", flush=True)
        cells = make_cells(args.requests, capacity)
        pairs = make_pairs(cells)
    else:
        cells = SWEEPS[args.sweep](args.requests)
        pairs = PAIRS[args.sweep](cells)
    estimate = estimate_seconds(cells, args.requests, seeds, args.workers)
    print(f"{args.sweep}: {len(cells)} cells x {seeds} seeds of {args.requests} requests on {args.workers} workers, "
          f"{len(pairs)} paired comparisons; about {duration(estimate)} (more if the cores are shared)", flush=True)
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


def cmd_calibrate(args) -> int:
    """Print the calibration table; exit 1 when a target is missed (the README says which, and why)."""
    from gateway.lab.experiments import calibrate

    checks = calibrate.run(str(args.config), args.requests, args.seeds, args.workers)
    print(calibrate.table(checks))
    if args.out is not None:
        calibrate.write_csv(checks, args.out)
    missed = [c.target.what for c in checks if not c.ok]
    print(f"{len(checks) - len(missed)} of {len(checks)} targets met" + (f"; missed: {'; '.join(missed)}" if missed
                                                                        else ""))
    return 1 if missed else 0


COMMANDS = {"train": cmd_train, "train-policy": cmd_train_policy, "profile": cmd_profile, "bench": cmd_bench,
            "learning-curve": cmd_learning_curve, "sim": cmd_sim, "calibrate": cmd_calibrate,
            "collect": cmd_collect, "judge": cmd_judge}
