"""The emulator's /metrics page reads like a real vLLM (v1) page."""

from __future__ import annotations

import math
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.lab.emulator.vllm_metrics import (
    CONTENT_TYPE,
    REQUEST_LATENCY_BUCKETS,
    TOKEN_LATENCY_BUCKETS,
    TTFT_BUCKETS,
    VllmMetrics,
    _FastHistogram,
    build_1_2_5_buckets,
)

MODEL = "qwen2.5-7b"


def make(**kw) -> VllmMetrics:
    args = dict(max_num_seqs=64, max_model_len=4096, block_size=16, num_gpu_blocks=2000, gpu_memory_utilization=0.9)
    args.update(kw)
    return VllmMetrics(MODEL, "0", **args)


def parse(m: VllmMetrics) -> dict:
    return {f.name: f for f in text_string_to_metric_families(m.render().decode())}


def sample(fams: dict, family: str, sample_name: str, **labels) -> float:
    hits = [
        s.value
        for s in fams[family].samples
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(hits) == 1, (family, sample_name, labels, hits)
    return hits[0]


def buckets(fams: dict, family: str) -> dict[float, float]:
    """le -> cumulative count."""
    return {
        float(s.labels["le"]): s.value for s in fams[family].samples if s.name == family + "_bucket"
    }


def le_strings(fams: dict, family: str) -> list[str]:
    return [s.labels["le"] for s in fams[family].samples if s.name == family + "_bucket"]


EXPECTED_TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:cache_config_info": "gauge",
    # The parser strips _total from counter family names.
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:request_success": "counter",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_prefill_kv_computed_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:iteration_tokens_total": "histogram",
}


def test_families_names_types_and_labels():
    fams = parse(make())
    for name, typ in EXPECTED_TYPES.items():
        assert name in fams, name
        assert fams[name].type == typ, (name, fams[name].type)
    vllm_families = {n for n in fams if n.startswith("vllm:") and not n.endswith("_created")}
    assert vllm_families == set(EXPECTED_TYPES)
    for fam in fams.values():
        for s in fam.samples:
            assert s.labels["model_name"] == MODEL, s
            assert s.labels["engine"] == "0", s


def test_counters_render_with_total_suffix():
    m = make()
    m.add_tokens(100, 7)
    text = m.render().decode()
    assert 'vllm:prompt_tokens_total{engine="0",model_name="qwen2.5-7b"} 100.0' in text
    assert "# TYPE vllm:generation_tokens_total counter" in text
    assert 'vllm:request_success_total{engine="0",finished_reason="stop",model_name="qwen2.5-7b"} 0.0' in text
    assert "vllm:time_to_first_token_seconds_bucket{" in text
    assert CONTENT_TYPE.startswith("text/plain")


def test_state_gauges_and_both_cache_usage_names():
    m = make()
    m.set_state(num_running=12, num_waiting=3, kv_cache_usage=0.375)
    fams = parse(m)
    assert sample(fams, "vllm:num_requests_running", "vllm:num_requests_running") == 12
    assert sample(fams, "vllm:num_requests_waiting", "vllm:num_requests_waiting") == 3
    assert sample(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.375
    assert sample(fams, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == 0.375
    m.set_state(0, 0, 0.0)
    fams = parse(m)
    assert sample(fams, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == 0.0
    assert sample(fams, "vllm:gpu_cache_usage_perc", "vllm:gpu_cache_usage_perc") == 0.0


def test_counters_accumulate():
    m = make()
    m.add_tokens(100, 1)
    m.add_tokens(0, 5)
    m.record_step(20, 30)
    m.add_preemptions(2)
    m.add_preemptions(0)
    m.add_prefix_cache(64, 32)
    fams = parse(m)
    assert sample(fams, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 120
    assert sample(fams, "vllm:generation_tokens", "vllm:generation_tokens_total") == 36
    assert sample(fams, "vllm:num_preemptions", "vllm:num_preemptions_total") == 2
    assert sample(fams, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == 64
    assert sample(fams, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total") == 32
    it = buckets(fams, "vllm:iteration_tokens_total")
    assert it[32.0] == 0 and it[64.0] == 1  # one step of 50 tokens


def test_bucket_boundaries_match_vllm():
    fams = parse(make(max_model_len=4096))
    ttft = le_strings(fams, "vllm:time_to_first_token_seconds")
    assert [float(x) for x in ttft[:-1]] == list(TTFT_BUCKETS) and ttft[-1] == "+Inf"
    assert len(TTFT_BUCKETS) == 22 and 2.0 not in TTFT_BUCKETS
    assert TTFT_BUCKETS[:5] == (0.001, 0.005, 0.01, 0.02, 0.04) and TTFT_BUCKETS[-1] == 2560.0
    for name in (
        "vllm:inter_token_latency_seconds",
        "vllm:time_per_output_token_seconds",
        "vllm:request_time_per_output_token_seconds",
    ):
        assert [float(x) for x in le_strings(fams, name)[:-1]] == list(TOKEN_LATENCY_BUCKETS)
    assert len(TOKEN_LATENCY_BUCKETS) == 19 and TOKEN_LATENCY_BUCKETS[0] == 0.01 and TOKEN_LATENCY_BUCKETS[-1] == 80.0
    for name in (
        "vllm:e2e_request_latency_seconds",
        "vllm:request_queue_time_seconds",
        "vllm:request_inference_time_seconds",
        "vllm:request_prefill_time_seconds",
        "vllm:request_decode_time_seconds",
    ):
        assert [float(x) for x in le_strings(fams, name)[:-1]] == list(REQUEST_LATENCY_BUCKETS)
    assert (len(REQUEST_LATENCY_BUCKETS) == 21 and REQUEST_LATENCY_BUCKETS[0] == 0.3
            and REQUEST_LATENCY_BUCKETS[-1] == 7680.0)
    tok = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000]
    assert build_1_2_5_buckets(4096) == tok
    for name in (
        "vllm:request_prompt_tokens",
        "vllm:request_generation_tokens",
        "vllm:request_params_max_tokens",
        "vllm:request_max_num_generation_tokens",
    ):
        assert [float(x) for x in le_strings(fams, name)[:-1]] == tok
    assert [float(x) for x in le_strings(fams, "vllm:request_params_n")[:-1]] == [1, 2, 5, 10, 20]
    assert [float(x) for x in le_strings(fams, "vllm:iteration_tokens_total")[:-1]] == [
        1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
    ]
    # le text as prometheus_client writes it (what a real vLLM page shows).
    assert ttft[0] == "0.001" and le_strings(fams, "vllm:request_prompt_tokens")[0] == "1.0"


def test_1_2_5_buckets_edges():
    assert build_1_2_5_buckets(1) == [1]
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]
    assert build_1_2_5_buckets(32768)[-1] == 20000
    assert build_1_2_5_buckets(50000)[-1] == 50000


def finished(m: VllmMetrics, **over) -> None:
    args = dict(
        finished_reason="stop",
        ttft_s=0.03,
        e2e_s=2.2,
        queue_s=0.01,
        prefill_s=0.02,
        decode_s=2.0,
        inference_s=2.02,
        prompt_tokens=300,
        generation_tokens=101,
        max_tokens=512,
    )
    args.update(over)
    m.observe_finished(**args)


def test_observe_finished_lands_in_the_right_buckets():
    m = make()
    finished(m)
    finished(m, finished_reason="length", ttft_s=1.7, e2e_s=40.0, queue_s=0.0, prefill_s=0.5,
             decode_s=30.0, inference_s=30.5, prompt_tokens=3000, generation_tokens=512, max_tokens=None,
             cached_tokens=2800)
    finished(m, finished_reason="abort", ttft_s=None, e2e_s=0.2, queue_s=0.2, prefill_s=0.0,
             decode_s=0.0, inference_s=0.0, prompt_tokens=10, generation_tokens=0, max_tokens=16)
    fams = parse(m)

    succ = "vllm:request_success"
    assert sample(fams, succ, succ + "_total", finished_reason="stop") == 1
    assert sample(fams, succ, succ + "_total", finished_reason="length") == 1
    assert sample(fams, succ, succ + "_total", finished_reason="abort") == 1
    assert sample(fams, succ, succ + "_total", finished_reason="error") == 0

    ttft = buckets(fams, "vllm:time_to_first_token_seconds")
    # 0.03 s: not <= 0.02, is <= 0.04. 1.7 s: first bucket is 2.5.
    assert ttft[0.02] == 0 and ttft[0.04] == 1
    assert ttft[1.0] == 1 and ttft[2.5] == 2 and ttft[math.inf] == 2
    ttft_name = "vllm:time_to_first_token_seconds"
    assert sample(fams, ttft_name, ttft_name + "_count") == 2  # the abort had no first token
    assert sample(fams, ttft_name, ttft_name + "_sum") == pytest.approx(1.73)

    e2e = buckets(fams, "vllm:e2e_request_latency_seconds")
    assert e2e[0.3] == 1 and e2e[2.0] == 1 and e2e[2.5] == 2 and e2e[30.0] == 2 and e2e[40.0] == 3

    dec = buckets(fams, "vllm:request_decode_time_seconds")
    assert dec[0.3] == 1 and dec[2.0] == 2 and dec[30.0] == 3
    q = buckets(fams, "vllm:request_queue_time_seconds")
    assert q[0.3] == 3
    inf_ = buckets(fams, "vllm:request_inference_time_seconds")
    assert inf_[2.0] == 1 and inf_[2.5] == 2 and inf_[40.0] == 3
    pre = buckets(fams, "vllm:request_prefill_time_seconds")
    assert pre[0.3] == 2 and pre[0.5] == 3

    pt = buckets(fams, "vllm:request_prompt_tokens")
    assert pt[10.0] == 1 and pt[500.0] == 2 and pt[2000.0] == 2 and pt[math.inf] == 3
    # computed, not cached: 300, 3000 - 2800 = 200, 10
    kv = buckets(fams, "vllm:request_prefill_kv_computed_tokens")
    assert kv[10.0] == 1 and kv[200.0] == 2 and kv[500.0] == 3
    kvn = "vllm:request_prefill_kv_computed_tokens"
    assert sample(fams, kvn, kvn + "_sum") == 510
    gt = buckets(fams, "vllm:request_generation_tokens")
    assert gt[1.0] == 1 and gt[100.0] == 1 and gt[200.0] == 2 and gt[1000.0] == 3
    mt = buckets(fams, "vllm:request_params_max_tokens")
    assert mt[math.inf] == 2 and mt[20.0] == 1 and mt[500.0] == 1 and mt[1000.0] == 2  # None not observed
    assert buckets(fams, "vllm:request_params_n")[1.0] == 3
    assert buckets(fams, "vllm:request_max_num_generation_tokens")[math.inf] == 3

    # Per-request TPOT = decode / (gen - 1): 2.0/100 = 0.02, 30/511 ~ 0.0587, 0.
    rt = buckets(fams, "vllm:request_time_per_output_token_seconds")
    assert rt[0.01] == 1 and rt[0.025] == 2 and rt[0.05] == 2 and rt[0.075] == 3
    rtn = "vllm:request_time_per_output_token_seconds"
    assert sample(fams, rtn, rtn + "_sum") == pytest.approx(0.02 + 30.0 / 511)


def test_unknown_finish_reason_gets_its_own_series():
    m = make()
    finished(m, finished_reason="repetition")
    fams = parse(m)
    assert sample(fams, "vllm:request_success", "vllm:request_success_total", finished_reason="repetition") == 1


def test_inter_token_batches_and_both_names_agree():
    m = make()
    m.observe_inter_token(0.03, count=64)  # one decode step over 64 sequences
    m.observe_inter_token(0.012)
    m.observe_inter_token(0.2, count=0)  # nothing
    m.observe_inter_token(-1.0)  # clamped to 0
    fams = parse(m)
    for name in ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"):
        b = buckets(fams, name)
        assert b[0.01] == 1 and b[0.025] == 2 and b[0.05] == 66 and b[math.inf] == 66
        assert sample(fams, name, name + "_count") == 66
        assert sample(fams, name, name + "_sum") == pytest.approx(0.03 * 64 + 0.012)


def test_observe_ttft_at_first_token():
    m = make()
    m.observe_ttft(0.005)  # boundary: le="0.005" includes it
    finished(m, ttft_s=None)
    fams = parse(m)
    b = buckets(fams, "vllm:time_to_first_token_seconds")
    assert b[0.001] == 0 and b[0.005] == 1 and b[math.inf] == 1


def test_fast_path_matches_public_observe():
    from prometheus_client import CollectorRegistry, Histogram

    reg = CollectorRegistry()
    fast = _FastHistogram(Histogram("a", "a", buckets=TTFT_BUCKETS, registry=reg))
    slow = Histogram("b", "b", buckets=TTFT_BUCKETS, registry=reg)
    assert fast.fast
    values = [0.0, 0.001, 0.0010001, 0.02, 0.03, 0.04, 2.5, 2559.9, 2560.0, 3000.0]
    for v in values:
        fast.observe(v)
        slow.observe(v)
    fast.observe_n(0.07, 5)
    for _ in range(5):
        slow.observe(0.07)
    fams = {f.name: f for f in text_string_to_metric_families(
        __import__("prometheus_client").generate_latest(reg).decode())}
    got = {(s.name[1:], tuple(sorted(s.labels.items()))): s.value
           for s in fams["a"].samples if "created" not in s.name}
    want = {(s.name[1:], tuple(sorted(s.labels.items()))): s.value
            for s in fams["b"].samples if "created" not in s.name}
    assert got.keys() == want.keys()
    for k in got:
        assert got[k] == pytest.approx(want[k]), k


def test_fallback_without_internals():
    class Plain:
        def __init__(self):
            self.seen = []

        def observe(self, v):
            self.seen.append(v)

    p = Plain()
    h = _FastHistogram(p)
    assert not h.fast
    h.observe(0.1)
    h.observe_n(0.2, 3)
    assert p.seen == [0.1, 0.2, 0.2, 0.2]


def test_cache_config_info():
    m = make(extra_cache_info={"enable_prefix_caching": True})
    fams = parse(m)
    (s,) = fams["vllm:cache_config_info"].samples
    assert s.value == 1.0
    assert s.labels["block_size"] == "16"
    assert s.labels["num_gpu_blocks"] == "2000"
    assert s.labels["gpu_memory_utilization"] == "0.9"
    assert s.labels["kv_cache_size_tokens"] == "32000"
    assert s.labels["cache_dtype"] == "auto"
    assert s.labels["enable_prefix_caching"] == "True"
    assert s.labels["num_gpu_blocks_override"] == "None"
    assert s.labels["engine"] == "0" and s.labels["model_name"] == MODEL


def test_instances_do_not_share_a_registry():
    a = VllmMetrics("m-a", max_num_seqs=8, max_model_len=2048, block_size=16, num_gpu_blocks=10,
                    gpu_memory_utilization=0.8)
    b = VllmMetrics("m-b", "1", max_num_seqs=8, max_model_len=2048, block_size=16, num_gpu_blocks=10,
                    gpu_memory_utilization=0.8)
    a.add_tokens(5, 5)
    fa, fb = parse(a), parse(b)
    assert sample(fa, "vllm:prompt_tokens", "vllm:prompt_tokens_total") == 5
    assert sample(fb, "vllm:prompt_tokens", "vllm:prompt_tokens_total", engine="1", model_name="m-b") == 0
    assert a.registry is not b.registry
    import prometheus_client

    assert "vllm:num_requests_running" not in prometheus_client.generate_latest().decode()


def test_bad_config_rejected():
    with pytest.raises(ValueError):
        make(max_model_len=0)
    with pytest.raises(ValueError):
        make(block_size=0)


def test_hot_path_is_cheap():
    m = make()
    n = 5000
    best = math.inf
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            m.set_state(10, 2, 0.5)
            m.record_step(0, 10)
            m.observe_inter_token(0.02, 10)
        best = min(best, (time.perf_counter() - t0) / n)
    assert best < 50e-6, best  # generous; typically ~7 microseconds per step
