"""Per-request SLOs: where they come from, their classes, the verdict in the answer, and /metrics."""

from __future__ import annotations

import httpx
import openai
import pytest

from conftest import wait_for
from gateway.api.parse import parse_routing
from gateway.config.sections import ApiKey, parse_config
from gateway.core.slo import NO_SLO, slo_class, tpot_met
from gateway.tenancy.slo_check import resolve_slo

CLASSES = {"interactive": 30.0, "batch": 600.0}
POOL = [{"name": "a", "url": "http://127.0.0.1:9/", "model": "m", "gpu": "g", "tpot_prior_ms": 10.0,
         "price_input_per_mtok": 0.1, "price_output_per_mtok": 0.1}]


def test_a_request_falls_in_the_tightest_class_that_holds_its_slo():
    assert slo_class(None, CLASSES) == NO_SLO
    assert slo_class(5.0, CLASSES) == "interactive"
    assert slo_class(30.0, CLASSES) == "interactive"
    assert slo_class(31.0, CLASSES) == "batch"
    assert slo_class(5000.0, CLASSES) == "batch"  # longer than every bound: the loosest class


def test_time_per_token_counts_the_whole_request():
    assert tpot_met(2.0, 100, 0.02) and not tpot_met(2.0, 99, 0.02)
    assert not tpot_met(1.0, 0, 0.5)  # no tokens: the whole time for one


def test_the_request_wins_then_its_key_then_its_preset():
    cfg = parse_config({"instances": POOL, "slo": {"presets": {"latency": 12.0}}})
    key = ApiKey(name="k", sha256="0" * 64, slo_s=45.0, tpot_slo_ms=80.0)
    own = parse_routing({"slo_s": 7, "tpot_slo_ms": 30}, {}, cfg.scheduler.presets)
    assert resolve_slo(cfg, own, key) == (7.0, 0.03)
    assert resolve_slo(cfg, parse_routing({}, {}, cfg.scheduler.presets), key) == (45.0, 0.08)
    by_preset = parse_routing({"preset": "latency"}, {}, cfg.scheduler.presets)
    assert resolve_slo(cfg, by_preset, None) == (12.0, None)
    assert resolve_slo(cfg, parse_routing({}, {}, cfg.scheduler.presets), None) == (None, None)  # uniform: none
    header = parse_routing({}, {"X-Route-SLO-S": "20", "X-Route-TPOT-SLO-MS": "15"}, cfg.scheduler.presets)
    assert (header.slo_s, header.tpot_slo_ms) == (20.0, 15.0)
    body_wins = parse_routing({"slo_s": 3}, {"X-Route-SLO-S": "20"}, cfg.scheduler.presets)
    assert body_wins.slo_s == 3.0


def test_a_preset_slo_for_an_unknown_preset_is_a_config_error():
    with pytest.raises(ValueError, match="slo.presets.fastest"):
        parse_config({"instances": POOL, "slo": {"presets": {"fastest": 10.0}}})
    with pytest.raises(ValueError, match="auth.keys\\[0\\].slo_s"):
        parse_config({"instances": POOL, "slo": {"max_s": 60.0},
                      "auth": {"keys": [{"name": "k", "sha256": "0" * 64, "slo_s": 90.0}]}})


@pytest.fixture(scope="module")
def client(stack):
    c = openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0)
    yield c
    c.close()


def _slo_count(stack, cls: str, result: str) -> float:
    text = httpx.get(stack.base_url.removesuffix("/v1") + "/metrics", timeout=10).text
    for line in text.splitlines():
        if (line.startswith("routebalance_slo_requests_total{") and f'slo_class="{cls}"' in line
                and f'result="{result}"' in line and 'policy="routebalance"' in line):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_answer_says_whether_its_slo_was_met(client, stack):
    before_met, before_missed = _slo_count(stack, "interactive", "met"), _slo_count(stack, "interactive", "missed")
    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=[{"role": "user", "content": "Name a colour."}], max_tokens=6,
        extra_body={"routing": {"slo_s": 25, "tpot_slo_ms": 0.001}})
    resp = raw.parse()
    assert resp.usage.model_extra["slo_met"] is True  # a short answer on an idle pool: well within 25 s
    assert resp.usage.model_extra["tpot_slo_met"] is False  # a microsecond per token: no instance can
    assert raw.headers["X-Route-SLO-Met"] == "true" and raw.headers["X-Route-TPOT-SLO-Met"] == "false"
    # A bound no answer can meet is reported as missed, not dropped.
    late = client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True}, extra_body={"routing": {"slo_s": 0.0001}})
    usage = list(late)[-1].usage
    assert usage.model_extra["slo_met"] is False
    assert _slo_count(stack, "interactive", "met") == before_met + 1
    # The stream's client has [DONE] a moment before the handler counts its verdict.
    wait_for(lambda: _slo_count(stack, "interactive", "missed") == before_missed + 1, timeout=5,
             what="the late stream's verdict in /metrics")


def test_without_an_slo_the_answer_carries_no_verdict(client):
    resp = client.chat.completions.create(model="auto", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert "slo_met" not in resp.usage.model_extra and "tpot_slo_met" not in resp.usage.model_extra


def test_running_usage_carries_no_verdict_only_the_final_usage_does(client):
    """With continuous usage a chunk's usage covers a partial answer: a verdict there would be judged on
    it (a time per token from one token), so only the final usage is judged."""
    chunks = list(client.chat.completions.create(
        model="auto", messages=[{"role": "user", "content": "Count to ten."}], max_tokens=8, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"routing": {"slo_s": 25, "tpot_slo_ms": 60000}}))
    running = [c.usage for c in chunks if c.choices and c.usage is not None]
    assert running, "the emulator sends running usage when asked"
    assert all("slo_met" not in u.model_extra and "tpot_slo_met" not in u.model_extra for u in running)
    final = chunks[-1].usage
    assert not chunks[-1].choices and final.model_extra["slo_met"] is True and final.model_extra["tpot_slo_met"] is True
