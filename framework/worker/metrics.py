"""Prometheus metrics of the worker (default registry, served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

PROCESSED = Counter(
    "txbox_worker_processed_total", "Messages handled and marked processed", ["service", "message_type"]
)
FAILED = Counter(
    "txbox_worker_failed_total", "Handler runs that failed and will be retried", ["service", "message_type"]
)
ABANDONED = Counter(
    "txbox_worker_abandoned_total",
    "Messages given up into the dead letters",
    ["service", "message_type", "reason"],
)
CONFLICTS = Counter(
    "txbox_worker_conflicts_total", "Batches re-run after a serialization failure or deadlock", ["service"]
)
BACKLOG = Gauge("txbox_worker_inbox_backlog", "Inbox rows neither processed nor abandoned", ["service"])
OLDEST_DUE_AGE = Gauge(
    "txbox_worker_oldest_due_age_seconds", "How long the oldest due inbox row has been waiting", ["service"]
)
HANDLER_SECONDS = Histogram(
    "txbox_worker_handler_duration_seconds",
    "Time spent in one handler run",
    ["service", "message_type"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
