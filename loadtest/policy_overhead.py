"""Decision overhead of the SLO-aware policies: CPU time in their hooks per request, under load.

    python loadtest/policy_overhead.py [--policies qlm,edf,qos,qos-rl] [--requests 2500] [--rate 40] [--model auto]

Runs one simulated cell per policy (the QLM sweep's W_C workload: bursty arrivals on the 7B tier,
half interactive and half batch SLOs, 5% mega prompts) and times every hook the policy runs:
`admit`, `assign`, `hold` (request pulling and the plans it makes), `evict` and the lifecycle
events. The total over the cell divided by its requests is the per-request overhead the paper
bounds (QLM: under 10 ms; the QoS router: about 5 ms). The estimators' own cost (embedding, KNN)
is the same for every policy and is measured by `routebalance bench`.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

HOOKS = ("admit", "assign", "hold", "evict", "on_dispatch", "on_first_token", "on_progress", "on_complete")


def timed_cell(cfg, ev, est, policy: str, requests: int, rate: float, model: str | None) -> dict[str, list[float]]:
    from gateway.core.policy import Policy
    from gateway.lab.experiments.slo_sweeps import MEGA_SHARE, SLO_MIX, STREAM_BELOW_S
    from gateway.lab.sim.arrivals import ArrivalSpec
    from gateway.lab.sim.simulator import CellSpec, run_cell
    from gateway.policies import registry

    times: dict[str, list[float]] = defaultdict(list)
    cls = type(registry.build(policy, cfg, est))
    # The hooks the policy implements, on its own class or a base of it (the Policy defaults do nothing).
    originals = {h: getattr(cls, h) for h in HOOKS if getattr(cls, h) is not getattr(Policy, h)}
    own = {h for h in originals if h in vars(cls)}

    def wrap(name, fn):
        def timed(*args, **kw):
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                times[name].append(time.perf_counter() - start)
        return timed

    try:
        for name, fn in originals.items():
            setattr(cls, name, wrap(name, fn))
        spec = CellSpec(policy, (1 / 3, 1 / 3, 1 / 3), ArrivalSpec("gamma", rate, shape=0.5), requests,
                        slos=SLO_MIX, stream_below_s=STREAM_BELOW_S, model=model, mega_share=MEGA_SHARE,
                        tpot_slo_s=0.05)
        run_cell(cfg, ev, spec, est)
    finally:
        for name, fn in originals.items():
            if name in own:
                setattr(cls, name, fn)
            else:
                delattr(cls, name)  # inherited again
    return times


def main() -> None:
    from gateway.config.store import default_config_path, load_config
    from gateway.lab.experiments.slo_sweeps import ONE_MODEL
    from gateway.lab.sim.evalset import load_evalset
    from gateway.lab.training.build import built_estimators

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="qlm,edf,qos,qos-rl")
    ap.add_argument("--requests", type=int, default=2500)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--model", default=ONE_MODEL,
                    help="the pool model every request names (W_C: the 7B tier's five instances), or 'auto' for "
                         "the whole 13-instance pool")
    args = ap.parse_args()
    cfg = load_config(default_config_path())
    est = built_estimators(cfg)
    ev = load_evalset(cfg, args.requests, estimators=est)
    print(f"{'policy':<10} {'ms/request':>10}  per hook: calls, mean ms, max ms")
    for policy in args.policies.split(","):
        times = timed_cell(cfg, ev, est, policy, args.requests, args.rate, None if args.model == "auto" else args.model)
        total = sum(sum(v) for v in times.values())
        hooks = "  ".join(f"{h} {len(v)}x {1000 * sum(v) / len(v):.3f}/{1000 * max(v):.2f}"
                          for h, v in times.items() if v)
        print(f"{policy:<10} {1000 * total / args.requests:>10.3f}  {hooks}", flush=True)


if __name__ == "__main__":
    main()
