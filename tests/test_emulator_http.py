"""The emulated vLLM instances over HTTP: metrics page, disconnects, faults."""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from conftest import ADMIN, wait_for


def vllm_metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=5).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def gauge(families: dict, name: str) -> float:
    return sum(s.value for s in families[name].samples)


def is_up(url: str) -> bool:
    """The instance answers /health (False when its port refuses connections)."""
    try:
        return httpx.get(url + "/health", timeout=1).status_code == 200
    except httpx.ConnectError:
        return False


def running_on(stack, model: str) -> float:
    """Requests running on all of a model's instances (round robin picks which one serves)."""
    return sum(gauge(vllm_metrics(i.url), "vllm:num_requests_running")
               for i in stack.store.current.instances if i.model == model)


def test_metrics_page_parses_and_counts_a_request(stack):
    inst = stack.store.current.instances[-1]
    before = vllm_metrics(inst.url)
    r = httpx.post(inst.url + "/v1/completions", json={"model": inst.model, "prompt": "hello world", "max_tokens": 4},
                   timeout=10)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    after = vllm_metrics(inst.url)
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:gpu_cache_usage_perc", "vllm:cache_config_info"):
        assert after[name].type == "gauge", name
    for name in ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds",
                 "vllm:inter_token_latency_seconds"):
        assert after[name].type == "histogram", name

    def total(fams, name, suffix, **labels):
        return sum(s.value for s in fams[name].samples if s.name == name + suffix
                   and all(s.labels.get(k) == v for k, v in labels.items()))

    assert total(after, "vllm:generation_tokens", "_total") - total(before, "vllm:generation_tokens", "_total") == 4
    assert total(after, "vllm:request_success", "_total", finished_reason="length") - \
        total(before, "vllm:request_success", "_total", finished_reason="length") == 1
    assert total(after, "vllm:e2e_request_latency_seconds", "_count") - \
        total(before, "vllm:e2e_request_latency_seconds", "_count") == 1
    labels = {s.labels["model_name"] for s in after["vllm:num_requests_running"].samples}
    assert labels == {inst.model}


def test_client_disconnect_mid_stream_frees_the_upstream_request(stack):
    model = "Qwen/Qwen2.5-72B-Instruct"  # a 1,000-token answer takes ~50 s
    body = {"model": model, "messages": [{"role": "user", "content": "write a long essay"}],
            "max_tokens": 1000, "stream": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", stack.base_url + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: ") for line in got)
            assert running_on(stack, model) == 1
            served = r.headers["X-Route-Instance"]
        # the response is closed here: the client went away mid-stream
    wait_for(lambda: running_on(stack, model) == 0, 5, "the upstream request to stop after the client left")
    fams = vllm_metrics(stack.store.current.instance(served).url)
    aborted = sum(s.value for s in fams["vllm:request_success"].samples
                  if s.name.endswith("_total") and s.labels["finished_reason"] == "abort")
    assert aborted >= 1


def test_a_down_instance_is_retried_on_another_and_comes_back(stack):
    cfg = stack.store.current
    model = "Qwen/Qwen2.5-72B-Instruct"
    down, other = [i.name for i in cfg.instances if i.model == model]
    stack.call(stack.pool.set_faults(down, down=True))
    try:
        with httpx.Client(timeout=30) as http:
            for _ in range(4):
                r = http.post(stack.base_url + "/chat/completions",
                              json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
                assert r.status_code == 200
                assert r.headers["X-Route-Instance"] == other
    finally:
        stack.call(stack.pool.set_faults(down, down=False))
    host, port = stack.pool.address(down)
    assert httpx.get(f"http://{host}:{port}/health", timeout=5).status_code == 200


def test_error_rate_fault_fails_directly_and_the_gateway_retries(stack):
    cfg = stack.store.current
    target = cfg.instances[-1]
    stack.call(stack.pool.set_faults(target.name, error_rate=1.0))
    try:
        r = httpx.post(target.url + "/v1/completions", json={"model": target.model, "prompt": "x", "max_tokens": 1},
                       timeout=5)
        assert r.status_code == 500
        # Through the gateway, the model's other instances answer instead.
        with httpx.Client(timeout=30) as http:
            for _ in range(6):
                r = http.post(stack.base_url + "/completions",
                              json={"model": target.model, "prompt": "x", "max_tokens": 1})
                assert r.status_code == 200 and r.headers["X-Route-Instance"] != target.name
    finally:
        stack.call(stack.pool.set_faults(target.name, error_rate=0.0))


def test_added_latency_fault_delays_the_answer(stack):
    target = stack.store.current.instances[-2]
    stack.call(stack.pool.set_faults(target.name, added_latency_ms=300))
    try:
        start = time.monotonic()
        r = httpx.post(target.url + "/v1/completions", json={"model": target.model, "prompt": "x", "max_tokens": 1},
                       timeout=5)
        assert r.status_code == 200 and time.monotonic() - start >= 0.3
    finally:
        stack.call(stack.pool.set_faults(target.name, added_latency_ms=0))


def test_whole_model_down_is_a_502_with_an_openai_error(stack):
    cfg = stack.store.current
    model = "Qwen/Qwen2.5-72B-Instruct"
    names = [i.name for i in cfg.instances if i.model == model]
    for n in names:
        stack.call(stack.pool.set_faults(n, down=True))
    try:
        r = httpx.post(stack.base_url + "/chat/completions", timeout=30,
                       json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        # 502 from the refused attempts, or 503 if a scrape found them refusing first (they cool down).
        assert (r.status_code, r.json()["error"]["code"] if r.status_code == 503 else "unreachable" in
                r.json()["error"]["message"]) in ((502, True), (503, "no_healthy_instance"))
        ok = httpx.post(stack.base_url + "/chat/completions", timeout=30,
                        json={"model": "auto", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1})
        assert ok.status_code == 200
    finally:
        for n in names:
            stack.call(stack.pool.set_faults(n, down=False))
        stack.wait_routable()  # back after their cooldown, for the tests that follow


def test_client_disconnect_before_a_non_streamed_answer_frees_the_upstream_request(stack):
    import socket

    import orjson

    model = "Qwen/Qwen2.5-72B-Instruct"
    body = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "long"}], "max_tokens": 1000})
    host, port = stack.root.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        wait_for(lambda: running_on(stack, model) == 1, 5, "the request to reach the instance")
    wait_for(lambda: running_on(stack, model) == 0, 5, "the upstream request to stop after the client left")


def test_fault_knobs_follow_a_config_reload(stack):
    original = stack.config_path.read_text()
    target = stack.store.current.instances[-1]
    # The last [[instances]] table ends the file: a faults table appended there is its own.
    edited = original + "\n[instances.faults]\ndown = true\n"
    try:
        stack.config_path.write_text(edited)
        assert httpx.post(stack.root + "/admin/reload", headers=ADMIN, timeout=5).status_code == 200
        wait_for(lambda: not is_up(target.url), 5, "the instance to go down after the reload said so")
    finally:
        stack.config_path.write_text(original)
        assert httpx.post(stack.root + "/admin/reload", headers=ADMIN, timeout=5).status_code == 200
    wait_for(lambda: is_up(target.url), 5, "the instance to come back")
