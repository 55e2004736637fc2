"""Prometheus metrics of every daemon, in one place and one naming scheme.

A series is named ``txbox_<daemon>_<what>_<unit>`` — the daemon as its command names it
(``publisher``, ``receiver``, ``worker``, ``collector``), what it counts or measures, and
the unit (``total`` for counters, ``seconds``, ``bytes``, ``rows``, ``messages``) — and
carries a ``service`` label, so the daemons of several services can share one
Prometheus without relabelling (docs/explanation/daemons.md, "Daemons: one shape"), and
a ``tenant`` label: the registry key of the tenant a series counts, empty for a service
without tenants (Prometheus stores an empty label as none) and for what belongs to no
tenant, so a series' count is bounded by the registry (docs/how-to/tenants.md, "Seen per
tenant"). The constructors below enforce all three; :func:`labels`
gives a daemon its two. Everything lives in prometheus_client's default
registry; ``--metrics-port`` serves it at ``/metrics`` beside the probes (framework/probes.py).
"""

from __future__ import annotations

import contextlib

from prometheus_client import Counter, Gauge, Histogram

_SERVICE, _TENANT = "service", "tenant"
_OWNER = (_SERVICE, _TENANT)  # the labels of every series


def labels(service: str, tenant: str | None = None) -> dict[str, str]:
    """The labels every series of a daemon of ``service`` (serving ``tenant``, if any) carries."""
    return {_SERVICE: service, _TENANT: tenant or ""}


def _counter(daemon: str, what: str, doc: str, *labels: str) -> Counter:
    return Counter(f"txbox_{daemon}_{what}_total", doc, [*_OWNER, *labels])


def _gauge(daemon: str, what: str, unit: str, doc: str) -> Gauge:
    gauge = Gauge(f"txbox_{daemon}_{what}_{unit}", doc, list(_OWNER))
    _GAUGES.setdefault(daemon, []).append(gauge)
    return gauge


_GAUGES: dict[str, list[Gauge]] = {}  # by daemon: what forget() drops


def forget(daemon: str, owner: dict[str, str]) -> None:
    """Drop the gauges of ``daemon`` (its name) labelled ``owner``: a tenant's daemon that
    ended, whose backlog or age would otherwise be served, and alerted on, for ever.
    Counters stay: they only rise, and a restart of the process drops them anyway."""
    for gauge in _GAUGES.get(daemon, []):
        with contextlib.suppress(KeyError):  # never set for this tenant
            gauge.remove(owner[_SERVICE], owner[_TENANT])


# ---- every daemon ------------------------------------------------------------------

#: Seconds since the daemon's loop last turned, read at scrape time (framework/liveness.py):
#: above TXBOX_STUCK_AFTER the daemon is stuck (docs/explanation/operations.md, "Probes, logs and liveness").
_SINCE_PROGRESS_DOC = "Seconds since the daemon's loop last made progress"
PUBLISHER_SINCE_PROGRESS = _gauge("publisher", "since_progress", "seconds", _SINCE_PROGRESS_DOC)
RECEIVER_SINCE_PROGRESS = _gauge("receiver", "since_progress", "seconds", _SINCE_PROGRESS_DOC)
WORKER_SINCE_PROGRESS = _gauge("worker", "since_progress", "seconds", _SINCE_PROGRESS_DOC)
COLLECTOR_SINCE_PROGRESS = _gauge("collector", "since_progress", "seconds", _SINCE_PROGRESS_DOC)
SINCE_PROGRESS = {
    "publisher": PUBLISHER_SINCE_PROGRESS,
    "receiver": RECEIVER_SINCE_PROGRESS,
    "worker": WORKER_SINCE_PROGRESS,
    "collector": COLLECTOR_SINCE_PROGRESS,
}

# ---- publisher (the outbox relay) ----------------------------------------------------

PUBLISHER_PUBLISHED = _counter(
    "publisher", "published", "Outbox rows confirmed by the broker and marked", "message_type"
)
PUBLISHER_FAILED = _counter(
    "publisher",
    "failed",
    "Failed publish attempts (nacked, unroutable command, timeout; expired: not published)",
    "message_type",
    "reason",
)
PUBLISHER_ABANDONED = _counter("publisher", "abandoned", "Outbox rows given up after max_attempts", "message_type")
# A cycle is one claim, which carries the marks (docs/explanation/daemons.md, "Wake-ups"): ``kind``
# is claim, mark (marks alone), write (a transaction of failures) or gauge.
PUBLISHER_STATEMENTS = _counter(
    "publisher", "statements", "Statements (and transactions) the relay sent to PostgreSQL, by kind", "kind"
)
PUBLISHER_CLAIMS = _counter("publisher", "claims", "Claims the relay ran, by whether they found rows", "found")
PUBLISHER_IN_FLIGHT = _gauge(
    "publisher", "in_flight", "messages", "Messages published and waiting for the broker's confirm"
)
PUBLISHER_BACKLOG = _gauge("publisher", "outbox_backlog", "rows", "Pending outbox rows (not processed, not abandoned)")
PUBLISHER_OLDEST_DUE_AGE = _gauge("publisher", "oldest_due_age", "seconds", "Age of the oldest due pending outbox row")

# Retention (docs/explanation/operations.md, "Retention"): what the publisher's pruner deleted and
# what the outbox costs, read from PostgreSQL once per pruning pass.
PUBLISHER_PRUNED = _counter(
    "publisher", "pruned", "Outbox rows deleted by retention, by the state they ended in", "state"
)
PUBLISHER_OUTBOX_TABLE = _gauge("publisher", "outbox_table", "bytes", "Size of the outbox table (heap and TOAST)")
PUBLISHER_OUTBOX_INDEXES = _gauge("publisher", "outbox_indexes", "bytes", "Size of the outbox's indexes")
PUBLISHER_OUTBOX_DEAD = _gauge(
    "publisher", "outbox_dead_tuples", "rows", "Dead row versions in the outbox not yet vacuumed"
)

# ---- receiver ------------------------------------------------------------------------

RECEIVER_RECEIVED = _counter("receiver", "received", "Deliveries taken from the inbox queue")
RECEIVER_REJECTED = _counter("receiver", "rejected", "Deliveries rejected into the dead letters", "reason")
RECEIVER_STORED = _counter("receiver", "stored", "Deliveries stored as new inbox rows")
RECEIVER_DUPLICATES = _counter("receiver", "duplicates", "Deliveries whose message id was already in the inbox")
RECEIVER_REDELIVERED = _counter("receiver", "redelivered", "Deliveries flagged redelivered by the broker")
RECEIVER_DELAYED = _counter(
    "receiver", "delayed", "Deliveries sent through the delay/retry chain (database unavailable)"
)
RECEIVER_GAVE_UP = _counter("receiver", "gave_up", "Final broker-level attempts rejected to the dead_letter queue")
RECEIVER_ID_CONFLICTS = _counter(
    "receiver",
    "id_conflicts",
    "Deliveries whose message id the inbox holds with other content (dead-lettered as id_conflict)",
)
RECEIVER_FILTERED = _counter(
    "receiver", "filtered", "Deliveries acked without storing: their handler's selector did not match", "message_type"
)
RECEIVER_PEAK_HELD = _gauge("receiver", "peak_held", "bytes", "Most body bytes held unacked at once since the start")
RECEIVER_COPIES_WAITING = _gauge(
    "receiver",
    "copies_waiting",
    "messages",
    "Retry and dead-letter copies not confirmed yet; their deliveries wait unacked",
)
RECEIVER_PUBLISHING_BLOCKED = _gauge(
    "receiver",
    "publishing_blocked",
    "seconds",
    "How long RabbitMQ has blocked the receiver's publishing connection (memory or disk alarm); 0 when not",
)

# ---- worker --------------------------------------------------------------------------

WORKER_PROCESSED = _counter("worker", "processed", "Messages handled and marked processed", "message_type")
WORKER_FAILED = _counter("worker", "failed", "Handler runs that failed and will be retried", "message_type")
WORKER_ABANDONED = _counter("worker", "abandoned", "Messages given up into the dead letters", "message_type", "reason")
WORKER_CONFLICTS = _counter("worker", "conflicts", "Batches re-run after a serialization failure or deadlock")
# One claim per wake-up at most, and one that finds nothing is a statement for nothing
# (docs/explanation/daemons.md, "Wake-ups"): ``found`` is ``rows`` or ``nothing``.
WORKER_CLAIMS = _counter("worker", "claims", "Claims the worker ran, by whether they found rows", "found")
WORKER_STATEMENTS = _counter(
    "worker", "statements", "Statements the worker sent to PostgreSQL: claims, batches and the handlers' own"
)
WORKER_BACKLOG = _gauge("worker", "inbox_backlog", "rows", "Inbox rows neither processed nor abandoned")
WORKER_OLDEST_DUE_AGE = _gauge(
    "worker", "oldest_due_age", "seconds", "How long the oldest due inbox row has been waiting"
)
WORKER_HANDLER_DURATION = Histogram(
    "txbox_worker_handler_duration_seconds",
    "Time spent in one handler run",
    [*_OWNER, "message_type"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)

# Retention: the worker's pruner, as the publisher's above.
WORKER_PRUNED = _counter("worker", "pruned", "Inbox rows deleted by retention, by the state they ended in", "state")
WORKER_INBOX_TABLE = _gauge("worker", "inbox_table", "bytes", "Size of the inbox table (heap and TOAST)")
WORKER_INBOX_INDEXES = _gauge("worker", "inbox_indexes", "bytes", "Size of the inbox's indexes")
WORKER_INBOX_DEAD = _gauge("worker", "inbox_dead_tuples", "rows", "Dead row versions in the inbox not yet vacuumed")

# ---- collector -----------------------------------------------------------------------

COLLECTOR_DEAD_LETTERS = _counter("collector", "dead_letters", "Dead letters drained from the broker")
COLLECTOR_DUPLICATES = _counter(
    "collector", "duplicates", "Redelivered dead letters already stored (not inserted again)"
)
