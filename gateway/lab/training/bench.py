"""`routebalance bench`: estimator cost per request, by batch size and prompt truncation.

For each truncation (256, 128, 64 tokens) and scheduler batch size (1, 4, 16,
32) it times, over a realistic prompt mix (the held-out synthetic prompts),
one embed call + one FAISS search per batch + one TPOT-head call per tier
over every (request, instance) pair, and reports milliseconds per request.
It also reports how many of each prompt's top-10 neighbours at the shorter
truncations match those at 256, and the per-prompt cost of embedding the
whole set in one call (the floor batching can approach), and what the
embedding cache saves when a share of the requests repeats earlier prompts.
"""

from __future__ import annotations

import time

import numpy as np

from gateway.core.view import tier_key
from gateway.estimators.bundle import Estimators
from gateway.estimators.embedder import Embedder, default_tokenizer_path
from gateway.estimators.latency import FEATURES
from gateway.lab.training.build import ensure_built
from gateway.lab.workload.synthetic import generate
from gateway.records import split

TRUNCATIONS = (256, 128, 64)
BATCHES = (1, 4, 16, 32)


def _time_per_request(est: Estimators, embedder: Embedder, prompts: list[str], batch: int, tiers: dict) -> dict:
    parts = {"embed": 0.0, "knn": 0.0, "tpot": 0.0}
    for start in range(0, len(prompts), batch):
        chunk = prompts[start:start + batch]
        t0 = time.perf_counter()
        vectors = embedder.embed(chunk)
        t1 = time.perf_counter()
        estimate = est.knn.estimate(vectors)
        t2 = time.perf_counter()
        for tier, count in tiers.items():  # one call per tier over all its (request, instance) pairs
            rows = np.zeros((len(chunk) * count, len(FEATURES)), np.float32)
            rows[:, -1] = np.repeat(estimate.length[:, 0], count)
            est.heads.tpot(tier, rows)
        t3 = time.perf_counter()
        parts["embed"] += t1 - t0
        parts["knn"] += t2 - t1
        parts["tpot"] += t3 - t2
    return {k: v / len(prompts) * 1000 for k, v in parts.items()}


def run_bench(config, prompts: int = 512) -> str:
    models_dir = config.estimators.models_dir
    ensure_built(config)
    est = Estimators.load(config)
    records = split(generate(max(config.estimators.train_records, prompts * 6), seed=config.estimators.seed + 1))[1]
    texts = [r.prompt for r in records[:prompts]]
    lengths = np.array([r.input_len for r in records[:prompts]])
    tiers: dict[str, int] = {}
    for inst in config.instances:
        key = tier_key(inst.model, inst.gpu)
        tiers[key] = tiers.get(key, 0) + 1
    onnx = f"{models_dir}/{est.manifest['embedder']['onnx']}"
    threads = config.estimators.threads
    lines = [
        f"{len(texts)} prompts (mean {lengths.mean():.0f} tokens, p90 {np.percentile(lengths, 90):.0f}), "
        f"{threads} onnxruntime threads, {sum(tiers.values())} instances in {len(tiers)} tiers",
        f"ms per request: embed + KNN + TPOT = total (sub-batches sorted by length, at most "
        f"{config.estimators.batch_size} prompts each)",
        f"{'trunc':>5} {'batch':>5} {'embed':>8} {'knn':>7} {'tpot':>7} {'total':>8}",
    ]
    reference = None
    agreement = {}
    for trunc in TRUNCATIONS:
        embedder = Embedder(onnx, default_tokenizer_path(), max_tokens=trunc, threads=threads,
                            batch_size=config.estimators.batch_size)
        embedder.embed(texts[:8])  # warm-up
        vectors = embedder.embed(texts)
        estimate = est.knn.estimate(vectors)
        top = estimate.neighbours
        if reference is None:
            reference, served = top, estimate  # the first truncation is the served one (256)
        agreement[trunc] = np.mean([len(set(a) & set(b)) / len(a) for a, b in zip(top, reference, strict=True)])
        for batch in BATCHES:
            t = _time_per_request(est, embedder, texts, batch, tiers)
            lines.append(f"{trunc:>5} {batch:>5} {t['embed']:>8.2f} {t['knn']:>7.3f} {t['tpot']:>7.3f} "
                         f"{sum(t.values()):>8.2f}")
    lines.append("top-10 neighbours shared with truncation 256: "
                 + ", ".join(f"{t}: {agreement[t]:.1%}" for t in TRUNCATIONS))
    whole = Embedder(onnx, default_tokenizer_path(), max_tokens=256, threads=threads, batch_size=16)
    t0 = time.perf_counter()
    whole.embed(texts)
    lines.append("whole set sorted then cut into batches of 16: "
                 f"{(time.perf_counter() - t0) / len(texts) * 1000:.2f} ms/prompt")
    lines += _cache_lines(config, onnx, texts)
    lines += _head_lines(est)
    lines += _decision_lines(config, est, served)
    return "\n".join(lines)


HEAD_ROWS = (1, 4, 13, 52)  # one request on one instance; a tier of four; the pool; a batch of four on the pool
HEAD_CALLS = 300


def _head_lines(est: Estimators) -> list[str]:
    """A TPOT head's time per call, walked with numpy (what serves, estimators/forest.py) and by XGBoost's
    inplace_predict, for the rows a decision asks about, and the largest relative gap between the two."""
    lines = [f"TPOT head per call (us), mean over the {len(est.heads.forests)} tiers' heads, {HEAD_CALLS} calls each:",
             f"{'rows':>5} {'numpy':>7} {'xgboost':>8} {'max rel. gap':>13}"]
    rng = np.random.default_rng(0)
    for n in HEAD_ROWS:
        x = (rng.random((n, len(FEATURES))) * np.geomspace(1, 2048, len(FEATURES))).astype(np.float32)
        spent = {"numpy": 0.0, "xgboost": 0.0}
        gap = 0.0
        for tier, booster in est.heads.boosters.items():
            forest = est.heads.forests[tier]
            for name, predict in (("numpy", forest.predict), ("xgboost", booster.inplace_predict)):
                t0 = time.perf_counter()
                for _ in range(HEAD_CALLS):
                    predict(x)
                spent[name] += time.perf_counter() - t0
            theirs = booster.inplace_predict(x)
            gap = max(gap, float(np.max(np.abs(forest.predict(x) - theirs) / np.abs(theirs))))
        per_call = {k: v / HEAD_CALLS / max(len(est.heads.boosters), 1) * 1e6 for k, v in spent.items()}
        lines.append(f"{n:>5} {per_call['numpy']:>7.0f} {per_call['xgboost']:>8.0f} {gap:>13.1e}")
    return lines


DECISION_BATCHES = (1, 4, 16)
DECISION_REPEATS = 100


def _decision_lines(config, est: Estimators, estimate) -> list[str]:
    """What the decision itself costs once the batch is estimated: Algorithm 1 (assign_batch) over the
    pool's instances on an idle view, the heads walked up to WALK_ROWS rows (as served) and by XGBoost alone."""
    from gateway.core.pool_state import PoolState
    from gateway.core.request import Estimates, RouteRequest
    from gateway.estimators import latency
    from gateway.policies.routebalance.assign import RouteBalanceOptions, assign_batch

    everyone = tuple(range(len(config.instances)))
    lines = [f"the decision with the estimates given (ms per batch), {len(everyone)} candidates, "
             f"mean of {DECISION_REPEATS}:", f"{'batch':>5} {'walked':>7} {'xgboost':>8}"]
    served_rows = latency.WALK_ROWS
    try:
        for batch in DECISION_BATCHES:
            requests = [RouteRequest(everyone, "", 100, None, (1 / 3, 1 / 3, 1 / 3)) for _ in range(batch)]
            rows = np.arange(batch) % len(estimate.quality)
            columns = [est.knn.models.index(i.model) for i in config.instances]
            given = Estimates(estimate.quality[rows][:, columns], estimate.length[rows][:, columns])
            timed = {}
            for name, walk_rows in (("walked", served_rows), ("xgboost", 0)):
                latency.WALK_ROWS = walk_rows
                rng = np.random.default_rng(0)
                t0 = time.perf_counter()
                for _ in range(DECISION_REPEATS):
                    view = PoolState().snapshot(config.instances, now=0.0, stale_after_s=3.0)
                    assign_batch(requests, given, view, RouteBalanceOptions(), est.heads.tpot, rng,
                                 est.heads.errors)
                timed[name] = (time.perf_counter() - t0) / DECISION_REPEATS * 1000
            lines.append(f"{batch:>5} {timed['walked']:>7.2f} {timed['xgboost']:>8.2f}")
    finally:
        latency.WALK_ROWS = served_rows
    return lines


REPEATS = (0.0, 0.1, 0.25, 0.5)  # share of requests repeating an earlier prompt (retries, popular questions)
CACHE_BATCH = 4  # the scheduler's typical batch at 30 req/s


def _cache_lines(config, onnx: str, texts: list[str]) -> list[str]:
    """The embedding cache: ms per request with and without it when a share of the stream repeats earlier
    prompts, and how far its vectors are from computing every one (minimum cosine)."""
    est = config.estimators
    lines = [f"embedding cache ({est.embed_cache_entries} entries), batches of {CACHE_BATCH}, {len(texts)} requests:",
             f"{'repeats':>7} {'off ms':>7} {'on ms':>7} {'hits':>6} {'min cosine':>10}"]
    rng = np.random.default_rng(est.seed)
    for share in REPEATS:
        stream = list(texts)
        for k in range(1, len(stream)):
            if rng.random() < share:
                stream[k] = stream[int(rng.integers(0, k))]
        timed = {}
        for entries in (0, est.embed_cache_entries):
            e = Embedder(onnx, default_tokenizer_path(), max_tokens=est.max_tokens, threads=est.threads,
                         batch_size=est.batch_size, cache_entries=entries)
            e.embed([t + " (warm-up)" for t in texts[:16]])  # realistic lengths, none of them in the stream
            vectors, t0 = [], time.perf_counter()
            for start in range(0, len(stream), CACHE_BATCH):
                vectors.append(e.embed(stream[start:start + CACHE_BATCH]))
            timed[entries] = ((time.perf_counter() - t0) / len(stream) * 1000, np.concatenate(vectors), e)
        (off_ms, off, _), (on_ms, on, cached) = timed[0], timed[est.embed_cache_entries]
        hits, misses = cached.cache_counts()
        lines.append(f"{share:>7.0%} {off_ms:>7.2f} {on_ms:>7.2f} {hits / max(hits + misses, 1):>6.1%} "
                     f"{float((off * on).sum(axis=1).min()):>10.6f}")
    return lines
