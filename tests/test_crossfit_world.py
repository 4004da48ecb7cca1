"""A labelled file replayed in the simulator is cross-fitted: every prompt is routed by estimators (and
baselines trained on an index) that never held it, and every prompt is replayed."""

from __future__ import annotations

import dataclasses

import numpy as np

from conftest import pool_config
from gateway.lab.experiments.crossfit_world import FOLDS, load_world
from gateway.lab.experiments.labelled_sweep import cells, pairs
from gateway.lab.experiments.sweeps import run_seeded
from gateway.lab.workload.synthetic import generate
from gateway.learning.labels import prompt_hash
from gateway.records import MAX_OUTPUT_TOKENS, ModelLabel, write_jsonl

N = 60


def _file(tmp_path, built):
    """N synthetic records the built index never saw, one answer stretched past the clip."""
    cfg = built[0]
    records = generate(cfg.estimators.train_records + N, seed=99)[-N:]
    first = records[0]
    model = next(iter(first.models))
    records[0] = dataclasses.replace(first, models={**first.models, model: ModelLabel(first.models[model].score,
                                                                                     3 * MAX_OUTPUT_TOKENS)})
    path = tmp_path / "labels.jsonl"
    write_jsonl(records, path)
    return path, records


def test_each_fold_is_routed_by_estimators_that_never_held_its_prompts(tmp_path, built):
    cfg, _, est = built
    path, records = _file(tmp_path, built)
    world = load_world(cfg, N, str(path), est)
    assert len(world) == FOLDS
    replayed = set()
    for evalset, fold_est in world:
        held = set(fold_est.knn.prompt_hashes.tolist())
        mine = {prompt_hash(p) for p in evalset.prompts}
        assert held and not held & mine  # the index that routes a fold holds none of its prompts
        assert len(held) + len(mine) == N
        replayed |= mine
        # labels are the file's, per instance column; long answers clipped as the emulator clips them
        by_prompt = {r.prompt: r for r in records}
        for row, prompt in enumerate(evalset.prompts):
            for col, inst in enumerate(cfg.instances):
                label = by_prompt[prompt].models[inst.model]
                assert evalset.label_score[row, col] == label.score
                assert evalset.label_length[row, col] == min(label.output_length, MAX_OUTPUT_TOKENS)
        assert np.isfinite(evalset.quality).all() and (evalset.length > 0).all()
    assert replayed == {prompt_hash(r.prompt) for r in records}  # every prompt is replayed
    # the scheduler's compute is timed once and kept: another process (a sweep's worker) charges the same
    assert {ev.cost for ev, _ in load_world(cfg, N, str(path), est)} == {ev.cost for ev, _ in world}


def test_a_run_pools_the_folds_and_pairs_on_them(tmp_path, built):
    cfg, _, _ = built
    path, _ = _file(tmp_path, built)
    config = pool_config(tmp_path, cfg.estimators.models_dir)
    sweep = cells(N, capacity=10.0, loads=(0.5,))
    assert {c.spec.arrivals.rate for c in sweep} == {5.0}
    chosen = [c for c in sweep if (c.system, c.label) in {("routebalance", "quality"), ("single_model", "always 72B"),
                                                           ("best_route", "t=0.5+shortest_queue")}]
    compared = [p for p in pairs(chosen) if p.name.startswith(("quality preset vs always 72B",
                                                               "quality preset vs BEST-Route"))]
    result = run_seeded(chosen, str(config), N, seeds=2, workers=1, workload=str(path), pairs=compared)
    rows = result.rows
    for row in rows:
        assert row["requests"] == N and row["served"] == N  # every fold's prompts, pooled
        assert 0 < row["throughput"] <= 5.0 * 1.5  # the folds' time added, not overlapped
    always = next(r for r in rows if r["label"] == "always 72B")
    assert always["mix"]["Qwen/Qwen2.5-72B-Instruct"] == 1.0
    assert {p["pair"] for p in result.pairs} == {p.name for p in compared}
    assert all(np.isfinite(p["cost_mean_diff"]) for p in result.pairs)
