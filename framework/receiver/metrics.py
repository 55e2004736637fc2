"""Prometheus metrics of the receiver (default registry, served by ``--metrics-port``)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge

RECEIVED = Counter("txbox_receiver_received_total", "Deliveries taken from the inbox queue", ["service"])
REJECTED = Counter("txbox_receiver_rejected_total", "Deliveries rejected into the dead letters", ["service", "reason"])
STORED = Counter("txbox_receiver_stored_total", "Deliveries stored as new inbox rows", ["service"])
DUPLICATES = Counter(
    "txbox_receiver_duplicates_total", "Deliveries whose message id was already in the inbox", ["service"]
)
REDELIVERED = Counter("txbox_receiver_redelivered_total", "Deliveries flagged redelivered by the broker", ["service"])
DELAYED = Counter(
    "txbox_receiver_delayed_total", "Deliveries sent through the delay/retry chain (database unavailable)", ["service"]
)
GAVE_UP = Counter(
    "txbox_receiver_gave_up_total", "Final broker-level attempts rejected to the dead_letter queue", ["service"]
)
ID_CONFLICTS = Counter(
    "txbox_receiver_id_conflicts_total",
    "Deliveries whose message id the inbox holds with other content (dead-lettered as id_conflict)",
    ["service"],
)
PEAK_HELD_BYTES = Gauge(
    "txbox_receiver_peak_held_bytes", "Most body bytes held unacked at once since the start", ["service"]
)
