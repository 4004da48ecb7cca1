"""The held-out prompts a simulation replays, with their labels and the estimators' outputs.

The estimators are deterministic per prompt, so they run once per evaluation
set rather than once per cell: embeddings, KNN quality and length per
instance column are cached in `<models_dir>/sim/`, keyed by the build's
manifest, the prompts and the pool's models. The same pass times the real
embedder and the real RouteBalance assignment at batch 1 and 16, and the
simulator charges a batch its compute from that straight line (ComputeCost).

Prompt tokens are counted as the gateway and the emulator count them: the
prompt as one user turn through Qwen2.5's chat template.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.estimators.build import read_manifest
from gateway.tokens import TokenCounter
from gateway.workload import Record, generate, read_jsonl, split

log = logging.getLogger(__name__)
CACHE_VERSION = 1
EVAL_PROMPTS = 3534  # held-out prompts per cell in the paper; the emulator knows this many by label


@dataclass(frozen=True, slots=True)
class ComputeCost:
    """Scheduler compute per batch of n requests: fixed + per_request x n, seconds."""

    estimate_fixed_s: float = 0.005
    estimate_per_request_s: float = 0.012
    score_fixed_s: float = 0.003
    score_per_request_s: float = 0.0005

    def estimate_s(self, n: int) -> float:
        return self.estimate_fixed_s + self.estimate_per_request_s * n

    def score_s(self, n: int) -> float:
        return self.score_fixed_s + self.score_per_request_s * n


@dataclass(frozen=True)
class EvalSet:
    """n prompts over the pool's I instances (label and estimate columns follow config order)."""

    prompts: tuple[str, ...]
    prompt_tokens: np.ndarray  # (n,) int
    label_score: np.ndarray  # (n, I) judged quality of the instance's model on the prompt
    label_length: np.ndarray  # (n, I) the answer it gives, tokens
    quality: np.ndarray  # (n, I) KNN-predicted quality
    length: np.ndarray  # (n, I) KNN-predicted answer tokens
    embeddings: np.ndarray  # (n, d)
    cost: ComputeCost

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, n: int) -> EvalSet:
        """The first n prompts (a shorter cell replays a prefix)."""
        if n > len(self):
            raise ValueError(f"the evaluation set holds {len(self)} prompts; asked for {n}")
        return EvalSet(self.prompts[:n], self.prompt_tokens[:n], self.label_score[:n], self.label_length[:n],
                       self.quality[:n], self.length[:n], self.embeddings[:n], self.cost)


def evaluation_records(cfg, n: int, workload: str | None = None) -> list[Record]:
    """Prompts the estimators never saw in training.

    Synthetic (the default): records after the first `train_records` of the
    same deterministic stream, which is what `train` learned from. From a
    labelled JSONL: its held-out split, as `train` splits it.
    """
    if workload:
        records = split(read_jsonl(workload))[1]
    else:
        first = cfg.estimators.train_records
        records = generate(first + n, seed=cfg.estimators.seed)[first:]
    if len(records) < n:
        raise ValueError(f"only {len(records)} held-out records are available; asked for {n}")
    return records[:n]


def label_lengths(records: list[Record]) -> dict[str, dict[str, int]]:
    """prompt key -> model -> labelled answer tokens, for the emulator to answer with."""
    from gateway.emulator.outputs import prompt_key

    return {prompt_key(r.prompt): {m: lab.output_length for m, lab in r.models.items()} for r in records}


def _cache_key(manifest: dict, cfg, records: list[Record]) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(manifest, sort_keys=True).encode())
    h.update(json.dumps([i.model for i in cfg.instances]).encode())
    h.update(str((CACHE_VERSION, cfg.estimators.max_tokens)).encode())
    for r in records:
        h.update(r.prompt.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def load_evalset(cfg, n: int, workload: str | None = None, estimators=None) -> EvalSet:
    """The evaluation set of n prompts, from the cache or computed (about 12 ms a prompt)."""
    records = evaluation_records(cfg, n, workload)
    models_dir = Path(cfg.estimators.models_dir)
    key = _cache_key(read_manifest(models_dir), cfg, records)
    path = models_dir / "sim" / f"eval-{n}-{key}.npz"
    tokens = TokenCounter()
    prompt_tokens = np.array([tokens.count_chat([{"role": "user", "content": r.prompt}]) for r in records])
    label_score, label_length = _labels(records, cfg.instances)
    if path.is_file():
        with np.load(path) as z:
            cached = {k: z[k] for k in z.files}
        cost = ComputeCost(*(float(x) for x in cached["cost"]))
    else:
        if estimators is None:
            from gateway.estimators.bundle import Estimators

            estimators = Estimators.load(cfg)
        log.info("estimating %d held-out prompts once for the simulator (cached in %s)", n, path.parent)
        cached = _estimate(estimators, cfg, [r.prompt for r in records])
        cost = measure_cost(estimators, cfg, [r.prompt for r in records])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **cached, cost=np.array([cost.estimate_fixed_s, cost.estimate_per_request_s,
                                               cost.score_fixed_s, cost.score_per_request_s]))
        tmp.replace(path)
    return EvalSet(tuple(r.prompt for r in records), prompt_tokens, label_score, label_length,
                   cached["quality"], cached["length"], cached["embeddings"], cost)


def _labels(records: list[Record], instances) -> tuple[np.ndarray, np.ndarray]:
    """Per instance column, the label of its model; a model without labels scores 0 and answers 150 tokens."""
    score = np.zeros((len(records), len(instances)))
    length = np.full((len(records), len(instances)), 150.0)
    for r, rec in enumerate(records):
        for i, inst in enumerate(instances):
            lab = rec.models.get(inst.model)
            if lab is not None:
                score[r, i], length[r, i] = lab.score, max(1, lab.output_length)
    return score, length


def _estimate(estimators, cfg, prompts: list[str], chunk: int = 64) -> dict[str, np.ndarray]:
    parts = [estimators.for_instances(prompts[k:k + chunk], cfg.instances) for k in range(0, len(prompts), chunk)]
    return {"quality": np.concatenate([p.quality for p in parts]),
            "length": np.concatenate([p.length for p in parts]),
            "embeddings": np.concatenate([p.embeddings for p in parts])}


def measure_cost(estimators, cfg, prompts: list[str]) -> ComputeCost:
    """Time the real embedder + KNN and the real RouteBalance assignment at batch 1 and 16."""
    from gateway.scheduling.instance_view import PoolAccounting
    from gateway.scheduling.policies import make_policy
    from gateway.scheduling.policy import RouteRequest

    policy = make_policy("routebalance", cfg, estimators)
    everyone = tuple(range(len(cfg.instances)))
    sample = prompts[:64]

    def per_batch(size: int) -> tuple[float, float]:
        est_s = score_s = 0.0
        batches = [sample[k:k + size] for k in range(0, len(sample), size)][: max(1, 32 // size) if size == 1 else 4]
        for texts in batches:
            start = time.perf_counter()
            est = estimators.for_instances(texts, cfg.instances)
            mid = time.perf_counter()
            view = PoolAccounting().snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
            policy.assign([RouteRequest(everyone, t, 60, None, (1 / 3, 1 / 3, 1 / 3)) for t in texts], est, view)
            est_s += mid - start
            score_s += time.perf_counter() - mid
        return est_s / len(batches), score_s / len(batches)

    per_batch(1)  # warm-up
    e1, s1 = per_batch(1)
    e16, s16 = per_batch(16)
    e_slope, s_slope = max((e16 - e1) / 15, 0.0), max((s16 - s1) / 15, 0.0)
    return ComputeCost(max(e1 - e_slope, 0.0), e_slope, max(s1 - s_slope, 0.0), s_slope)
