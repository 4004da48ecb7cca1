"""OpenTelemetry traces of the routing decisions: the one module of the gateway that uses OpenTelemetry.

It is imported only when `[tracing] enabled` (gateway/serving/app.py `open_tracing`), so a gateway that does
not trace imports nothing of OpenTelemetry, and its handlers and dispatch test one reference (None) and do
nothing else. Traced, each client request is one trace, or joins its client's (a W3C `traceparent` header):

    route <endpoint>     SERVER, the request: what it asked, what the scheduler decided and predicted, how it ended
      estimate batch     INTERNAL, its batch's estimate (the same times for every request of the batch)
      attempt <endpoint> CLIENT, one per instance tried; it sends `traceparent` on, so vLLM's spans join the trace

The scheduling loop estimates a batch of requests at once, and each request has its own trace: the batch's
estimate is recorded once per request, as a child of each with the batch's own start and end, the same
`routebalance.batch.id`, and links to the other requests of the batch. The functional core knows nothing of
this: the spans record what a decision already carries.

The spans go through a bounded queue (`max_queue_spans`; past it new spans are dropped, never requests) to a
thread that exports them over OTLP/HTTP, each POST within `export_timeout_s`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from gateway.api.errors import ApiError
from gateway.config.sections import Config, TracingConfig
from gateway.config_schema import ConfigError

try:
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
    from opentelemetry.trace import Link, Span, SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError as e:
    raise ConfigError(
        f"needs OpenTelemetry, which is not installed ({e.name}): pip install 'routebalance-gateway[tracing]'",
        "tracing.enabled",
    ) from None

if TYPE_CHECKING:
    from gateway.config.sections import Instance
    from gateway.core.request import RouteRequest, Ticket
    from gateway.serving.relay import RelayResult, UpstreamFailed

P = "routebalance."  # the prefix of the gateway's own attributes
MAX_LISTED = 16  # instance names listed in one attribute, and links from one batch's estimate
OPERATIONS = {"chat": "chat", "completions": "text_completion", "responses": "chat", "embeddings": "embeddings"}
ENDPOINTS = {
    "chat": "chat.completions",
    "completions": "completions",
    "responses": "responses",
    "embeddings": "embeddings",
}
_PROPAGATOR = TraceContextTextMapPropagator()
_replacement: SpanExporter | None = None


def export_to(exporter: SpanExporter | None) -> None:
    """Send the spans of gateways started from now on to `exporter` instead of OTLP (None: OTLP again): how a
    test reads them (the SDK's InMemorySpanExporter)."""
    global _replacement
    _replacement = exporter


class Tracing:
    """The gateway's tracer: its own provider (no global one is set, so several gateways in one process each
    export to their own collector), sampled as `sample_ratio` says unless the client's `traceparent` decides."""

    def __init__(self, cfg: TracingConfig):
        exporter = _replacement or OTLPSpanExporter(endpoint=cfg.otlp_endpoint, timeout=cfg.export_timeout_s)
        self.provider = TracerProvider(
            sampler=ParentBased(TraceIdRatioBased(cfg.sample_ratio)),
            resource=Resource.create({"service.name": cfg.service_name}),
            shutdown_on_exit=False,
        )
        self.provider.add_span_processor(
            BatchSpanProcessor(
                exporter,
                max_queue_size=cfg.max_queue_spans,
                schedule_delay_millis=cfg.export_interval_s * 1000,
                max_export_batch_size=cfg.export_batch_spans,
                export_timeout_millis=cfg.export_timeout_s * 1000,
            )
        )
        self.tracer = self.provider.get_tracer("routebalance.gateway")
        self._batches = itertools.count(1)

    def request(self, headers: Mapping[str, str], route: str, path: str) -> RequestTrace:
        """The span of one client request, the child of its client's span if it sent a `traceparent`."""
        parent = _PROPAGATOR.extract(headers) if "traceparent" in headers else None
        span = self.tracer.start_span(
            f"route {ENDPOINTS[route]}",
            parent,
            SpanKind.SERVER,
            {"gen_ai.operation.name": OPERATIONS[route], "http.request.method": "POST", "url.path": path},
        )
        return RequestTrace(self, span, ENDPOINTS[route])

    def batch_estimated(
        self, traces: Sequence[RequestTrace], start_ns: int, end_ns: int, batch_size: int, version: int | None
    ) -> None:
        """The estimate of one batch, a child of each traced request in it (see the module's docstring)."""
        batch, linked = next(self._batches), traces[: MAX_LISTED + 1]
        for traced in traces:
            others = [Link(t.span.get_span_context()) for t in linked if t is not traced][:MAX_LISTED]
            attributes = {P + "batch.id": batch, P + "batch.size": batch_size, P + "batch.estimated": len(traces)}
            if version is not None:
                attributes[P + "estimator.version"] = version
            span = self.tracer.start_span(
                "estimate batch",
                trace.set_span_in_context(traced.span),
                SpanKind.INTERNAL,
                attributes,
                others,
                start_time=start_ns,
            )
            span.end(end_ns)

    def close(self) -> None:
        """Export what is queued (each POST within its timeout) and stop the export thread."""
        self.provider.shutdown()


class RequestTrace:
    """One request's span, filled in as the request goes: what it asked, the decision, how it ended."""

    def __init__(self, tracing: Tracing, span: Span, endpoint: str):
        self.tracing, self.span, self.endpoint = tracing, span, endpoint

    def routed(self, cfg: Config, routed: RouteRequest, model: str, preset: str | None, stream: bool) -> None:
        """What the scheduler is asked: the model named, the policy, the preset or weights, the budget, the
        candidates."""
        names = [cfg.instances[i].name for i in routed.candidates]
        q, lat, c = routed.weights
        attributes = {
            "gen_ai.request.model": model,
            P + "input_tokens": routed.input_tokens,
            P + "policy": routed.policy,
            P + "weights.quality": q,
            P + "weights.latency": lat,
            P + "weights.cost": c,
            P + "candidates.count": len(names),
            P + "candidates": names[:MAX_LISTED],
            P + "stream": stream,
            P + "n": routed.n,
        }
        optional = {
            P + "preset": preset,
            "gen_ai.request.max_tokens": routed.max_tokens,
            P + "budget_usd": routed.budget_usd,
            P + "slo_s": routed.slo_s,
        }
        self.span.set_attributes(attributes | {k: v for k, v in optional.items() if v is not None})

    def decided(self, ticket: Ticket) -> None:
        """The decision: the chosen instance and its model, what was predicted for it, with which estimators,
        and the runners-up; or the policy's refusal."""
        d = ticket.decision
        if d is None:
            return
        if d.refused is not None:
            self.span.set_attribute(P + "refusal.reason", d.refused.reason)
            return
        instances = ticket.config.instances
        attributes = {P + "ranked": [instances[i].name for i in d.ranked[:MAX_LISTED]], P + "explored": ticket.explored}
        if d.ranked:
            chosen = instances[d.ranked[0]]
            attributes |= {P + "instance": chosen.name, P + "model": chosen.model}
        optional = {
            P + "predicted.quality": d.quality,
            P + "predicted.latency_s": d.latency_s,
            P + "predicted.cost_usd": d.cost_usd,
            P + "predicted.tokens": d.tokens,
            P + "predicted.cached_tokens": d.cached_tokens,
            P + "estimator.version": ticket.estimated_by,
        }
        self.span.set_attributes(attributes | {k: v for k, v in optional.items() if v is not None})

    def failed(self, error: ApiError) -> None:
        """An error answer: a refusal (4xx) with its status, OpenAI code and message, or a failure (5xx) of the
        gateway or of every instance tried, with its code."""
        if error.status >= 500:
            self.span.set_attributes(
                {"error.type": error.code or str(error.status), P + "error.message": error.message[:256]}
            )
            return
        attributes = {P + "refusal.status": error.status, P + "refusal.message": error.message[:256]}
        if error.code is not None:
            attributes[P + "refusal.code"] = error.code
        self.span.set_attributes(attributes)

    def attempt(self, instance: Instance, number: int, max_tokens: int | None) -> AttemptTrace:
        """A child span for one attempt on `instance`; its `headers` carry the trace on to the instance."""
        span = self.tracing.tracer.start_span(
            f"attempt {self.endpoint}",
            trace.set_span_in_context(self.span),
            SpanKind.CLIENT,
            {
                P + "instance": instance.name,
                "gen_ai.request.model": instance.model,
                "url.full": instance.url,
                P + "attempt": number,
            },
        )
        if max_tokens is not None:
            span.set_attribute("gen_ai.request.max_tokens", max_tokens)
        headers: dict[str, str] = {}
        _PROPAGATOR.inject(headers, trace.set_span_in_context(span))
        return AttemptTrace(span, headers)

    def end(self, status: int, instance: str, result: RelayResult | None) -> None:
        """The answer's status, the instance that served it, and its usage and cost as the relay counted them."""
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if result is not None and result.cost_usd is not None:
            span.set_attributes(
                {
                    "gen_ai.usage.input_tokens": result.prompt_tokens,
                    "gen_ai.usage.output_tokens": result.completion_tokens,
                    P + "cost_usd": result.cost_usd,
                    P + "cost_source": result.cost_source,
                    P + "served_by": instance,
                }
            )
            if result.cached_tokens is not None:
                span.set_attribute(P + "cached_tokens", result.cached_tokens)
            if result.budget_exhausted:
                span.set_attribute(P + "budget_exhausted", True)
        if status >= 500:  # a server span's error is the server's (a 4xx is the client's)
            span.set_status(Status(StatusCode.ERROR))
        span.end()


class AttemptTrace:
    """One attempt's span: the instance's answer, or how the attempt failed and whether the next was tried."""

    def __init__(self, span: Span, headers: dict[str, str]):
        self.span, self.headers = span, headers

    def answered(self, status: int) -> None:
        self.span.set_attribute("http.response.status_code", status)
        if status >= 400:
            self.span.set_status(Status(StatusCode.ERROR))

    def failed(self, e: UpstreamFailed) -> None:
        """Why the instance failed, and what followed: the next instance without a retry counted (it never
        read the request), a retry, or none (an answer that would fail as well anywhere)."""
        then = "next_instance" if e.unreachable else "retry" if e.retry else "no_retry"
        self.span.set_attributes(
            {"error.type": str(e.status), P + "attempt.failure": str(e)[:256], P + "attempt.then": then}
        )
        self.span.set_status(Status(StatusCode.ERROR, str(e)[:256]))

    def end(self, result: RelayResult | None = None, evicted: bool = False) -> None:
        """The attempt is over: evicted by its policy (it goes again later), or its stream broke off."""
        if evicted:
            self.span.set_attribute(P + "attempt.evicted", True)
        if result is not None and result.failed_status is not None:  # the stream broke after its first byte
            self.span.set_attributes({"error.type": str(result.failed_status), P + "attempt.broke_off": True})
            self.span.set_status(Status(StatusCode.ERROR))
        self.span.end()
