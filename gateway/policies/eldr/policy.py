"""ELDR, expert-locality decode routing (papers/eldr-expert-locality-routing.txt), for mixture-of-experts tiers.

A mixture-of-experts decode step loads every expert its batch activates, and
requests of one domain activate overlapping experts: an instance whose batch
holds one domain decodes faster than one whose batch is mixed. ELDR routes
each request near requests like it, without giving up on load:

- Signatures (`signature`): "embedding", the prompt's MiniLM embedding (the
  gateway's estimators compute it for every batch; the live gateway routes
  before any prefill, so it has no expert activations to read); or "given":
  the estimates carry each request's similarity to each instance's centroid,
  computed outside the policy from a signature the gateway cannot see. The
  simulator gives these for the paper's count-IDF signature of the simulated
  prefill's expert activations (signature.py; sim/moe_signatures.py) and for
  the domain oracle (a one-hot of the true kind).
- Centroids ("embedding"): one per instance, by balanced k-means over the
  training prompts' embeddings (each centroid takes at most ceil(N/K) of the
  N calibration prompts; policies/eldr/centroids.py), or plain k-means
  (`balanced = false`: the paper's vanilla K-means, no cap on a cluster).
  Each model's instances get the K centroids of their own count K, in config
  order.
- The tau band: a request's similarity to each candidate's centroid is its
  cosine, floored at 0 (so similarities lie in [0, 1], as the paper's count
  signatures do); among the candidates within `tau` of the best similarity,
  the least loaded (requests running and waiting on it, from the pool view,
  dead-reckoned through the batch) takes it; ties go to the emptier relative
  to its slots, then to the more similar. tau = 0 is pure locality (top-1),
  tau >= 1 pure load (join the shortest queue). The rest of the candidates
  follow (band first, then by similarity), for retries.

ELDR balances within a tier and ignores quality and cost, like the load
balancers it is compared with; give it a pool (or a `model`) of one MoE tier.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from gateway.config_schema import Section, option, section
from gateway.core.policy import LIGHT_COMPUTE_S, Policy, PolicyContext, PolicyEntry
from gateway.core.request import Decision, Estimates, Refusal, RouteRequest
from gateway.core.view import PoolView
from gateway.policies.eldr.centroids import calibration_sample, plain_kmeans


@section
class EldrOptions(Section):
    """[policies.eldr]: the locality band, and how the centroids are fitted."""

    tau: float = option(0.1, ge=0)  # the band: within tau of the best centroid similarity (0: top-1; 1: JSQ)
    calibration: int = option(1000, ge=2)  # training prompts the centroids are fitted on (the paper's 1,000)
    seed: int = 0  # k-means seeding and the calibration sample; tie-breaks
    # "embedding": MiniLM prompt embeddings against fitted centroids; "given": the estimates already hold each
    # request's similarity to each instance's centroid (the simulator's count-IDF and domain-oracle signatures)
    signature: Literal["embedding", "given"] = "embedding"
    balanced: bool = True  # balanced k-means (the paper's); false: plain k-means (its vanilla K-means)


def band_order(similarity: np.ndarray, load: np.ndarray, relative_load: np.ndarray, tau: float,
               tie: np.ndarray | None = None) -> list[int]:
    """Positions in the order ELDR ranks them: the band (similarity >= best - tau) by load, then relative
    load, then similarity (highest first), then `tie`; then the others by similarity."""
    tie = np.zeros(len(similarity)) if tie is None else tie
    best = similarity.max()
    in_band = similarity >= best - tau - 1e-12
    band = np.flatnonzero(in_band)
    band = band[np.lexsort((tie[band], -similarity[band], relative_load[band], load[band]))]
    rest = np.flatnonzero(~in_band)
    rest = rest[np.lexsort((tie[rest], -similarity[rest]))]
    return [int(k) for k in band] + [int(k) for k in rest]


class Eldr(Policy):
    name = "eldr"
    needs_estimates = True  # the prompt embeddings

    def __init__(self, options: EldrOptions, centroids: np.ndarray):
        """`centroids`: (instances, d) unit rows, instance i's centroid in row i."""
        self.options = options
        self.centroids = np.asarray(centroids, dtype=np.float32)
        self.rng = np.random.default_rng(options.seed)

    def similarity(self, embeddings: np.ndarray) -> np.ndarray:
        """(n, instances) cosine of each prompt to each instance's centroid, floored at 0 ("given": the
        estimates' own columns, one per instance)."""
        x = np.asarray(embeddings, dtype=np.float32)
        if self.options.signature == "given":  # (assign has refused a batch without one column per instance)
            return np.clip(x, 0.0, 1.0)
        return np.clip(x @ self.centroids.T, 0.0, 1.0)

    def assign(self, batch: Sequence[RouteRequest], estimates: Estimates | None, view: PoolView) -> list[Decision]:
        if estimates is None or estimates.embeddings is None:
            raise ValueError("eldr needs the batch's prompt embeddings")
        if self.options.signature == "given" and estimates.embeddings.shape[1] != len(self.centroids):
            # a live gateway configured with the simulator's signature: refuse clearly, never fail the batch
            refusal = Refusal(503, 'eldr with [policies.eldr] signature = "given" routes only in the simulator, '
                                   'which gives each request\'s similarities; set signature = "embedding"',
                              "policy_unavailable")
            return [Decision((), refused=refusal) for _ in batch]
        sims = self.similarity(estimates.embeddings)
        decisions = []
        for r, req in enumerate(batch):
            cands = view.usable(req.candidates)
            idx = np.asarray(cands, dtype=np.int64)
            active = view.active[idx]
            order = band_order(sims[r, idx], active, active / view.max_num_seqs[idx], self.options.tau,
                               self.rng.random(len(idx)))
            ranked = tuple(cands[k] for k in order)
            best = ranked[0]
            predicted = view.predicted(req, estimates, r, best)
            decisions.append(Decision(ranked, latency_s=float(view.tpot_prior_s[best] * predicted["tokens"]),
                                      detail=float(sims[r, best]), **predicted))
            view.dispatched(best, predicted["tokens"], req.input_tokens)  # dead reckoning: the next request sees it
        return decisions

    def compute_s(self, batch_size: int, cost: Any) -> float:
        return LIGHT_COMPUTE_S  # one (batch x instances) product over the embeddings the estimators made


def instance_centroids(instances: Sequence, fit) -> np.ndarray:
    """Each instance's centroid: each model's instances, in config order, get the K centroids of their count K.
    `fit(k)` gives K unit centroids."""
    rows: list[np.ndarray | None] = [None] * len(instances)
    by_model: dict[str, list[int]] = {}
    for i, inst in enumerate(instances):
        by_model.setdefault(inst.model, []).append(i)
    for members in by_model.values():
        centroids = fit(len(members))
        for j, i in enumerate(members):
            rows[i] = centroids[j]
    return np.stack([r for r in rows if r is not None])


def build(context: PolicyContext) -> Eldr:
    est = context.estimators
    if est is None:
        raise ValueError("eldr needs the estimators (the prompt embeddings and the training prompts its centroids "
                         "are fitted on): run `routebalance train`")
    options = context.options("eldr")
    if options.signature == "given":  # the similarities come with the estimates: no centroids of its own
        return Eldr(options, np.eye(len(context.config.instances), dtype=np.float32))
    if options.balanced:
        def fit(k: int) -> np.ndarray:
            return est.eldr_centroids(k, options.calibration, options.seed)
    else:
        training = training_embeddings(est)

        def fit(k: int) -> np.ndarray:
            sample = training[calibration_sample(training, options.calibration, options.seed)]
            return plain_kmeans(sample, k, seed=options.seed)[0].astype(np.float32)
    return Eldr(options, instance_centroids(context.config.instances, fit))


def training_embeddings(est) -> np.ndarray:
    """The training prompts' embeddings (the KNN index's vectors), which plain k-means is fitted on (balanced
    fits are stored by the estimators; a plain fit is quick enough to make on each build)."""
    index = est.knn.index
    return index.reconstruct_n(0, index.ntotal)


OPTIONS = {"eldr": EldrOptions}
ENTRIES = (PolicyEntry("eldr", build, "ELDR: the least loaded instance among those whose prompt-embedding centroid "
                                      "is within tau of the best (expert locality for MoE tiers)",
                       needs_estimates=True),)
