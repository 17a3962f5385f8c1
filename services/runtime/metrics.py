"""Prometheus metrics every silod process exports, in the default registry.

The metric objects are module-level because Prometheus forbids registering a name twice;
several servers in one process (tests, the demo) share them and are told apart by the
``service_process`` label.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from prometheus_client import Counter, Gauge, Histogram, start_http_server

REQUESTS = Counter(
    "silod_grpc_requests_total",
    "gRPC calls handled, by final status code",
    ["service_process", "method", "code"],
)
DURATION = Histogram(
    "silod_grpc_request_duration_seconds",
    "Wall time from the call reaching the servicer to its status",
    ["service_process", "method"],
    # From millisecond metadata lookups to multi-second scheduling rounds. Long-lived watches
    # land in +Inf; query by method to keep them out of latency percentiles.
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
IN_FLIGHT = Gauge("silod_grpc_in_flight", "gRPC calls being handled now", ["service_process"])
BUILD_INFO = Gauge("silod_build_info", "Always 1; the label says which silod version runs", ["version"])


def silod_version() -> str:
    try:
        return metadata.version("silod")
    except metadata.PackageNotFoundError:  # running from a tree that was never installed
        return "unknown"


BUILD_INFO.labels(version=silod_version()).set(1)


def start_metrics_server(host: str, port: int) -> Any:
    """Serve ``/metrics`` over HTTP from a background thread; returns the server (``.shutdown()``,
    ``.server_port``). Raises OSError if the port cannot be bound."""
    server, _thread = start_http_server(port, addr=host)
    return server
