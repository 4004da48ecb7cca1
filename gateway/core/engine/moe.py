"""Mixture-of-experts decode cost: a step loads every expert the batch activates.

A decode step of a mixture-of-experts model is memory-bound, and its MoE
layers read the weights of each distinct expert some token of the step
routes to: the union of the batch's experts, not the number of tokens, sets
the MoE layers' time (ELDR, papers/eldr-expert-locality-routing.txt,
Observation 1 and Fig. 2). Requests of one domain route to overlapping
experts, so a batch of one domain loads fewer experts than a mixed one.

The model here, per MoE tier (config `[instances.moe]`):

- Each domain (a prompt's `kind` in the labelled workload: code, math, ...)
  has, per layer, a preferred expert distribution: a softmax over the
  experts of `concentration` x a Gaussian draw that mixes a part shared by
  every domain (`shared`: experts every domain likes, which the paper's
  signatures down-weight with IDF) with the domain's own part. It is fixed by
  (seed, domain name, layer), so the emulator and the simulator agree.
- A token of domain d activates expert e of layer l with probability
  pi_d(l, e) = min(1, k x q_d(l, e)) (rescaled so each token activates
  exactly k = experts_per_token experts on average): the inclusion
  probabilities of top-k routing.
- Tokens activate independently, so the expected number of distinct experts
  a step loads in layer l is, in closed form over the step's tokens per domain
  n_d, union_l = sum_e 1 - prod_d (1 - pi_d(l, e)) ** n_d; `union` is its mean
  over the layers. One token activates exactly k.
- A step's MoE time is proportional to fixed_experts + union: loading the
  experts, plus what does not grow with them (routing, launches); the paper's
  measurement (16 -> 128 active experts: 4.7x the MoE-layer latency) gives
  fixed_experts of about 14.
- The step (engine.py) splits a lone decode step into the MoE layers'
  `moe_share` and the dense rest (attention, KV reads, the batch slope):

      step = tpot * ((1 - moe_share) * dense + moe_share * (fixed + union) / (fixed + k)) + prefill

  so one request alone still decodes at the tier's tpot_prior_ms.

A prompt whose domain is unknown (None: not from the workload) routes to the
experts uniformly (pi = k / E), the most expensive neighbour to batch with.

Functional core: no I/O, no clock. Unions are cached per batch composition
(bounded), since the running batch of a decode keeps one composition for
many steps.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

_CACHE_LIMIT = 8192  # batch compositions whose union is kept (an engine meets a few hundred)


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """A mixture-of-experts tier's routing shape and cost split (see the module docstring)."""

    experts: int = 128  # routed experts per MoE layer
    experts_per_token: int = 8  # top-k
    layers: int = 48  # MoE layers
    concentration: float = 1.3  # how peaked a domain's preferred experts are (0: uniform)
    shared: float = 0.3  # share of the preference every domain has in common
    moe_share: float = 0.6  # of a lone decode step, the MoE layers' part
    fixed_experts: float = 14.0  # MoE-layer time that does not grow with the experts loaded, in experts' worth
    seed: int = 0  # of the domains' expert preferences

    def __post_init__(self):
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError("need 1 <= experts_per_token <= experts")
        if self.layers < 1 or self.concentration < 0 or not 0 <= self.shared <= 1:
            raise ValueError("need layers >= 1, concentration >= 0 and shared in [0, 1]")
        if not 0 < self.moe_share < 1 or self.fixed_experts < 0:
            raise ValueError("need moe_share in (0, 1) and fixed_experts >= 0")


def _seed_of(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8, person=b"moe-expt").digest()
    return int.from_bytes(digest, "big")


def inclusion(q: np.ndarray, k: int) -> np.ndarray:
    """Per-row inclusion probabilities of a top-k draw from the distributions q (..., E): k x q, capped
    at 1, the excess spread over the uncapped experts in proportion, so each row sums to k."""
    pi = k * q / q.sum(axis=-1, keepdims=True)
    for _ in range(q.shape[-1]):
        over = pi > 1.0
        if not over.any():
            break
        excess = (pi - 1.0).clip(min=0).sum(axis=-1, keepdims=True)
        pi = np.where(over, 1.0, pi)
        free = np.where(pi < 1.0, pi, 0.0)
        pi = pi + np.where(pi < 1.0, excess * free / np.maximum(free.sum(axis=-1, keepdims=True), 1e-300), 0.0)
    return np.minimum(pi, 1.0)


class ExpertModel:
    """The domains' expert activation probabilities for one tier, and the union a batch activates."""

    NEUTRAL = -1  # the index of a domain not known (uniform routing)

    def __init__(self, spec: MoeSpec):
        self.spec = spec
        self._index: dict[str, int] = {}
        self._log_miss: list[np.ndarray] = []  # per domain: (layers, experts) log(1 - pi)
        uniform = np.full((spec.layers, spec.experts), spec.experts_per_token / spec.experts)
        self._neutral = np.log1p(-np.minimum(uniform, 1 - 1e-12))
        self._shared = np.random.default_rng(_seed_of(spec.seed, "shared")).standard_normal(
            (spec.layers, spec.experts))
        self._cache: dict[tuple, float] = {}

    def domain(self, name: str | None) -> int:
        """The index of a domain by name (its preferences drawn on first use); None: NEUTRAL."""
        if name is None:
            return self.NEUTRAL
        found = self._index.get(name)
        if found is None:
            found = self._index[name] = len(self._log_miss)
            self._log_miss.append(np.log1p(-np.minimum(self.activation(name), 1 - 1e-12)))
        return found

    def activation(self, name: str | None) -> np.ndarray:
        """(layers, experts) probability that one token of the domain activates each expert."""
        spec = self.spec
        if name is None:
            return np.full((spec.layers, spec.experts), spec.experts_per_token / spec.experts)
        own = np.random.default_rng(_seed_of(spec.seed, "domain", name)).standard_normal((spec.layers, spec.experts))
        logits = spec.concentration * (np.sqrt(spec.shared) * self._shared + np.sqrt(1 - spec.shared) * own)
        q = np.exp(logits - logits.max(axis=1, keepdims=True))
        return inclusion(q, spec.experts_per_token)

    def union(self, counts: Mapping[int, float] | Iterable[tuple[int, float]]) -> float:
        """Expected distinct experts per MoE layer (mean over layers) that a step of these tokens loads:
        `counts` maps a domain index to its tokens in the step."""
        items = tuple(sorted((d, n) for d, n in (counts.items() if isinstance(counts, Mapping) else counts) if n > 0))
        if not items:
            return 0.0
        found = self._cache.get(items)
        if found is None:
            log_none = sum(n * (self._neutral if d == self.NEUTRAL else self._log_miss[d]) for d, n in items)
            found = float((1.0 - np.exp(log_none)).sum(axis=1).mean())
            if len(self._cache) >= _CACHE_LIMIT:
                self._cache.clear()
            self._cache[items] = found
        return found

    def moe_factor(self, union: float) -> float:
        """The MoE layers' time at this union, relative to one token's (k experts)."""
        spec = self.spec
        return (spec.fixed_experts + union) / (spec.fixed_experts + spec.experts_per_token)

    def step_factor(self, dense: float, union: float) -> float:
        """A step's time in lone-decode-steps: the dense part (1 for one token) and the MoE layers' part."""
        share = self.spec.moe_share
        return (1.0 - share) * dense + share * self.moe_factor(union)


def union_reduction(model: ExpertModel, shares: Mapping[str, float], batch: int) -> tuple[float, float, float]:
    """(same-domain union, mixed union, 1 - same / mixed) for a decode batch of `batch` requests: a
    same-domain batch is all of one domain (averaged over the domains, by share), a mixed one has
    each domain in proportion to its share (expected counts)."""
    total = sum(shares.values())
    idx = {name: model.domain(name) for name in shares}
    same = sum(w / total * model.union({idx[name]: batch}) for name, w in shares.items())
    mixed = model.union({idx[name]: batch * w / total for name, w in shares.items()})
    return same, mixed, 1.0 - same / mixed
