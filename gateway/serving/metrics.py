"""The gateway's own Prometheus metrics, in a registry of its own (no globals).

Under `serve --workers` (PROMETHEUS_MULTIPROC_DIR set by the supervisor before this process started)
every worker writes its values to files there and the page sums the host: counters and histograms add
up, and each gauge says how (`multiprocess_mode`): what the worker itself holds adds up ("livesum"), a
view every worker shares through Redis is the one set last ("livemostrecent"), and the version is the
oldest any worker still routes with ("livemin").
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128, 300, 600)
# 0.03 and 0.1: the design's residual targets (arrival to dispatch p50 under 30 ms, p99 under 100 ms).
DECISION_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.2, 0.5, 1, 2)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        # Read here, as prometheus_client read it at import: its values live in files there when it is set.
        self.multiprocess_dir = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter("routebalance_requests", "Requests answered, by route, instance and status",
                                ("route", "instance", "status"), registry=r)
        self.e2e = Histogram("routebalance_request_duration_seconds", "Client-side end-to-end latency",
                             ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("routebalance_time_to_first_token_seconds",
                              "Time to the first streamed byte of the answer",
                              ("route",), buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("routebalance_in_flight_requests", "Requests being served now", registry=r,
                               multiprocess_mode="livesum")
        self.retries = Counter("routebalance_upstream_retries", "Requests retried on another instance",
                               ("instance",), registry=r)
        self.cost = Counter("routebalance_cost_usd", "Realised cost of served requests, USD", ("model",), registry=r)
        self.tokens = Counter("routebalance_tokens", "Tokens served, by model and kind", ("model", "kind"), registry=r)
        self.key_spend = Counter("routebalance_key_spend_usd", "Spend booked per API key, USD (every attempt)",
                                 ("key",), registry=r)
        self.rejected = Counter("routebalance_rejected", "Requests refused before dispatch, by reason",
                                ("reason",), registry=r)
        self.budget_stops = Counter("routebalance_budget_exhausted", "Streams stopped because the budget ran out",
                                    registry=r)
        self.budget_clamps = Counter("routebalance_budget_clamped", "Requests whose max_tokens the budget cut",
                                     registry=r)
        # Decision telemetry: how batches form and what the scheduler predicted for its choices.
        self.batch_size = Histogram("routebalance_batch_size", "Requests per scheduling batch",
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.batch_wait = Histogram("routebalance_batch_wait_seconds", "Time a request waited for its batch to fire",
                                    buckets=DECISION_BUCKETS, registry=r)
        self.estimate_seconds = Histogram("routebalance_estimate_seconds", "Embedding + KNN time per batch",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.score_seconds = Histogram("routebalance_score_seconds", "Scoring + assignment time per batch",
                                       buckets=DECISION_BUCKETS, registry=r)
        self.decision_seconds = Histogram("routebalance_decision_seconds",
                                          "Per request: arrival to decision (batch wait + estimate + score)",
                                          buckets=DECISION_BUCKETS, registry=r)
        self.chosen = Counter("routebalance_routed", "Requests routed, by policy and chosen model",
                              ("policy", "model"), registry=r)
        self.predicted_quality = Histogram("routebalance_predicted_quality", "Predicted quality of the chosen model",
                                           buckets=tuple(i / 10 for i in range(1, 11)), registry=r)
        self.predicted_cost = Counter("routebalance_predicted_cost_usd", "Predicted cost of routed requests, USD",
                                      ("model",), registry=r)
        self.predicted_latency = Histogram("routebalance_predicted_latency_seconds",
                                           "Predicted end-to-end latency on the chosen instance",
                                           buckets=LATENCY_BUCKETS, registry=r)
        # SLO attainment: result is met, missed (served late, or failed) or refused (never served).
        self.slo = Counter("routebalance_slo_requests", "Requests with an end-to-end SLO, by policy, SLO class "
                           "and result", ("policy", "slo_class", "result"), registry=r)
        self.tpot_slo = Counter("routebalance_tpot_slo_requests", "Requests with a time-per-output-token bound, "
                                "by policy and result", ("policy", "result"), registry=r)
        self.evictions = Counter("routebalance_evictions", "Attempts the policy aborted to serve a tighter SLO first "
                                 "(the request went again later)", registry=r)
        # Set when the page is rendered (Gateway.metrics_page), from the pool state and the state backend.
        self.instance_routable = Gauge("routebalance_instance_routable", "1 while the instance takes requests, "
                                       "0 while it cools down after failures", ("instance",), registry=r,
                                       multiprocess_mode="livemostrecent")
        self.instance_in_flight = Gauge("routebalance_instance_in_flight", "Requests on the instance, this replica's "
                                        "and (with a shared state backend) the other replicas'", ("instance",),
                                        registry=r, multiprocess_mode="livemostrecent")
        self.state_up = Gauge("routebalance_state_backend_up", "1 while the shared state backend (Redis) answers; "
                              "always 1 for the in-process backends", registry=r,
                              multiprocess_mode="livemin")
        self.spend_unwritten = Gauge("routebalance_spend_unwritten", "Bookings and releases not yet written to "
                                     "the spend store (they are kept and retried)", registry=r,
                                     multiprocess_mode="livesum")
        # Estimator refreshes (gateway/serving/refresh.py): accepted, refused by their check, failed.
        self.refreshes = Counter("routebalance_estimator_refreshes", "Estimator refreshes, by result",
                                 ("result",), registry=r)
        self.explored = Counter("routebalance_explored_requests", "Requests whose routing explored a model without "
                                "labels (serving/explore.py), by the model chosen", ("model",), registry=r)
        self.shadow = Counter("routebalance_shadow_answers", "Judged shadow answers (serving/shadow.py), by outcome",
                              ("outcome",), registry=r)
        self.shadow_cost = Counter("routebalance_shadow_cost_usd", "What shadow answers cost, USD (the gateway's "
                                   "own spend, booked to no key)", registry=r)
        self.estimator_version = Gauge("routebalance_estimator_version", "Version of the estimators routing now "
                                       "(1: as built; each accepted refresh or rollback sets it)", registry=r,
                                       multiprocess_mode="livemin")
        # Progressive mode (gateway/serving/progressive.py): how each progressive request was served, and its points.
        self.progressive = Counter("routebalance_progressive_requests", "Requests asking for progressive mode, by "
                                   "result: progressive, or the reason they went through normal routing",
                                   ("result",), registry=r)
        self.progressive_points = Counter("routebalance_progressive_points", "Points of progressive answers, by "
                                          "result: expanded, or sketch_text (every expansion failed)",
                                          ("result",), registry=r)
        # Learning from traffic (gateway/serving/learner.py, feedback.py).
        self.feedback = Counter("routebalance_feedback", "Feedback calls, by outcome (accepted or refused) and "
                                "reason", ("outcome", "reason"), registry=r)
        self.length_labels = Counter("routebalance_length_labels", "Answer lengths offered to the label store, "
                                     "by result: stored, exists (already stored for the prompt and model), or "
                                     "dropped as full, queue_full or write_failed", ("result",), registry=r)
        self.embed_cache = Counter("routebalance_embed_cache", "Prompt embeddings taken from the embedder's cache "
                                   "(hit) or computed (miss)", ("result",), registry=r)
        self._embed_seen = (0, 0)
        self.config_reloads = Counter("routebalance_config_reloads", "Config reloads by result",
                                      ("result",), registry=r)
        # Prefix caches (core/prefix.py): what the gateway predicted against what the instance reported.
        self.cached_tokens = Counter("routebalance_prefix_cached_tokens", "Cached prompt tokens of answers whose "
                                     "instance reported them (usage.prompt_tokens_details), as predicted at routing "
                                     "and as reported", ("instance", "kind"), registry=r)
        self.prefix_hit_rate = Gauge("routebalance_prefix_hit_rate", "Share of prompt tokens the instance found in "
                                     "its prefix cache, from its own counters (vllm:prefix_cache_hits / queries)",
                                     ("instance",), registry=r, multiprocess_mode="livemostrecent")
        self.prefix_index_blocks = Gauge("routebalance_prefix_index_blocks", "Blocks in the gateway's prefix index "
                                         "of the instance, by source (sent: what this process sent it; reported: "
                                         "its KV-cache events); with workers, the largest worker's",
                                         ("instance", "source"), registry=r, multiprocess_mode="livemax")
        self.prefill_rate = Gauge("routebalance_prefill_seconds_per_token", "Seconds per computed prompt token the "
                                  "scheduler prices a miss at on the instance: its tier's prior, refined from the "
                                  "prefill times its tier-mates report (vllm:request_prefill_time_seconds)",
                                  ("instance",), registry=r, multiprocess_mode="livemostrecent")
        self.kv_events_up = Gauge("routebalance_kv_events_up", "1 while the instance's KV-cache event stream is "
                                  "read and healthy (the index follows it), 0 when the approximate index stands in",
                                  ("instance",), registry=r, multiprocess_mode="livemostrecent")
        self.kv_events_lag = Gauge("routebalance_kv_events_lag_seconds", "Seconds from an event batch's timestamp "
                                   "to its reading, last batch", ("instance",), registry=r,
                                   multiprocess_mode="livemostrecent")

    def answered(self, model: str, cost_usd: float, prompt_tokens: int, completion_tokens: int) -> None:
        """One upstream answer's realised cost and tokens."""
        self.cost.labels(model).inc(cost_usd)
        self.tokens.labels(model, "prompt").inc(prompt_tokens)
        self.tokens.labels(model, "completion").inc(completion_tokens)

    def cached(self, instance: str, predicted: float | None, reported: int | None) -> None:
        """An answer's cached prompt tokens, predicted and reported, where both are known."""
        if predicted is not None and reported is not None:
            self.cached_tokens.labels(instance, "predicted").inc(predicted)
            self.cached_tokens.labels(instance, "reported").inc(reported)

    def count_embed_cache(self, hits: int, misses: int) -> None:
        """The embedder's cache counters (cumulative, read after each batch) as routebalance_embed_cache_total
        {result}: what they gained since the last call is added (a new embedder starts again from 0)."""
        last_hits, last_misses = self._embed_seen
        self.embed_cache.labels("hit").inc(hits - last_hits if hits >= last_hits else hits)
        self.embed_cache.labels("miss").inc(misses - last_misses if misses >= last_misses else misses)
        self._embed_seen = (hits, misses)

    def render(self) -> bytes:
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        host = CollectorRegistry()
        MultiProcessCollector(host, self.multiprocess_dir)
        return generate_latest(host)
