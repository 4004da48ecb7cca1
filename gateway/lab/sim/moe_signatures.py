"""Signatures the gateway cannot compute, for ELDR's arms on the simulated mixture-of-experts pool.

The live gateway routes a request before any prefill, so the only signature
it has is the prompt's MiniLM embedding. The paper's ELDR routes decode
after a disaggregated prefill and reads that prefill's expert activations
(the count-IDF signature, policies/eldr/signature.py); its Domain baseline
reads the request's true label. Only the simulator has either, so it
computes them here, outside the policy, and hands the policy each request's
similarity to each instance's centroid (`[policies.eldr] signature =
"given"`; pools.py's "<pool>/count-idf" and "<pool>/domain"):

- count-idf: each prompt's prefill is simulated on the pool's MoE tier
  (engine/moe.py `prefill_counts`: each of its prompt tokens activates each
  expert with the prefill probability of its domain and subdomain; the draw
  is seeded by the prompt's text, so a prompt always activates the same
  experts). IDF and centroids (balanced k-means, one per instance, as the
  policy fits them) come from CALIBRATION prompts of the training stream,
  never from the prompts the cell replays.
- domain: the signature is a one-hot of the prompt's true kind, centroids
  by the same balanced k-means over the calibration prompts' kinds (a kind
  with more than its share of traffic gets several instances, small kinds
  share one), so the oracle is as balanced as ELDR.

`python -m gateway.lab.experiments.eldr_eval` measures the signatures' quality
the paper's way (Spearman rank correlation between pairwise signature
distances and pairwise decode-activation distances) for the embedding, the
count-IDF and the domain signatures on the evaluation prompts.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from gateway.core.engine.moe import ExpertModel, expert_domain
from gateway.core.engine.profiles import moe_spec
from gateway.lab.sim.evalset import EvalSet, domain_of, prompt_tokens_of
from gateway.policies.eldr.centroids import balanced_kmeans
from gateway.policies.eldr.signature import idf, signatures

CALIBRATION = 1000  # calibration prompts, the paper's (and [policies.eldr].calibration's)
SEED = 0  # of the balanced k-means, as [policies.eldr].seed
CHUNK = 256  # prompts whose counts are held at once (48 x 128 per prompt)
_MEMO: dict[tuple, np.ndarray] = {}  # per process: a sweep's cells share one pool's similarities
MEMO_ENTRIES = 8  # (signature, pool, prompt set) kept at most, the oldest dropped first: a sweep uses two or three


def tier(cfg) -> ExpertModel:
    """The expert model of the pool's one mixture-of-experts tier."""
    specs = {moe_spec(inst.moe) for inst in cfg.instances}
    spec = specs.pop() if len(specs) == 1 else None
    if spec is None:
        raise ValueError("ELDR's signatures need a pool of one mixture-of-experts tier")
    return ExpertModel(spec)


def calibration_set(cfg, n: int = CALIBRATION) -> tuple[list[str], list[str | None], np.ndarray]:
    """(prompts, kinds, prompt tokens) of the first n prompts of the training stream (what `train` learned from;
    the replayed prompts come after it)."""
    records = _training_records(cfg, n)
    return [r.prompt for r in records], [domain_of(r) for r in records], prompt_tokens_of(records)


def _training_records(cfg, n: int):
    from gateway.lab.emulator.settings import label_constants
    from gateway.lab.workload.synthetic import generate

    est = cfg.estimators
    return generate(min(n, est.train_records), seed=est.seed, world=label_constants(cfg))


def prefill_counts(model: ExpertModel, prompts: Sequence[str], kinds: Sequence[str | None],
                   tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """(n, layers, experts) the simulated prefill's expert counts of each prompt (seeded by its text)."""
    out = np.empty((len(prompts), model.spec.layers, model.spec.experts), dtype=np.uint16)
    for r, (text, kind, t) in enumerate(zip(prompts, kinds, tokens, strict=True)):
        seed = int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8,
                                              person=b"prefill").digest(), "big")
        out[r] = model.prefill_counts(expert_domain(kind, text), int(t), np.random.default_rng(seed))
    return out


def count_idf_signatures(model: ExpertModel, weights: np.ndarray, prompts, kinds, tokens) -> np.ndarray:
    """(n, layers x experts) unit count-IDF signatures, made a chunk at a time."""
    parts = [signatures(prefill_counts(model, prompts[k:k + CHUNK], kinds[k:k + CHUNK], tokens[k:k + CHUNK]), weights)
             for k in range(0, len(prompts), CHUNK)]
    return np.concatenate(parts)


def count_idf_similarity(cfg, evalset: EvalSet, calibration: int = CALIBRATION, seed: int = SEED) -> np.ndarray:
    """(n, instances) cosine of each replayed prompt's count-IDF signature to each instance's centroid."""
    model = tier(cfg)
    prompts, kinds, tokens = calibration_set(cfg, calibration)
    counts = prefill_counts(model, prompts, kinds, tokens)
    weights = idf(counts)
    centroids, _ = balanced_kmeans(signatures(counts, weights), len(cfg.instances), seed=seed)
    ev_kinds = [evalset.kind(r) for r in range(len(evalset))]
    sig = count_idf_signatures(model, weights, list(evalset.prompts), ev_kinds, evalset.prompt_tokens)
    return np.clip(sig @ centroids.T.astype(np.float32), 0.0, 1.0)


def one_hot(kinds: Sequence[str | None], names: Sequence[str]) -> np.ndarray:
    """(n, kinds) the kind of each prompt as a unit vector (a prompt of no known kind: zeros)."""
    x = np.zeros((len(kinds), len(names)), dtype=np.float32)
    column = {name: j for j, name in enumerate(names)}
    for r, kind in enumerate(kinds):
        if kind is not None and kind in column:
            x[r, column[kind]] = 1.0
    return x


def domain_similarity(cfg, evalset: EvalSet, calibration: int = CALIBRATION, seed: int = SEED) -> np.ndarray:
    """(n, instances) the domain oracle's similarities: each prompt's one-hot kind against balanced centroids
    of the calibration prompts' kinds."""
    from gateway.lab.workload.synthetic import KINDS

    names = tuple(KINDS)
    _, kinds, _ = calibration_set(cfg, calibration)
    centroids, _ = balanced_kmeans(one_hot(kinds, names), len(cfg.instances), seed=seed)
    ev = one_hot([evalset.kind(r) for r in range(len(evalset))], names)
    return np.clip(ev @ centroids.T.astype(np.float32), 0.0, 1.0)


SIGNATURES = {"count-idf": count_idf_similarity, "domain": domain_similarity}


def given(cfg, evalset: EvalSet, signature: str) -> np.ndarray:
    """A signature's similarities for the pool and prompts, computed once per process."""
    key = (signature, tuple(i.name for i in cfg.instances), tier(cfg).spec, len(evalset),
           hashlib.sha256("\n".join(evalset.prompts).encode("utf-8", "surrogatepass")).hexdigest())
    if key not in _MEMO:
        if len(_MEMO) >= MEMO_ENTRIES:
            del _MEMO[next(iter(_MEMO))]
        _MEMO[key] = SIGNATURES[signature](cfg, evalset)
    return _MEMO[key]


# ---- the signatures' quality, the paper's way -------------------------------------------------------

def rank_correlation(signature: np.ndarray, decode: np.ndarray) -> float:
    """Spearman correlation, over every pair of prompts, of their signatures' cosine distance and their decode
    activation probabilities' cosine distance (the paper's rho)."""
    from scipy.stats import spearmanr

    def distances(x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
        d = 1.0 - x @ x.T
        return d[np.triu_indices(len(x), 1)]

    return float(spearmanr(distances(signature), distances(decode)).statistic)


def signature_quality(cfg, evalset: EvalSet, n: int = 400) -> list[dict]:
    """rho of the embedding, count-IDF and domain signatures on the first n replayed prompts."""
    from gateway.lab.workload.synthetic import KINDS

    model = tier(cfg)
    ev = evalset.take(min(n, len(evalset)))
    kinds = [ev.kind(r) for r in range(len(ev))]
    decode = np.stack([model.activation(expert_domain(k, p)).ravel() for k, p in zip(kinds, ev.prompts, strict=True)])
    prompts, cal_kinds, tokens = calibration_set(cfg)
    weights = idf(prefill_counts(model, prompts, cal_kinds, tokens))
    found = {"embedding": ev.embeddings,
             "count-idf": count_idf_signatures(model, weights, list(ev.prompts), kinds, ev.prompt_tokens),
             "domain": one_hot(kinds, tuple(KINDS))}
    return [{"signature": name, "prompts": len(ev), "rho": round(rank_correlation(x, decode), 4)}
            for name, x in found.items()]
