"""The swap-aware FCFS baseline (gateway/policies/swap_aware): on a GPU shared by several models it keeps the
loaded model while that model has requests, up to a bound, then swaps to the oldest waiting request's model."""

from __future__ import annotations

import dataclasses
import types

from test_pipeline import view_of

from gateway.config.sections import Config, Instance
from gateway.core.request import Decision, RouteRequest, Ticket
from gateway.lab.experiments.slo_sweeps import W_A_RATE, w_a_mix
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.metrics import summarise
from gateway.lab.sim.pools import w_a
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.policies import registry


def _gpu(*models: str) -> tuple[Instance, ...]:
    """One GPU time-shared by these models, an instance each, plus one GPU of its own (the last index)."""
    prices = {"price_input_per_mtok": 0.1, "price_output_per_mtok": 0.2, "tpot_prior_ms": 20.0}
    shared = [Instance(name=m, url=f"http://127.0.0.1:{9001 + k}", model=m, gpu="A30-24GB", gpu_id="g0", **prices)
              for k, m in enumerate(models)]
    return (*shared, Instance(name="alone", url="http://127.0.0.1:9100", model="alone", gpu="A30-24GB", **prices))


def _ticket(i: int, arrived: float) -> Ticket:
    request = RouteRequest((i,), "p", 10, 100, (1 / 3, 1 / 3, 1 / 3))
    return Ticket(request, "m", False, None, arrived=arrived, decision=Decision((i,)))


def test_the_loaded_model_keeps_the_gpu_for_at_most_a_stretch_and_the_oldest_waiting_request_goes_next():
    instances = _gpu("a", "b", "c")
    cfg = Config(instances=instances, policies=types.MappingProxyType(
        {"swap_aware_fcfs": registry.options_class("swap_aware_fcfs")(max_stretch=2)}))
    policy = registry.build("swap_aware_fcfs", cfg)
    view = view_of(instances)
    a1, b1, a2, c1, a3, b2, b3 = (_ticket(i, t) for t, i in enumerate((0, 1, 0, 2, 0, 1, 1)))
    held = []

    def ask(*tickets: Ticket) -> list[Ticket]:
        """The loop's round: the held requests oldest first, then these new ones; those that go are in flight."""
        gone = []
        for t in [*held, *tickets]:
            if policy.hold(t, view):
                if t not in held:
                    held.append(t)
                continue
            if t in held:
                held.remove(t)
            view.in_flight[t.decision.ranked[0]] += 1
            gone.append(t)
        return gone

    assert ask(a1) == [a1]  # "a" is loaded and nothing else waits
    assert ask(b1) == []  # a swap waits for "a" to drain
    assert ask(a2) == [a2]  # "a" jumps ahead of "b", within its stretch of 2
    assert ask(c1, a3) == []  # the stretch is spent: "a" takes no more while others wait
    view.in_flight[0] = 0  # "a" drained
    assert ask() == [b1]  # the oldest waiting request's model, not "a" again nor "c"
    assert ask(b2, b3) == [b2]  # b's stretch: b1 and b2
    view.in_flight[1] = 0
    assert ask() == [c1]  # c1 arrived before a3: each waits at most for the stretches of older requests' models
    view.in_flight[2] = 0
    assert ask() == [a3] and held == [b3]


def test_a_gpu_of_its_own_sends_everything_at_once():
    instances = _gpu("a", "b")
    policy = registry.build("swap_aware_fcfs", Config(instances=instances))
    view = view_of(instances)
    assert not any(policy.hold(_ticket(2, float(t)), view) for t in range(300))


def test_on_w_a_it_swaps_far_less_than_the_naive_fcfs_and_serves_every_request(small_sim):
    """The same arrivals (the multi-model W_A at its rate, 30% tail) through the naive FCFS (each GPU's own
    first come, first served: a swap whenever the next request is of another model) and the swap-aware one."""
    cfg, est, ev = small_sim
    pool_cfg, pool_ev = w_a(cfg, ev)
    spec = CellSpec("passthrough+round_robin", arrivals=ArrivalSpec("gamma", W_A_RATE, shape=0.5), requests=300,
                    slos=((25.0, 0.5), (300.0, 0.5)), models=w_a_mix(0.3))
    naive, aware = (run_cell(pool_cfg, pool_ev, dataclasses.replace(spec, policy=p), est)
                    for p in ("passthrough+round_robin", "swap_aware_fcfs"))
    assert aware.swaps < naive.swaps / 2, (aware.swaps, naive.swaps)
    assert all(o.instance >= 0 and o.completion_tokens > 0 for o in aware.outcomes)  # every model's requests served
    assert ([pool_cfg.instances[o.instance].model for o in aware.outcomes]
            == [pool_cfg.instances[o.instance].model for o in naive.outcomes])  # each the model it named
    rows = [summarise(r.outcomes, r.models) for r in (naive, aware)]
    assert rows[1]["e2e_mean"] < rows[0]["e2e_mean"]
