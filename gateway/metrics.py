"""The gateway's own Prometheus metrics (requests, latency, time to first token), served after the
daemon's counters on GET /metrics."""

from __future__ import annotations

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

# Latency buckets from a cached short answer to a long generation on a slow machine.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class GatewayMetrics:
    def __init__(self) -> None:
        disable_created_metrics()  # `_created` series double the text and no dashboard reads them
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "moed_gateway_requests",
            "HTTP requests answered by the gateway",
            ["api", "endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "moed_gateway_request_duration_seconds",
            "Time from request to the end of the response",
            ["api", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "moed_gateway_time_to_first_token_seconds",
            "Time from request to the first generated text sent",
            ["api", "endpoint"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tokens = Counter(
            "moed_gateway_completion_tokens",
            "Completion tokens streamed or returned by the gateway",
            ["api"],
            registry=self.registry,
        )
        self.cancelled = Counter(
            "moed_gateway_cancelled_generations",
            "Generations cancelled because the HTTP client went away",
            ["api"],
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()
