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
- Within a kind, prompts differ (`within` > 0): each kind has `subdomains`
  subdomains, and `within` of a prompt's own part is its subdomain's draw.
  A prompt's subdomain is fixed by a hash of its text (`expert_domain`), so
  neither its kind label nor what its words mean tells it: only its expert
  activations do. within = 0 is the kind alone (the world the results had
  before; the paper's Observation 1 was calibrated there).
- Prefill tokens read the prompt and decode tokens write the answer, so
  their experts agree only in part (the paper's Fig. 3: per-expert
  correlation 0.70-0.92): `prefill_noise` of a domain's own part is, for
  its prefill tokens, a prefill-only draw (`prefill_counts`, what a
  count-IDF signature is built from).
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
    within: float = 0.0  # share of a domain's own preference that is its subdomain's (0: the kind alone)
    subdomains: int = 1  # per kind; a prompt's is fixed by its text's hash (hidden from its kind and meaning)
    prefill_noise: float = 0.0  # share of a domain's own preference that its prefill tokens draw afresh

    def __post_init__(self):
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError("need 1 <= experts_per_token <= experts")
        if self.layers < 1 or self.concentration < 0 or not 0 <= self.shared <= 1:
            raise ValueError("need layers >= 1, concentration >= 0 and shared in [0, 1]")
        if not 0 < self.moe_share < 1 or self.fixed_experts < 0:
            raise ValueError("need moe_share in (0, 1) and fixed_experts >= 0")
        if not 0 <= self.within <= 1 or self.subdomains < 1 or not 0 <= self.prefill_noise <= 1:
            raise ValueError("need within and prefill_noise in [0, 1] and subdomains >= 1")

    @property
    def structured(self) -> bool:
        """Whether prompts of one kind differ in their experts (subdomains)."""
        return self.within > 0 and self.subdomains > 1


def _seed_of(*parts: object) -> int:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8, person=b"moe-expt").digest()
    return int.from_bytes(digest, "big")


def expert_domain(kind: str | None, text: str) -> str | None:
    """The domain a prompt's tokens route by: its kind and a key of its text ("kind#key"; an MoE tier with
    subdomains takes the prompt's subdomain from the key), or None for a prompt of no known kind."""
    if kind is None:
        return None
    key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8, person=b"moe-subd").hexdigest()
    return f"{kind}#{key}"


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
        self._prefill: dict[str | None, np.ndarray] = {}  # per domain: prefill activation probabilities

    def canonical(self, name: str) -> str:
        """The domain a name routes by on this tier: "kind/sub" with subdomains, else the kind. A name is a
        kind, "kind/sub", or expert_domain's "kind#key"."""
        kind, sep, key = name.partition("#")
        if not sep:
            return name if self.spec.structured else name.partition("/")[0]
        return f"{kind}/{int(key, 16) % self.spec.subdomains}" if self.spec.structured else kind

    def domain(self, name: str | None) -> int:
        """The index of a domain by name (its preferences drawn on first use); None: NEUTRAL."""
        if name is None:
            return self.NEUTRAL
        name = self.canonical(name)
        found = self._index.get(name)
        if found is None:
            found = self._index[name] = len(self._log_miss)
            self._log_miss.append(np.log1p(-np.minimum(self.activation(name), 1 - 1e-12)))
        return found

    def _own(self, name: str) -> np.ndarray:
        """A domain's own part of its preference (standard normal per layer and expert): its kind's, mixed
        with its subdomain's on a tier with subdomains."""
        spec, shape = self.spec, (self.spec.layers, self.spec.experts)
        kind, _, sub = name.partition("/")
        own = np.random.default_rng(_seed_of(spec.seed, "domain", kind)).standard_normal(shape)
        if sub and spec.structured:
            part = np.random.default_rng(_seed_of(spec.seed, "subdomain", kind, sub)).standard_normal(shape)
            own = np.sqrt(1 - spec.within) * own + np.sqrt(spec.within) * part
        return own

    def activation(self, name: str | None, prefill: bool = False) -> np.ndarray:
        """(layers, experts) probability that one token of the domain activates each expert: a decode token's,
        or (prefill) a prompt token's."""
        spec = self.spec
        if name is None:
            return np.full((spec.layers, spec.experts), spec.experts_per_token / spec.experts)
        name = self.canonical(name)
        own = self._own(name)
        if prefill and spec.prefill_noise > 0:
            fresh = np.random.default_rng(_seed_of(spec.seed, "prefill", name)).standard_normal(own.shape)
            own = np.sqrt(1 - spec.prefill_noise) * own + np.sqrt(spec.prefill_noise) * fresh
        logits = spec.concentration * (np.sqrt(spec.shared) * self._shared + np.sqrt(1 - spec.shared) * own)
        q = np.exp(logits - logits.max(axis=1, keepdims=True))
        return inclusion(q, spec.experts_per_token)

    def prefill_counts(self, name: str | None, tokens: int, rng: np.random.Generator) -> np.ndarray:
        """(layers, experts) how many of a prompt's `tokens` prefill tokens each expert took: each token
        activates each expert with its prefill probability (top-k inclusion, drawn independently)."""
        key = None if name is None else self.canonical(name)
        pi = self._prefill.get(key)
        if pi is None:
            pi = self._prefill[key] = self.activation(key, prefill=True)
        return rng.binomial(max(int(tokens), 1), pi)

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
