"""Check the emulated pool against the paper's testbed, in virtual time.

    python -m gateway.emulator.calibration

prints mean E2E for Poisson load sent only to the 72B tier (a quality-only
router) and spread round-robin over the whole pool, at 6..30 req/s. The
simulator of a later issue replaces this with full policies; this is the
engine-only check the emulator's constants were tuned with. It lives with the
emulator because it answers as the emulator does (its output lengths); the
engine model itself knows nothing of either.
"""

from __future__ import annotations

import random
import statistics

from gateway.emulator.outputs import OutputLengths
from gateway.engine.engine import Engine
from gateway.engine.profiles import arch_for, spec_for_instance


def round_robin_mean_e2e(instances, targets: list[int], rate: float, n: int, seed: int = 0) -> float:
    """Mean E2E (s) of n Poisson arrivals at `rate`, dealt round-robin to instances[targets]."""
    lengths = OutputLengths({i.model: arch_for(i.model).mean_output_tokens for i in instances}, seed=seed)
    engines = [Engine(spec_for_instance(instances[j])) for j in targets]
    rng = random.Random(seed)
    t, done = 0.0, []
    for k in range(n):
        t += rng.expovariate(rate)
        for e in engines:
            done += e.advance(t).finished
        j = k % len(targets)
        output = lengths.for_prompt(f"prompt {k}", instances[targets[j]].model)
        # prompt lengths: log-normal with mean ~85 tokens, like the paper's test set
        engines[j].add(k, prompt_tokens=max(5, int(rng.lognormvariate(4.1, 0.8))), max_tokens=2048,
                       output_tokens=output, now=t)
    for e in engines:
        done += e.advance(t + 1e6).finished
    return statistics.mean(s.finish_time - s.arrival for s in done)


def main() -> None:
    from gateway.config import default_config_path, load_config

    instances = load_config(default_config_path()).instances
    top = [i for i, inst in enumerate(instances) if inst.model == instances[0].model]
    print(f"{'req/s':>6} {'always ' + instances[0].model.split('/')[-1]:>36} {'round robin over the pool':>28}")
    for rate in (6, 12, 18, 24, 30):
        print(f"{rate:>6} {round_robin_mean_e2e(instances, top, rate, 3534):>34.2f} s "
              f"{round_robin_mean_e2e(instances, list(range(len(instances))), rate, 3534):>26.2f} s")


if __name__ == "__main__":
    main()
