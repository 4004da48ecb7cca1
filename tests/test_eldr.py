"""ELDR: balanced centroids, the tau band, the MoE engine model, and locality paying off in a simulated cell.

Everything here runs without the built estimators: the embeddings are made up
(one direction per domain plus noise), which is all ELDR reads of them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from gateway.config.store import default_config_path, load_config
from gateway.core.engine.engine import Engine
from gateway.core.engine.moe import ExpertModel, MoeSpec, expert_domain, union_reduction
from gateway.core.engine.profiles import spec_for_instance
from gateway.core.pool_state import PoolState
from gateway.core.request import Estimates, RouteRequest
from gateway.lab.sim.arrivals import ArrivalSpec
from gateway.lab.sim.evalset import ComputeCost, EvalSet
from gateway.lab.sim.pools import MOE_EXAMPLE
from gateway.lab.sim.simulator import CellSpec, run_cell
from gateway.lab.workload.synthetic import KINDS
from gateway.policies import registry
from gateway.policies.eldr.centroids import balanced_assignment, balanced_kmeans, fit
from gateway.policies.eldr.policy import Eldr, EldrOptions, band_order
from gateway.policies.pipeline.dispatchers import PowerOfTwo

SHARES = {k: v.share for k, v in KINDS.items()}
MOE = load_config(MOE_EXAMPLE)


def blobs(sizes, d: int = 8, spread: float = 0.25, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors around one random direction per blob; (points, blob of each)."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((len(sizes), d))
    blob = np.repeat(np.arange(len(sizes)), sizes)
    x = centres[blob] / np.linalg.norm(centres[blob], axis=1, keepdims=True) + spread * rng.standard_normal(
        (len(blob), d)) / math.sqrt(d)
    return x / np.linalg.norm(x, axis=1, keepdims=True), blob


# ---- balanced k-means ---------------------------------------------------------------------------

def test_balanced_kmeans_gives_each_centroid_its_share_where_plain_nearest_would_not():
    x, _ = blobs([600, 150, 150])  # one crowded region: nearest-centroid clusters would not be even
    centroids, labels = balanced_kmeans(x, 4, seed=0)
    assert np.bincount(labels, minlength=4).tolist() == [225] * 4  # N / K each
    assert np.allclose(np.linalg.norm(centroids, axis=1), 1)
    # The assignment is the balanced one, not each point's nearest centroid (which crowds one region).
    nearest = np.bincount((x @ centroids.T).argmax(axis=1), minlength=4)
    assert nearest.max() > 225
    again, labels_again = balanced_kmeans(x, 4, seed=0)
    assert np.array_equal(centroids, again) and np.array_equal(labels, labels_again)  # deterministic


def test_uneven_counts_are_capped_at_the_ceiling_and_every_point_is_assigned():
    x, _ = blobs([50, 7, 30], seed=3)
    labels = balanced_assignment(x, x[:4])
    counts = np.bincount(labels, minlength=4)
    assert counts.sum() == 87 and counts.max() <= math.ceil(87 / 4)
    fitted = fit(x, 4, calibration=60, seed=1)
    assert fitted.calibration == 60 and fitted.sizes.tolist() == [15] * 4


# ---- the tau band --------------------------------------------------------------------------------

def view_of(instances, running):
    view = PoolState().snapshot(instances, 0.0, 3.0)
    view.running[:] = running
    return view


def decide(tau: float, running, sims: list[float]):
    """ELDR over four instances whose centroids give the one prompt these similarities."""
    instances = MOE.instances[:4]
    # Centroid i's cosine to the prompt e_0 is sims[i]: unit vectors in the (e_0, e_i) plane.
    centroids = np.zeros((4, 5))
    for i, s in enumerate(sims):
        centroids[i, 0], centroids[i, i + 1] = s, math.sqrt(1 - s * s)
    policy = Eldr(EldrOptions(tau=tau), centroids)
    prompt = np.zeros((1, 5))
    prompt[0, 0] = 1.0
    est = Estimates(np.zeros((1, 4)), np.full((1, 4), 100.0), prompt)
    view = view_of(instances, running)
    (d,) = policy.assign([RouteRequest((0, 1, 2, 3), "p", 50, None, (1 / 3, 1 / 3, 1 / 3))], est, view)
    return d, view


def test_tau_zero_is_the_nearest_centroid_whatever_its_load():
    d, view = decide(0.0, [40, 0, 3, 1], [0.9, 0.85, 0.5, 0.2])
    assert d.ranked[0] == 0 and d.detail == pytest.approx(0.9, abs=1e-6)
    assert view.running[0] == 41  # dead reckoning for the batch's next request


def test_the_simulator_s_given_signature_is_refused_clearly_on_embeddings():
    """signature = "given" with a live gateway's prompt embeddings (not one similarity per instance): every request
    of the batch gets a 503 that says what to set, none fails the batch."""
    policy = Eldr(EldrOptions(signature="given"), np.eye(4, dtype=np.float32))
    est = Estimates(np.zeros((2, 4)), np.full((2, 4), 100.0), np.ones((2, 384), dtype=np.float32))
    request = RouteRequest((0, 1, 2, 3), "p", 50, None, (1 / 3, 1 / 3, 1 / 3))
    decisions = policy.assign([request, request], est, view_of(MOE.instances[:4], [0, 0, 0, 0]))
    assert [d.refused.status for d in decisions] == [503, 503]
    assert 'signature = "embedding"' in decisions[0].refused.message


def test_tau_one_is_join_the_shortest_queue_whatever_the_similarity():
    d, _ = decide(1.0, [40, 6, 3, 1], [0.9, 0.85, 0.5, 0.2])
    assert d.ranked == (3, 2, 1, 0)


def test_the_band_takes_the_least_loaded_of_the_close_ones_and_keeps_the_rest_for_retries():
    d, _ = decide(0.1, [40, 6, 3, 1], [0.9, 0.85, 0.5, 0.2])
    assert d.ranked == (1, 0, 2, 3)  # band {0, 1} by load, then the rest by similarity
    # Ties on load go to the emptier relative to its slots, then to the more similar.
    order = band_order(np.array([0.5, 0.55, 0.52]), np.array([2, 2, 2]), np.array([0.1, 0.1, 0.1]), 0.1)
    assert order == [1, 2, 0]


def test_eldr_and_power_of_two_are_registered_and_config_reloadable():
    assert "eldr" in registry.names() and "passthrough+power_of_two" in registry.names()
    cfg = load_config(default_config_path())
    assert cfg.options("eldr").tau == 0.1 and MOE.options("eldr").tau == 0.1
    assert cfg.with_options("eldr", tau=0.3).options("eldr").tau == 0.3
    with pytest.raises(ValueError):
        EldrOptions(tau=-0.1)


def test_power_of_two_takes_the_shorter_of_two_random_instances():
    view = view_of(MOE.instances[:4], [9, 5, 0, 7])
    p2c = PowerOfTwo(seed=0)
    firsts = [p2c.rank([0, 1, 2, 3], view)[0] for _ in range(300)]
    counts = np.bincount(firsts, minlength=4)
    assert counts[0] == 0  # the longest queue never wins a pair
    assert counts[2] > counts[1] > counts[3] > 0  # the shortest wins every pair it is drawn into (half of them)


# ---- the engine's MoE mode ------------------------------------------------------------------------

def test_same_domain_batches_activate_fewer_experts_as_calibrated():
    model = ExpertModel(MoeSpec())
    for batch in (8, 16, 32):
        same, mixed, reduction = union_reduction(model, SHARES, batch)
        assert 0.17 <= reduction <= 0.21, (batch, reduction)  # the paper's Observation 1: 17-21%
        assert same < mixed <= 128
    one = model.domain("code")
    assert model.union({one: 1}) == pytest.approx(8.0)  # one token: exactly its top-k
    assert model.union({model.NEUTRAL: 200}) > model.union({one: 200})
    flat = ExpertModel(MoeSpec(concentration=0.0))
    assert union_reduction(flat, SHARES, 16)[2] == pytest.approx(0.0, abs=1e-9)  # no concentration, no locality


def decode_tpot(domains: list[str | None]) -> float:
    """Mean time per output token of a batch of requests that start together on one MoE instance."""
    engine = Engine(spec_for_instance(MOE.instances[0]))
    for k, domain in enumerate(domains):
        engine.add(k, prompt_tokens=60, max_tokens=200, output_tokens=100, now=0.0, domain=domain)
    done = engine.advance(1e4).finished
    assert len(done) == len(domains)
    return float(np.mean([(s.finish_time - s.first_token_time) / (s.generated - 1) for s in done]))


def test_a_mixed_batch_decodes_slower_than_a_same_domain_batch_of_the_same_size():
    kinds = list(SHARES)
    # Prompts of one kind (in the example's world, spread over the kind's hidden subdomains), and of every kind.
    same = decode_tpot([expert_domain("math", f"question {k}") for k in range(21)])
    mixed = decode_tpot([expert_domain(kinds[k % len(kinds)], f"question {k}") for k in range(21)])
    assert mixed > 1.1 * same
    assert decode_tpot(["math"]) == pytest.approx(MOE.instances[0].tpot_prior_ms / 1000, rel=0.01)  # alone: prior
    # The MoE layers dominate a batch's step.
    assert same > 2.5 * MOE.instances[0].tpot_prior_ms / 1000
    # A dense tier is unchanged by domains.
    dense = Engine(spec_for_instance(load_config(default_config_path()).instances[0]))
    assert dense.experts is None


# ---- locality pays off in a simulated cell ------------------------------------------------------

N = 700
D = 16


class CentroidStub:
    """What eldr asks of the estimators: centroids fitted on training prompts (made-up embeddings here)."""

    def __init__(self, train: np.ndarray):
        self.train = train

    def eldr_centroids(self, k: int, calibration: int, seed: int) -> np.ndarray:
        return fit(self.train, k, calibration, seed).centroids


def embeddings_of(kinds: list[str], rng: np.random.Generator) -> np.ndarray:
    centres = np.random.default_rng(99).standard_normal((len(SHARES), D))
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    idx = np.array([list(SHARES).index(k) for k in kinds])
    x = centres[idx] + 0.5 * rng.standard_normal((len(kinds), D)) / math.sqrt(D)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def make_moe_cell(seed: int = 5):
    """(config, evaluation set, estimators stub) of the MoE example pool over N made-up prompts."""
    rng = np.random.default_rng(seed)
    names, shares = list(SHARES), np.array(list(SHARES.values()))
    kinds = [names[k] for k in rng.choice(len(names), size=N, p=shares / shares.sum())]
    train_kinds = [names[k] for k in rng.choice(len(names), size=1500, p=shares / shares.sum())]
    cfg = dataclasses.replace(load_config(default_config_path()), instances=MOE.instances)
    width = len(cfg.instances)
    ev = EvalSet(tuple(f"prompt {r}" for r in range(N)), np.full(N, 60), np.zeros((N, width)),
                 np.repeat(np.clip(rng.lognormal(math.log(150), 0.6, N), 20, 1000).round()[:, None], width, axis=1),
                 np.zeros((N, width)), np.full((N, width), 150.0), embeddings_of(kinds, rng),
                 ComputeCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0), tuple(kinds))
    return cfg, ev, CentroidStub(embeddings_of(train_kinds, rng))


@pytest.fixture(scope="module")
def moe_cell():
    return make_moe_cell()


def median_tpot(result) -> float:
    served = [o for o in result.outcomes if o.instance >= 0 and o.completion_tokens > 1]
    return float(np.median([(o.finished - o.first_token) / (o.completion_tokens - 1) for o in served]))


def test_eldr_beats_round_robin_on_median_tpot_in_a_moe_cell(moe_cell):
    cfg, ev, est = moe_cell
    tpot = {}
    for policy in ("eldr", "passthrough+round_robin"):
        spec = CellSpec(policy, arrivals=ArrivalSpec(rate=24), requests=N, seed=1)
        tpot[policy] = median_tpot(run_cell(cfg, ev, spec, est))
    assert tpot["eldr"] < 0.95 * tpot["passthrough+round_robin"], tpot
    # Without domains (every prompt unknown: uniform routing) locality buys nothing.
    blind = dataclasses.replace(ev, kinds=())
    spec = CellSpec("eldr", arrivals=ArrivalSpec(rate=24), requests=N, seed=1)
    rr = CellSpec("passthrough+round_robin", arrivals=ArrivalSpec(rate=24), requests=N, seed=1)
    assert median_tpot(run_cell(cfg, blind, spec, est)) == pytest.approx(median_tpot(run_cell(cfg, blind, rr, est)),
                                                                         rel=0.06)
