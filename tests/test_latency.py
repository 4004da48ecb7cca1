"""TPOT heads: traces from a rate sweep, XGBoost fit, fallback to the prior, and telemetry parsing."""

from __future__ import annotations

import numpy as np
import pytest

from gateway.artefacts import ArtefactError
from gateway.config.store import default_config_path, load_config
from gateway.core.view import tier_key
from gateway.estimators.latency import FEATURES, LatencyHeads, fit_head
from gateway.lab.training.build import tier_lengths
from gateway.lab.training.profile import live_sweep
from gateway.lab.training.traces import read_traces, to_arrays, virtual_sweep, write_traces
from gateway.serving.telemetry import parse_vllm_metrics

CFG = load_config(default_config_path())
FIRST_OF = {}
for _i in CFG.instances:
    FIRST_OF.setdefault(_i.model, _i)


@pytest.mark.parametrize("model", ["Qwen/Qwen2.5-72B-Instruct", "Qwen/Qwen2.5-3B-Instruct"])
def test_heads_beat_the_static_prior_on_held_out_traces(model):
    inst = FIRST_OF[model]
    tier = tier_key(inst.model, inst.gpu)
    train = virtual_sweep(inst, tier_lengths([], model, seed=1), requests_per_rate=300, seed=0)
    held_out = virtual_sweep(inst, tier_lengths([], model, seed=7), requests_per_rate=300, seed=5)
    x, y = to_arrays(train)
    xt, yt = to_arrays(held_out)
    heads = LatencyHeads({tier: fit_head(x, y)}, {tier: inst.tpot_prior_ms / 1000})
    head_mae = np.mean(np.abs(heads.tpot(tier, xt) - yt))
    prior_mae = np.mean(np.abs(inst.tpot_prior_ms / 1000 - yt))
    assert head_mae < 0.5 * prior_mae
    # TPOT rises with load, so the sweep covered the regime the heads must learn.
    assert min(yt) == pytest.approx(inst.tpot_prior_ms / 1000, rel=0.02)  # a request that ran alone
    assert max(yt) > 2 * inst.tpot_prior_ms / 1000
    # More of what the gateway sent there never prices an instance faster (estimators/latency.py, RISING) ...
    busier = xt.copy()
    for feature, more in (("in_flight", 1), ("pending_prefill_tokens", xt[:, FEATURES.index("prompt_tokens")]),
                          ("pending_decode_tokens", xt[:, FEATURES.index("output_tokens")])):
        busier[:, FEATURES.index(feature)] += more
    assert (heads.tpot(tier, busier) >= heads.tpot(tier, xt)).all()
    # ... and an idle instance is priced at its unloaded decode, not slower than a busy one.
    idle = np.zeros_like(xt)
    idle[:, -2:] = xt[:, -2:]  # the same requests, on an instance with nothing on it
    assert np.median(heads.tpot(tier, idle)) == pytest.approx(inst.tpot_prior_ms / 1000, rel=0.05)


def test_missing_head_falls_back_to_the_prior():
    heads = LatencyHeads({}, {"m@g": 0.02})
    assert np.allclose(heads.tpot("m@g", np.zeros((3, len(FEATURES)))), 0.02)


def test_heads_and_traces_round_trip_and_corrupt_files_are_named(tmp_path):
    inst = FIRST_OF["Qwen/Qwen2.5-14B-Instruct"]
    tier = tier_key(inst.model, inst.gpu)
    rows = virtual_sweep(inst, tier_lengths([], inst.model, seed=1), requests_per_rate=100)
    write_traces(rows, tmp_path / "t.jsonl")
    assert read_traces(tmp_path / "t.jsonl") == rows
    x, y = to_arrays(rows)
    heads = LatencyHeads({tier: fit_head(x, y)}, {tier: 0.0184})
    files = heads.save(tmp_path)
    loaded = LatencyHeads.load(tmp_path, files, {tier: 0.0184})
    assert np.allclose(loaded.tpot(tier, x), heads.tpot(tier, x))
    (tmp_path / files[tier]).write_text("{ not a booster")
    with pytest.raises(ArtefactError, match=files[tier]):
        LatencyHeads.load(tmp_path, files, {tier: 0.0184})
    (tmp_path / "bad.jsonl").write_text('{"tier": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        read_traces(tmp_path / "bad.jsonl")


OLD_GENERATION_PAGE = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3
vllm:num_requests_running{engine="1",model_name="m"} 2
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1
vllm:num_requests_waiting{engine="1",model_name="m"} 0
# TYPE vllm:gpu_cache_usage_perc gauge
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.5
vllm:gpu_cache_usage_perc{engine="1",model_name="m"} 0.3
# TYPE vllm:generation_tokens counter
vllm:generation_tokens{engine="0",model_name="m"} 1000
vllm:generation_tokens{engine="1",model_name="m"} 500
"""


def test_telemetry_reads_the_older_generation_and_sums_data_parallel_ranks():
    snap = parse_vllm_metrics(OLD_GENERATION_PAGE)
    assert (snap.running, snap.waiting, snap.generation_tokens) == (5, 1, 1500)
    assert snap.kv_usage == pytest.approx(0.4)
    with pytest.raises(ValueError, match="num_requests_running"):
        parse_vllm_metrics("# TYPE x gauge\nx 1\n")


def test_live_profile_against_the_emulator(stack):
    inst = next(i for i in stack.store.current.instances if i.model == "Qwen/Qwen2.5-3B-Instruct")
    rows = stack.call(live_sweep(inst.url, inst.model, inst.gpu, [(40, 30), (80, 20)], rates=[5.0],
                                 requests_per_rate=12, scrape_interval_s=0.2), timeout=60)
    assert len(rows) == 12
    assert all(r["tier"] == tier_key(inst.model, inst.gpu) for r in rows)
    # At 5 req/s a 3B instance is lightly loaded: TPOT near its prior (the emulator
    # delivers on a 10 ms tick, so single gaps jitter but the mean holds).
    assert np.median([r["tpot_s"] for r in rows]) == pytest.approx(inst.tpot_prior_ms / 1000, rel=0.25)
    assert any(r["in_flight"] > 0 for r in rows) and all(r["running"] >= 0 for r in rows)


def test_a_builds_sweeps_give_the_same_rows_in_one_process_or_several(monkeypatch):
    """A build sweeps its tiers in one process per core (spawned: the parent holds onnxruntime's threads); each
    sweep is seeded on its own, so the heads do not depend on the machine's core count."""
    import os
    import types

    from gateway.lab.training import build

    tiers = [t for t in build.inputs_from_config(CFG).tiers if t.buildable][:2]
    short = types.SimpleNamespace(output_length=3)  # short answers: a sweep of a few thousand steps
    records = [types.SimpleNamespace(input_len=40 + k, models={t.sweep_instance.model: short for t in tiers})
               for k in range(5)]
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0, 1})
    several = build.sweep_tiers(tiers, records, seed=3)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _pid: {0})
    one = build.sweep_tiers(tiers, records, seed=3)
    assert several == one and set(one) == {t.key for t in tiers}
    assert all(len(train) == len(test) > 0 for train, test in one.values())
