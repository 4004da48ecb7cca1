"""OpenTelemetry traces of the routing decisions (gateway/serving/tracing.py), through the real gateway in front
of stub instances that keep the headers they get, with the openai SDK as the client: read back from the SDK's
in-memory exporter and from an OTLP/HTTP receiver on loopback. Off (the default), nothing of it is imported."""

from __future__ import annotations

import subprocess
import sys
import threading
import tomllib
import uuid

import openai
import pytest
from aiohttp import web
from stubs import LoopThread, Stub, StubStack, close, serve, stub_config, stub_instance
from test_layers import SERVE

from conftest import RECORDS, Stack, dump_toml, free_port, pool_config, wait_for
from gateway.config.sections import parse_config
from gateway.config.store import default_config_path
from gateway.config_schema import ConfigError

EXTRA = "the tracing extra: pip install 'routebalance-gateway[tracing]'"
MODEL_7B, MODEL_3B = "Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-3B-Instruct"
PROMPT = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
# A client's span: trace id, span id, sampled (W3C Trace Context).
CLIENT_TRACE, CLIENT_SPAN = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
TRACEPARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def _stubs_config(tmp, stubs, **sections):
    instances = [
        stub_instance(stubs[0], "stub-7b", model=MODEL_7B),
        stub_instance(stubs[1], "stub-3b", model=MODEL_3B, price_input_per_mtok=0.06, price_output_per_mtok=0.1),
    ]
    return stub_config(tmp, stubs, instances, **sections)


@pytest.fixture(scope="module")
def traced(tmp_path_factory, built):
    """(stack, exporter): RouteBalance over two stubs (7B, 3B) with the shared small build, its spans kept in
    memory."""
    pytest.importorskip("opentelemetry.sdk.trace", reason=EXTRA)
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.serving import tracing

    exporter = InMemorySpanExporter()
    stubs = [Stub(), Stub()]
    path = _stubs_config(
        tmp_path_factory.mktemp("traced"),
        stubs,
        scheduler={"policy": "routebalance"},
        estimators={"models_dir": built[0].estimators.models_dir, "train_records": RECORDS},
        tracing={"enabled": True, "export_interval_s": 0.05},
    )
    tracing.export_to(exporter)
    try:
        stack = StubStack(path, stubs)
    finally:
        tracing.export_to(None)
    yield stack, exporter
    stack.stop()


@pytest.fixture(scope="module")
def client(traced):
    c = openai.OpenAI(base_url=traced[0].base_url, api_key="unused", timeout=60, max_retries=0)
    yield c
    c.close()


def _trace(traced, trace_id: int, spans: int) -> list:
    """The spans of one trace, once `spans` of them were exported."""
    stack, exporter = traced

    def found() -> list:
        stack.gateway.tracing.provider.force_flush()
        return [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]

    wait_for(lambda: len(found()) >= spans, 10, f"{spans} spans of the trace")
    return found()


def _one(spans: list, name: str):
    (span,) = [s for s in spans if s.name == name]
    return span


def test_a_routed_request_is_one_trace_from_its_client_to_the_instance(client, traced):
    from opentelemetry.trace import SpanKind

    raw = client.chat.completions.with_raw_response.create(
        model="auto", messages=PROMPT, max_tokens=8, extra_headers={"traceparent": TRACEPARENT}
    )
    raw.parse()
    spans = _trace(traced, int(CLIENT_TRACE, 16), 3)
    route = _one(spans, "route chat.completions")
    assert route.kind == SpanKind.SERVER and route.parent.span_id == int(CLIENT_SPAN, 16)
    a = route.attributes
    assert a["routebalance.policy"] == "routebalance" and a["routebalance.preset"] == "uniform"
    assert a["routebalance.candidates"] == ("stub-7b", "stub-3b") and a["routebalance.candidates.count"] == 2
    assert a["routebalance.instance"] == raw.headers["X-Route-Instance"]
    assert a["routebalance.model"] == raw.headers["X-Route-Model"]
    assert f"{a['routebalance.predicted.quality']:.4f}" == raw.headers["X-Route-Predicted-Quality"]
    assert f"{a['routebalance.predicted.cost_usd']:.10f}" == raw.headers["X-Route-Predicted-Cost-USD"]
    assert a["routebalance.predicted.latency_s"] > 0
    assert f"v{a['routebalance.estimator.version']}" == raw.headers["X-Route-Estimator"]
    assert a["gen_ai.request.model"] == "auto" and a["gen_ai.request.max_tokens"] == 8
    assert a["gen_ai.usage.output_tokens"] == 8 and a["http.response.status_code"] == 200
    assert a["routebalance.cost_usd"] > 0

    estimate = _one(spans, "estimate batch")
    assert estimate.parent.span_id == route.context.span_id
    assert estimate.attributes["routebalance.estimator.version"] == a["routebalance.estimator.version"]
    assert estimate.attributes["routebalance.batch.size"] >= 1
    assert route.start_time <= estimate.start_time < estimate.end_time <= route.end_time

    attempt = _one(spans, "attempt chat.completions")
    assert attempt.kind == SpanKind.CLIENT and attempt.parent.span_id == route.context.span_id
    assert attempt.attributes["routebalance.instance"] == raw.headers["X-Route-Instance"]
    assert attempt.attributes["http.response.status_code"] == 200
    # The instance got the attempt's span as its parent: vLLM's own spans join the same trace.
    stub = traced[0].stubs[0 if raw.headers["X-Route-Instance"] == "stub-7b" else 1]
    sent = [h["traceparent"] for h, _ in stub.requests if CLIENT_TRACE in h.get("traceparent", "")]
    assert sent == [f"00-{CLIENT_TRACE}-{attempt.context.span_id:016x}-01"]


def test_a_stream_without_traceparent_starts_its_own_trace(client, traced):
    _, exporter = traced
    before = {s.context.trace_id for s in exporter.get_finished_spans()}
    stream = client.chat.completions.create(
        model=MODEL_3B,
        messages=PROMPT,
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"routing": {"weights": {"quality": 0.2, "latency": 0.3, "cost": 0.5}}},
    )
    assert [c for c in stream if c.usage is not None][0].usage.completion_tokens == 5

    def new_route():
        traced[0].gateway.tracing.provider.force_flush()
        return [
            s
            for s in exporter.get_finished_spans()
            if s.name == "route chat.completions" and s.context.trace_id not in before
        ]

    wait_for(new_route, 10, "the stream's span")
    (route,) = new_route()
    a = route.attributes
    assert route.parent is None and a["routebalance.stream"] is True and "routebalance.preset" not in a
    assert (a["routebalance.weights.quality"], a["routebalance.weights.cost"]) == (0.2, 0.5)
    assert a["routebalance.candidates"] == ("stub-3b",) and a["routebalance.served_by"] == "stub-3b"
    assert a["gen_ai.usage.output_tokens"] == 5


@pytest.mark.parametrize(
    ("ask", "status", "code"),
    [
        ({"model": "auto", "extra_body": {"routing": {"budget_usd": 1e-12}}}, 402, "insufficient_budget"),
        ({"model": "no-such-model"}, 404, "model_not_found"),
    ],
)
def test_a_refused_request_says_why(client, traced, ask, status, code):
    trace_id = uuid.uuid4().hex  # a trace of its own
    with pytest.raises(openai.APIStatusError) as refused:
        client.chat.completions.create(
            messages=PROMPT, max_tokens=8, extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"}, **ask
        )
    assert refused.value.status_code == status
    route = _one(_trace(traced, int(trace_id, 16), 1), "route chat.completions")
    a = route.attributes
    assert (a["routebalance.refusal.status"], a["routebalance.refusal.code"]) == (status, code)
    assert a["http.response.status_code"] == status
    if status == 402:  # refused by its policy: the decision's reason, and what the budget was
        assert a["routebalance.refusal.reason"] == "budget" and a["routebalance.budget_usd"] == 1e-12


def test_failed_attempts_each_have_a_span_saying_what_followed(client, traced):
    """Both instances answer 500: an attempt on each, failed, the second a retry; the client gets 502. (Last of
    the tests on this stack: the failures put both stubs in cooldown.)"""
    from opentelemetry.trace import StatusCode

    stubs = traced[0].stubs
    trace_id = uuid.uuid4().hex
    for stub in stubs:
        stub.mode = {"status": 500}
    try:
        with pytest.raises(openai.APIStatusError) as failed:
            client.chat.completions.create(
                model="auto",
                messages=PROMPT,
                max_tokens=8,
                extra_headers={"traceparent": f"00-{trace_id}-{CLIENT_SPAN}-01"},
            )
    finally:
        for stub in stubs:
            stub.mode = {}
    assert failed.value.status_code == 502
    spans = _trace(traced, int(trace_id, 16), 4)
    route = _one(spans, "route chat.completions")
    assert route.status.status_code == StatusCode.ERROR and route.attributes["http.response.status_code"] == 502
    attempts = sorted((s for s in spans if s.name == "attempt chat.completions"), key=lambda s: s.start_time)
    assert [s.attributes["routebalance.attempt"] for s in attempts] == [1, 2]
    assert {s.attributes["routebalance.instance"] for s in attempts} == {"stub-7b", "stub-3b"}
    for s in attempts:
        assert s.status.status_code == StatusCode.ERROR and s.attributes["routebalance.attempt.then"] == "retry"
        assert "failed with status 500" in s.attributes["routebalance.attempt.failure"]


class OtlpReceiver:
    """An OTLP/HTTP traces endpoint on loopback: keeps each export request, decoded."""

    def __init__(self):
        self.port = free_port()
        self.exports: list = []
        self.lock = threading.Lock()
        self.runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.runner = await serve(app, self.port)

    async def _traces(self, request: web.Request) -> web.Response:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
            ExportTraceServiceRequest,
            ExportTraceServiceResponse,
        )

        assert request.content_type == "application/x-protobuf"
        with self.lock:
            self.exports.append(ExportTraceServiceRequest.FromString(await request.read()))
        return web.Response(
            body=ExportTraceServiceResponse().SerializeToString(), content_type="application/x-protobuf"
        )

    def spans(self, trace_id: bytes) -> list[tuple[str, object]]:
        """(service.name, span) of every exported span of the trace."""
        out = []
        with self.lock:
            for export in self.exports:
                for resource in export.resource_spans:
                    service = next(
                        a.value.string_value for a in resource.resource.attributes if a.key == "service.name"
                    )
                    out += [
                        (service, s) for scope in resource.scope_spans for s in scope.spans if s.trace_id == trace_id
                    ]
        return out


def test_spans_are_exported_over_otlp_to_the_configured_endpoint(tmp_path):
    pytest.importorskip("opentelemetry.proto", reason=EXTRA)
    receiver, loop = OtlpReceiver(), LoopThread()
    loop.call(receiver.start())
    stubs = [Stub(), Stub()]
    path = _stubs_config(
        tmp_path,
        stubs,
        tracing={
            "enabled": True,
            "otlp_endpoint": f"http://127.0.0.1:{receiver.port}/v1/traces",
            "service_name": "gateway-under-test",
            "export_interval_s": 0.05,
            "export_timeout_s": 2.0,
        },
    )
    stack = StubStack(path, stubs)
    try:
        with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as c:
            c.chat.completions.create(
                model="auto", messages=PROMPT, max_tokens=4, extra_headers={"traceparent": TRACEPARENT}
            )
        wanted = bytes.fromhex(CLIENT_TRACE)
        wait_for(lambda: len(receiver.spans(wanted)) >= 2, 10, "the spans at the receiver")
        spans = receiver.spans(wanted)
        assert {service for service, _ in spans} == {"gateway-under-test"}
        names = {s.name: s for _, s in spans}
        route, attempt = names["route chat.completions"], names["attempt chat.completions"]
        assert route.parent_span_id == bytes.fromhex(CLIENT_SPAN) and attempt.parent_span_id == route.span_id
        policy = {a.key: a.value.string_value for a in route.attributes}["routebalance.policy"]
        assert policy == "passthrough+round_robin"
    finally:
        stack.stop()
        loop.call(close(receiver.runner))
        loop.stop()


def test_off_by_default_nothing_of_tracing_is_imported(tmp_path):
    """`routebalance serve` with the default [tracing] (off), answering, has loaded neither the gateway's tracing
    nor OpenTelemetry's tracing SDK or exporter. (redis-py imports OpenTelemetry's API and metrics SDK itself
    when they are installed, for its own metrics: that is not the gateway's doing, and traces nothing.)"""
    path = pool_config(tmp_path)
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            SERVE,
            str(path),
            str(free_port()),
            "gateway.serving.tracing",
            "opentelemetry.sdk.trace",
            "opentelemetry.exporter",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout


def test_off_a_clients_trace_context_reaches_the_instance_untouched(tmp_path):
    """Not tracing, the gateway is transparent to traces: the client's `traceparent` and `tracestate` go on to
    the instance as they came, so vLLM's spans still join the client's trace; a request without them sends none."""
    stubs = [Stub(), Stub()]
    stack = StubStack(_stubs_config(tmp_path, stubs), stubs)
    try:
        with openai.OpenAI(base_url=stack.base_url, api_key="unused", timeout=30, max_retries=0) as c:
            for model in (MODEL_7B, MODEL_3B):
                c.chat.completions.create(model=model, messages=PROMPT, max_tokens=4,
                                          extra_headers={"traceparent": TRACEPARENT, "tracestate": "vendor=1"})
            c.chat.completions.create(model=MODEL_7B, messages=PROMPT, max_tokens=4)
        assert stack.gateway.tracing is None
        sent = [(h.get("traceparent"), h.get("tracestate")) for stub in stubs for h, _ in stub.requests]
        assert sorted(sent, key=str) == sorted([(TRACEPARENT, "vendor=1")] * 2 + [(None, None)], key=str)
    finally:
        stack.stop()


def test_tracing_without_its_extra_stops_the_start_naming_what_to_install(tmp_path):
    path = pool_config(tmp_path, tracing={"enabled": True})
    hide = "import sys; sys.modules['opentelemetry'] = None; from gateway import cli; "
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            hide + f"sys.exit(cli.main(['serve', '--config', {str(path)!r}, '--port', '{free_port()}']))",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2, out.stderr
    assert "tracing.enabled: needs OpenTelemetry" in out.stderr
    assert "pip install 'routebalance-gateway[tracing]'" in out.stderr


def test_an_embeddings_request_is_traced_with_its_attempt(tmp_path):
    """No decision and no estimate: the request and its attempt on the least loaded embed instance."""
    pytest.importorskip("opentelemetry.sdk.trace", reason=EXTRA)
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from gateway.serving import tracing

    path = pool_config(tmp_path, tracing={"enabled": True, "export_interval_s": 0.05})
    data = tomllib.loads(path.read_text())
    data["instances"].append(
        {
            "name": "bge-0",
            "url": f"http://127.0.0.1:{free_port()}",
            "kind": "embed",
            "model": "BAAI/bge-small-en-v1.5",
            "gpu": "A30-24GB",
            "max_model_len": 512,
            "price_input_per_mtok": 0.02,
            "price_output_per_mtok": 0.0,
            "tpot_prior_ms": 1.0,
        }
    )
    path.write_text(dump_toml(data))
    exporter = InMemorySpanExporter()
    tracing.export_to(exporter)
    try:
        stack = Stack(path)
    finally:
        tracing.export_to(None)
    try:
        with openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0) as c:
            c.embeddings.create(
                model="BAAI/bge-small-en-v1.5", input="the sky is blue", extra_headers={"traceparent": TRACEPARENT}
            )
        spans = _trace((stack, exporter), int(CLIENT_TRACE, 16), 2)
        route, attempt = _one(spans, "route embeddings"), _one(spans, "attempt embeddings")
        assert route.attributes["gen_ai.operation.name"] == "embeddings"
        assert route.attributes["http.response.status_code"] == 200
        assert attempt.parent.span_id == route.context.span_id
        assert attempt.attributes["routebalance.instance"] == "bge-0"
    finally:
        stack.stop()


@pytest.mark.parametrize(
    ("table", "key"),
    [
        ({"otlp_endpoint": "127.0.0.1:4318"}, "tracing.otlp_endpoint"),
        ({"sample_ratio": 1.5}, "tracing.sample_ratio"),
        ({"max_queue_spans": 100, "export_batch_spans": 200}, "tracing.export_batch_spans"),
    ],
)
def test_the_tracing_table_is_checked(table, key):
    data = tomllib.loads(default_config_path().read_text())
    data["tracing"].update(table)
    with pytest.raises(ConfigError) as bad:
        parse_config(data)
    assert bad.value.key == key
