"""The gateway's own Prometheus metrics, in a registry of its own (no globals)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300, 600)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("routebalance_requests", "Requests answered, by route, instance and status",
                                ("route", "instance", "status"), registry=r)
        self.e2e = Histogram("routebalance_request_duration_seconds", "Client-side end-to-end latency",
                             ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("routebalance_time_to_first_token_seconds", "Time to the first streamed byte of the answer",
                              ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("routebalance_in_flight_requests", "Requests being served now", registry=r)
        self.retries = Counter("routebalance_upstream_retries", "Requests retried on another instance",
                               ("instance",), registry=r)
        self.cost = Counter("routebalance_cost_usd", "Realised cost of served requests, USD", ("model",), registry=r)
        self.tokens = Counter("routebalance_tokens", "Tokens served, by model and kind", ("model", "kind"), registry=r)
        self.config_reloads = Counter("routebalance_config_reloads", "Config reloads by result", ("result",), registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
