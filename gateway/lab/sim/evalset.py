"""The held-out prompts a simulation replays, with their labels and the estimators' outputs.

The estimators are deterministic per prompt, so they run once per evaluation
set rather than once per cell: embeddings, KNN quality and length per
instance column are cached in `<models_dir>/sim/`, keyed by the build's
manifest, the prompts and the pool's models. The same pass times the real
embedder and the real RouteBalance assignment at batch 1 and 16, and the
simulator charges a batch its compute from that straight line (ComputeCost),
kept per build, pool and source of the timed code.

Prompt tokens are counted as the gateway and the emulator count them: the
prompt as one user turn through Qwen2.5's chat template.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gateway.estimators.manifest import read_manifest
from gateway.lab.emulator.settings import label_constants
from gateway.lab.workload.synthetic import generate
from gateway.records import MAX_OUTPUT_TOKENS, UNKNOWN_KIND, Record
from gateway.tokens import TokenCounter

log = logging.getLogger(__name__)
CACHE_VERSION = 1
EVAL_PROMPTS = 3534  # held-out prompts per cell in the paper; the emulator knows this many by label


@dataclass(frozen=True, slots=True)
class ComputeCost:
    """Scheduler compute per batch of n requests: fixed + per_request x n, seconds.

    Scoring is timed twice: with the TPOT heads (the default, and the
    predicted-latency tie-break) and without them (the static prior, w_lat = 0
    with the queue tie-break), which skips the XGBoost calls."""

    estimate_fixed_s: float
    estimate_per_request_s: float
    score_fixed_s: float
    score_per_request_s: float
    plain_score_fixed_s: float
    plain_score_per_request_s: float

    def estimate_s(self, n: int) -> float:
        return self.estimate_fixed_s + self.estimate_per_request_s * n

    def score_s(self, n: int, heads: bool = True) -> float:
        if heads:
            return self.score_fixed_s + self.score_per_request_s * n
        return self.plain_score_fixed_s + self.plain_score_per_request_s * n


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
    kinds: tuple[str | None, ...] = ()  # each prompt's kind (its domain on a mixture-of-experts tier); () unknown

    def __len__(self) -> int:
        return len(self.prompts)

    def take(self, n: int) -> EvalSet:
        """The first n prompts (a shorter cell replays a prefix)."""
        if n > len(self):
            raise ValueError(f"the evaluation set holds {len(self)} prompts; asked for {n}")
        return EvalSet(self.prompts[:n], self.prompt_tokens[:n], self.label_score[:n], self.label_length[:n],
                       self.quality[:n], self.length[:n], self.embeddings[:n], self.cost, self.kinds[:n])

    def rows(self, idx) -> EvalSet:
        """These prompts (row indices, repeats allowed), in this order."""
        idx = np.asarray(idx, dtype=np.int64)
        return EvalSet(tuple(self.prompts[k] for k in idx), self.prompt_tokens[idx], self.label_score[idx],
                       self.label_length[idx], self.quality[idx], self.length[idx], self.embeddings[idx], self.cost,
                       tuple(self.kinds[k] for k in idx) if self.kinds else ())

    def kind(self, r: int) -> str | None:
        """Prompt r's kind, or None if the set does not know it."""
        return self.kinds[r] if r < len(self.kinds) else None


def evaluation_records(cfg, n: int) -> list[Record]:
    """Prompts the estimators never saw in training: records after the first `train_records` of the same
    deterministic synthetic stream, which is what `train` learned from. (A labelled file is replayed
    cross-fitted instead: experiments/crossfit_world.py.)"""
    est = cfg.estimators
    return generate(est.train_records + n, seed=est.seed, binary=est.labels == "binary",
                    world=label_constants(cfg))[est.train_records:]


def domain_of(record: Record) -> str | None:
    """A record's domain on a mixture-of-experts tier: its kind, or None (uniform routing) if it has none."""
    return None if record.kind == UNKNOWN_KIND else record.kind


def cache_key(manifest: dict, cfg, records: list[Record] = ()) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(manifest, sort_keys=True).encode())
    h.update(json.dumps([i.model for i in cfg.instances]).encode())
    h.update(str((CACHE_VERSION, cfg.estimators.max_tokens)).encode())
    for r in records:
        h.update(r.prompt.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:16]


def load_evalset(cfg, n: int, estimators=None) -> EvalSet:
    """The synthetic evaluation set of n prompts, from the cache or computed (about 12 ms a prompt)."""
    records = evaluation_records(cfg, n)
    models_dir = Path(cfg.estimators.models_dir)
    manifest = read_manifest(models_dir)
    path = models_dir / "sim" / f"eval-{n}-{cache_key(manifest, cfg, records)}.npz"
    prompt_tokens = prompt_tokens_of(records)
    label_score, label_length = labels_of(records, cfg.instances)

    def bundle():
        nonlocal estimators
        if estimators is None:
            from gateway.estimators.bundle import Estimators

            estimators = Estimators.load(cfg)
        return estimators

    if path.is_file():
        with np.load(path) as z:
            cached = {k: z[k] for k in z.files}
    else:
        log.info("estimating %d held-out prompts once for the simulator (cached in %s)", n, path.parent)
        cached = _estimate(bundle(), cfg, [r.prompt for r in records])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **cached)
        tmp.replace(path)
    # Measured once per build, pool and timed code, whatever the set's size, so every cell is charged alike.
    cost = cached_cost(models_dir / "sim" / f"cost-{cache_key(manifest, cfg)}.json", bundle, cfg,
                       [r.prompt for r in records])
    return EvalSet(tuple(r.prompt for r in records), prompt_tokens, label_score, label_length, cached["quality"],
                   cached["length"], cached["embeddings"], cost, tuple(domain_of(r) for r in records))


def prompt_tokens_of(records: list[Record]) -> np.ndarray:
    """Each prompt's tokens as one user turn through the chat template (as the gateway and emulator count)."""
    tokens = TokenCounter()
    return np.array([tokens.count_chat([{"role": "user", "content": r.prompt}]) for r in records])


def labels_of(records: list[Record], instances) -> tuple[np.ndarray, np.ndarray]:
    """Per instance column, the label of its model (lengths clipped at MAX_OUTPUT_TOKENS, the longest answer
    the emulator gives); a model without labels scores 0 and answers 150 tokens."""
    score = np.zeros((len(records), len(instances)))
    length = np.full((len(records), len(instances)), 150.0)
    for r, rec in enumerate(records):
        for i, inst in enumerate(instances):
            lab = rec.models.get(inst.model)
            if lab is not None:
                score[r, i], length[r, i] = lab.score, min(max(1, lab.output_length), MAX_OUTPUT_TOKENS)
    return score, length


def _estimate(estimators, cfg, prompts: list[str], chunk: int = 64) -> dict[str, np.ndarray]:
    parts = [estimators.for_instances(prompts[k:k + chunk], cfg.instances) for k in range(0, len(prompts), chunk)]
    return {"quality": np.concatenate([p.quality for p in parts]),
            "length": np.concatenate([p.length for p in parts]),
            "embeddings": np.concatenate([p.embeddings for p in parts])}


def cached_cost(path: Path, estimators, cfg, prompts: list[str]) -> ComputeCost:
    """The scheduler's compute from `path` (named also by the source of the code it times), else measured
    (measure_cost; `estimators()` gives the bundle) and kept there: every process of a sweep, its workers
    included, then charges the same, and a change to the estimators or the scorer is timed anew rather than
    charged at the speed of the code before it."""
    path = path.with_name(f"{path.stem}-{timed_code_digest()}{path.suffix}")
    if path.is_file():
        return ComputeCost(**json.loads(path.read_text()))
    cost = measure_cost(estimators(), cfg, prompts)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dataclasses.asdict(cost), indent=1))
    return cost


def timed_code_digest() -> str:
    """A digest of the source of what measure_cost times: the estimators, the Eq. 1 terms, the pool view and
    prefix index the scorer reads, and RouteBalance's assignment."""
    root = Path(__file__).resolve().parents[2]
    files = sorted([*(root / "estimators").glob("*.py"), *(root / "policies" / "routebalance").glob("*.py"),
                    *(root / "core" / name for name in ("scoring.py", "view.py", "prefix.py", "budget.py"))])
    h = hashlib.sha256()
    for f in files:
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def measure_cost(estimators, cfg, prompts: list[str]) -> ComputeCost:
    """Time the real embedder + KNN and the real RouteBalance assignment (with and
    without the TPOT heads) at batch 1 and 16, on the same 32 prompts."""
    from gateway.core.pool_state import PoolState
    from gateway.core.request import RouteRequest
    from gateway.policies import registry

    with_heads = registry.build("routebalance", cfg.with_options("routebalance", latency_term="heads"), estimators)
    plain = registry.build("routebalance", cfg.with_options("routebalance", latency_term="prior"), estimators)
    everyone = tuple(range(len(cfg.instances)))
    sample = prompts[:32]

    def per_batch(size: int) -> tuple[float, float, float]:
        """Seconds per batch of `size`: estimate, score with heads, score without."""
        totals = [0.0, 0.0, 0.0]
        batches = [sample[k:k + size] for k in range(0, len(sample), size)]
        for texts in batches:
            requests = [RouteRequest(everyone, t, 60, None, (1 / 3, 1 / 3, 1 / 3)) for t in texts]
            start = time.perf_counter()
            est = estimators.for_instances(texts, cfg.instances)
            totals[0] += time.perf_counter() - start
            for k, policy in ((1, with_heads), (2, plain)):
                view = PoolState().snapshot(cfg.instances, 0.0, cfg.telemetry.stale_after_s)
                start = time.perf_counter()
                policy.assign(requests, est, view)
                totals[k] += time.perf_counter() - start
        return tuple(t / len(batches) for t in totals)

    per_batch(1)  # warm-up
    one, sixteen = per_batch(1), per_batch(16)
    fitted = []
    for a, b in zip(one, sixteen, strict=True):
        slope = max((b - a) / 15, 0.0)
        fitted += [max(a - slope, 0.0), slope]
    return ComputeCost(*fitted)


def subset(cfg, evalset: EvalSet, names: Sequence[str]):
    """(config, evaluation set) of the pool made of the named instances, in the config's order."""
    keep = [k for k, inst in enumerate(cfg.instances) if inst.name in set(names)]
    if len(keep) != len(set(names)):
        raise ValueError(f"unknown instances in {sorted(set(names) - {i.name for i in cfg.instances})}")
    return dataclasses.replace(cfg, instances=tuple(cfg.instances[k] for k in keep)), _columns(evalset, keep)


def shared_pool(cfg, evalset: EvalSet, gpus: Sequence[str], models: Sequence[tuple[str, str]]):
    """(config, evaluation set) of a multi-model pool: the GPU of each instance named in `gpus` time-shares
    every model of `models`, one loaded at a time (QLM's multi-model serving). Each model is a (name,
    pool model) pair: a fine-tuned variant answers as the pool model does (its labels and estimates) at
    that model's speed and price. One instance per GPU and model, "<gpu>/<k>", with gpu_id "<gpu>"."""
    by_name = {inst.name: inst for inst in cfg.instances}
    base = {}
    for name, pool_model in models:
        k = next((k for k, inst in enumerate(cfg.instances) if inst.model == pool_model), None)
        if k is None:
            raise ValueError(f"{name!r} answers as {pool_model!r}, which no instance serves")
        base[name] = k
    instances, columns = [], []
    for g in gpus:
        if g not in by_name:
            raise ValueError(f"unknown instance {g!r}")
        gpu = by_name[g]
        for k, (name, _) in enumerate(models):
            like = cfg.instances[base[name]]
            instances.append(dataclasses.replace(like, name=f"{g}/{k}", url=f"{gpu.url}/m{k}", model=name, gpu=gpu.gpu,
                                                 gpu_count=gpu.gpu_count, gpu_memory_gb=gpu.gpu_memory_gb,
                                                 gpu_id=g))
            columns.append(base[name])
    return dataclasses.replace(cfg, instances=tuple(instances)), _columns(evalset, columns)


def answering_as(cfg, evalset: EvalSet, instances: Sequence, pool_model: str):
    """(config, evaluation set) of a pool of other instances (a model without labels of its own, e.g. the
    mixture-of-experts example) whose every instance answers as `pool_model` does: its labels and estimates."""
    k = next((k for k, inst in enumerate(cfg.instances) if inst.model == pool_model), None)
    if k is None:
        raise ValueError(f"the pool answers as {pool_model!r}, which no instance of the config serves")
    return dataclasses.replace(cfg, instances=tuple(instances)), _columns(evalset, [k] * len(instances))


def _columns(evalset: EvalSet, columns: Sequence[int]) -> EvalSet:
    """The evaluation set whose per-instance columns are these columns of `evalset`, in order."""
    idx = np.array(columns, dtype=np.int64)
    return dataclasses.replace(evalset, label_score=evalset.label_score[:, idx],
                               label_length=evalset.label_length[:, idx], quality=evalset.quality[:, idx],
                               length=evalset.length[:, idx])
