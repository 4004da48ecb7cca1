"""Pools made for a sweep's cells (a cell names one by its `pool` tag; `routebalance sim --pool NAME`).

W_A, the QLM paper's multi-model workload: four A30 GPUs (those of four 7B
instances) each time-share five models, one loaded at a time: the 7B and 3B
tiers (the popular models) and three fine-tuned variants (tail models,
answering as their base model does). More models than GPUs, most of them
tail models, as in the paper.

moe, ELDR's mixture-of-experts pool: the instances of gateway/examples/moe.toml
(eight Qwen3-30B-A3B decode instances with `[instances.moe]` tables). The
workload has no labels for that model, so it answers as the 72B does (its
quality and answer lengths; Qwen3-30B-A3B is of that class, and the 72B's
answers are the long ones, which is where decode time, and so TPOT, matters).

moe-shift: the same pool, with the traffic's mix moved away from the one the
centroids were fitted on (the training mix): half of the requests are of one
kind (code, whose prompts gather around one centroid), the rest in the usual
mix; the held-out prompts are drawn again (with repeats) in that proportion.
A locality-only router (tau = 0) then sends half the traffic to one instance.

moe-kind: the same pool in the kind-only world, where a prompt's experts
depend on its kind alone (within = 0, concentration 1.3: the world the
ELDR results had before within-kind structure was added), so a signature
that sees the kind sees everything.

"<pool>/count-idf" and "<pool>/domain" (for the pools above): the same pool,
whose estimates carry each request's similarity to each instance's centroid
under a signature the gateway cannot compute (sim/moe_signatures.py: the
count-IDF signature of the simulated prefill's expert activations, or the
true kind), with `[policies.eldr] signature = "given"` set for them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from gateway.lab.sim.evalset import answering_as, shared_pool

SEVEN_B, THREE_B = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct"
W_A_GPUS = ("qwen7b-a30-0", "qwen7b-a30-1", "qwen7b-a30-2", "qwen7b-a30-3")
W_A_POPULAR = ((SEVEN_B, SEVEN_B), (THREE_B, THREE_B))  # (model, pool model it answers as)
W_A_TAIL = ((f"{SEVEN_B}-ft-legal", SEVEN_B), (f"{SEVEN_B}-ft-medical", SEVEN_B), (f"{THREE_B}-ft-support", THREE_B))

MOE_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe.toml"
MOE_ANSWERS_AS = "Qwen/Qwen2.5-72B-Instruct"
SHIFT_KIND, SHIFT_SHARE = "code", 0.5


def w_a(cfg, evalset):
    return shared_pool(cfg, evalset, W_A_GPUS, W_A_POPULAR + W_A_TAIL)


def from_file(path, answers_as: str = MOE_ANSWERS_AS):
    """A pool of the instances of a config file, answering as `answers_as` does (the rest of the config, its
    estimators and policies, stays the cell's)."""
    from gateway.config.store import load_config

    instances = load_config(path).instances

    def pool(cfg, evalset):
        return answering_as(cfg, evalset, instances, answers_as)

    return pool


def moe(cfg, evalset):
    return from_file(MOE_EXAMPLE)(cfg, evalset)


def shifted(evalset, kind: str = SHIFT_KIND, share: float = SHIFT_SHARE, seed: int = 0):
    """The evaluation set drawn again (as many prompts, with repeats) so that `share` of them are of `kind`."""
    kinds = np.array([evalset.kind(r) for r in range(len(evalset))], dtype=object)
    mine, rest = np.flatnonzero(kinds == kind), np.flatnonzero(kinds != kind)
    if not len(mine) or not len(rest):
        raise ValueError(f"the evaluation set needs prompts of kind {kind!r} and of others to shift its mix")
    rng = np.random.default_rng(seed)
    n = len(evalset)
    return evalset.rows(np.where(rng.random(n) < share, rng.choice(mine, n), rng.choice(rest, n)))


def moe_shift(cfg, evalset):
    cfg, evalset = moe(cfg, evalset)
    return cfg, shifted(evalset)


KIND_ONLY = {"within": 0.0, "subdomains": 1, "concentration": 1.3}  # the MoE world before within-kind structure


def moe_kind(cfg, evalset):
    cfg, evalset = moe(cfg, evalset)
    instances = tuple(dataclasses.replace(i, moe=dataclasses.replace(i.moe, **KIND_ONLY)) for i in cfg.instances)
    return dataclasses.replace(cfg, instances=instances), evalset


def with_signature(pool, signature: str):
    """The pool, routed by ELDR on a signature computed outside the gateway (moe_signatures.py)."""
    from gateway.lab.sim.moe_signatures import given

    def made(cfg, evalset):
        cfg, evalset = pool(cfg, evalset)
        similarity = given(cfg, evalset, signature)
        return cfg.with_options("eldr", signature="given"), dataclasses.replace(evalset, embeddings=similarity)

    return made


# qos-similar, the QoS paper's setting (several ~7B experts on like GPUs): six instances built like the 7B on
# its A30 (one engine model, one speed, one price), each answering as one of the three smaller models do
# (their labels, answer lengths and estimates), in turn: mean quality 0.40, 0.38 and 0.35, and per prompt
# each is best about as often as the next. The four-tier pool's instances differ by 4x in speed.
QOS_SIMILAR_ANSWERS = ("Qwen/Qwen2.5-14B-Instruct", SEVEN_B, THREE_B) * 2


def qos_similar(cfg, evalset):
    like = next((inst for inst in cfg.instances if inst.model == SEVEN_B), None)
    if like is None:
        raise ValueError(f"the qos-similar pool is built like a {SEVEN_B} instance; the config has none")
    columns = []
    for model in QOS_SIMILAR_ANSWERS:
        k = next((k for k, inst in enumerate(cfg.instances) if inst.model == model), None)
        if k is None:
            raise ValueError(f"a qos-similar expert answers as {model!r}, which no instance of the config serves")
        columns.append(k)
    instances = tuple(dataclasses.replace(like, name=f"expert-{k}", url=f"{like.url}/e{k}",
                                          model=f"{SEVEN_B}-expert-{k}") for k in range(len(columns)))
    idx = np.array(columns, dtype=np.int64)
    evalset = dataclasses.replace(evalset, label_score=evalset.label_score[:, idx],
                                  label_length=evalset.label_length[:, idx], quality=evalset.quality[:, idx],
                                  length=evalset.length[:, idx])
    return dataclasses.replace(cfg, instances=instances), evalset


POOLS = {"W_A": w_a, "moe": moe, "moe-shift": moe_shift, "moe-kind": moe_kind, "qos-similar": qos_similar}


def named(name: str):
    """A pool by name, or the instances of a config TOML file (answering as the 72B does)."""
    if name in POOLS:
        return POOLS[name]
    base, _, signature = name.rpartition("/")
    if base in POOLS and signature in ("count-idf", "domain"):
        return with_signature(POOLS[base], signature)
    if name.endswith(".toml") and Path(name).is_file():
        return from_file(name)
    raise ValueError(f"unknown pool {name!r} (known: {', '.join(POOLS)}, or a config .toml whose instances to use)")


GAMMA_SHAPE = 0.25  # the QoS pools' bursty arrivals: gaps with a coefficient of variation of 2


def pool_names(instances: Sequence, n: int) -> tuple[str, ...]:
    """The names of an N-instance pool (the QoS study's, gateway/lab/experiments/qos_eval.py): one instance
    of each model in turn."""
    if not 1 <= n <= len(instances):
        raise ValueError(f"a pool of {n} instances from {len(instances)}")
    by_model: dict[str, list[str]] = {}
    for inst in instances:
        by_model.setdefault(inst.model, []).append(inst.name)
    chosen: list[str] = []
    while len(chosen) < n:
        for names in by_model.values():
            if names and len(chosen) < n:
                chosen.append(names.pop(0))
    return tuple(chosen)
