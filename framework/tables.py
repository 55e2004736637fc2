"""SQLAlchemy metadata of the framework's tables.

The tables are declared in schema ``txbox``; a service that configures another schema
gets it through ``schema_translate_map`` (see :func:`translate_map`), so only the
framework's tables move, never the service's own. A test diffs this metadata against
the database the migrations build.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Double,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    func,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

from framework import names

SCHEMA = "txbox"
# "Pending", spelled three ways on purpose. PostgreSQL uses a partial index only for a
# query whose WHERE implies the index's predicate, and it proves that by the text of the
# expressions, not by their meaning. So each spelling reaches exactly one kind of index:
# the claims (priority order) reach *_due_idx, the head-of-segment probes reach
# *_segment_idx and nothing else, and lookups by id reach neither partial index. Under
# statistics taken before a burst the planner thinks the partial indexes are empty and
# cheap, and picked the wrong one of them: seconds per claim (migration 0006).
# PENDING is the claims' spelling, and the one for everything else.
PENDING = text("processed_at IS NULL AND abandoned_at IS NULL")


def pending_in_segment(alias: str = "") -> str:
    """The predicate of *_segment_idx, the only spelling of "pending" that reaches it."""
    at = f"{alias}." if alias else ""
    return f"coalesce({at}processed_at, {at}abandoned_at) IS NULL"


def pending_by_id(alias: str = "") -> str:
    """The spelling of "pending" for lookups by id or ctid: it matches no partial index's predicate."""
    at = f"{alias}." if alias else ""
    return f"coalesce({at}abandoned_at, {at}processed_at) IS NULL"


metadata = MetaData(schema=SCHEMA)


def _message_columns() -> list[Any]:
    """The columns the outbox and the inbox share (as in pg-transactional-outbox)."""
    return [
        Column("id", UUID(as_uuid=True), primary_key=True),
        Column("message_type", Text, nullable=False),
        Column("aggregate_type", Text, nullable=False),
        Column("aggregate_id", Text, nullable=False),
        Column("message_version", Text, nullable=False, server_default="1.0"),
        Column("kind", Text, nullable=False),
        Column("routing_key", Text, nullable=False),
        Column("payload", JSONB, nullable=False),
        Column("message_context", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("metadata", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
        Column("segment", Text, nullable=False),
        Column("concurrency", Text, nullable=False, server_default="sequential"),
        Column("priority", SmallInteger, nullable=False, server_default="0"),
        Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
        Column("locked_until", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
        Column("started_attempts", SmallInteger, nullable=False, server_default="0"),
        Column("finished_attempts", SmallInteger, nullable=False, server_default="0"),
        Column("processed_at", DateTime(timezone=True)),
        Column("abandoned_at", DateTime(timezone=True)),
        Column("last_error", Text),
    ]


def _constraints(table: str) -> list[Any]:
    return [
        CheckConstraint("kind IN ('command', 'event')", name=f"{table}_kind_check"),
        CheckConstraint("concurrency IN ('sequential', 'parallel')", name=f"{table}_concurrency_check"),
    ]


outbox = Table(
    names.OUTBOX,
    metadata,
    *_message_columns(),
    *_constraints(names.OUTBOX),
    comment="Transactional outbox: messages written with business data, relayed by the publisher.",
)

inbox = Table(
    names.INBOX,
    metadata,
    *_message_columns(),
    Column("message_timestamp", DateTime(timezone=True), nullable=False),
    Column("received_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("queue", Text, nullable=False),
    Column("redelivered", Boolean, nullable=False, server_default=text("false")),
    # Set when `txbox archive` stripped the row to a tombstone kept for dedup (migration 0007).
    Column("archived_at", DateTime(timezone=True)),
    *_constraints(names.INBOX),
    comment="Transactional inbox: deliveries stored once by message id, processed by the worker.",
)

redeliveries = Table(
    names.REDELIVERIES,
    metadata,
    Column("queue", Text, primary_key=True),
    Column("message_id", Text, primary_key=True),
    Column("count", Integer, nullable=False, server_default="1"),
    Column("first_seen", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("last_seen", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    # The table comment as migration 0001 wrote it (frozen history: the drift test compares it).
    comment="Redelivery counter of seed 003: survives a receiver that crashes on a delivery.",
)

dead_letters = Table(
    names.DEAD_LETTERS,
    metadata,
    Column("id", BigInteger, primary_key=True, autoincrement=True),
    Column("message_id", UUID(as_uuid=True)),
    Column("source", Text, nullable=False),
    Column("reason", Text, nullable=False),
    Column("error", Text),
    Column("fingerprint", Text, nullable=False),
    Column("message_type", Text),
    Column("routing_key", Text),
    Column("message", JSONB),
    Column("raw_body", Text),
    Column("raw_encoding", Text),
    Column("headers", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("attempts", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("died_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("replayed_at", DateTime(timezone=True)),
    Column("replay_count", Integer, nullable=False, server_default="0"),
    Column("resolved_at", DateTime(timezone=True)),
    Column("discarded_at", DateTime(timezone=True)),
    # Collector's dedupe key of a broker delivery (migration 0004); null for other writers.
    Column("delivery_key", Text),
    CheckConstraint("source IN ('broker', 'inbox', 'outbox')", name="dead_letters_source_check"),
    CheckConstraint("raw_encoding IN ('utf-8', 'base64')", name="dead_letters_raw_encoding_check"),
    comment="Every message that gave up anywhere, one row each, written where it was abandoned.",
)

# Migration 0008: one row per running daemon process (framework/sql/heartbeats.py).
daemon_heartbeats = Table(
    names.DAEMON_HEARTBEATS,
    metadata,
    Column("service", Text, primary_key=True),
    Column("kind", Text, primary_key=True),
    Column("host", Text, primary_key=True),
    Column("pid", Integer, primary_key=True),
    Column("started_at", DateTime(timezone=True), nullable=False),
    Column("last_progress", DateTime(timezone=True), nullable=False),
    Column("beat_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("beat_interval", Double, nullable=False),
    Column("stuck_after", Double, nullable=False),
    Column("ready", Boolean, nullable=False),
    # Migration 0010: what a ready daemon waits for instead of working (a receiver's turn).
    Column("waiting_since", DateTime(timezone=True)),
    Column("waiting_queue", Text),
    Column("waiting_detail", Text),
    CheckConstraint("char_length(waiting_queue) <= 255", name="daemon_heartbeats_waiting_queue_check"),
    CheckConstraint("char_length(waiting_detail) <= 500", name="daemon_heartbeats_waiting_detail_check"),
    comment="Liveness of the daemons: upserted every few seconds by each running daemon.",
)

# Migration 0009: the manifest of each `txbox archive` batch (framework/analytics/archive.py).
archive_batches = Table(
    names.ARCHIVE_BATCHES,
    metadata,
    Column("batch_id", Text, primary_key=True),
    Column("service", Text, nullable=False),
    Column("table_name", Text, nullable=False),
    Column("ids", ARRAY(UUID(as_uuid=True)), nullable=False),
    Column("location", Text, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'pending'")),
    Column("rows", Integer),
    Column("deleted", Integer),
    Column("created_at", DateTime(timezone=True), nullable=False, server_default=text("clock_timestamp()")),
    Column("finished_at", DateTime(timezone=True)),
    CheckConstraint("state IN ('pending', 'done')", name="archive_batches_state_check"),
    CheckConstraint("table_name IN ('outbox', 'inbox')", name="archive_batches_table_name_check"),
    comment="One row per txbox archive batch: the ids it covers, written before its Parquet; done once deleted.",
)
Index("archive_batches_pending_idx", archive_batches.c.created_at, postgresql_where=text("state = 'pending'"))

# Hot queries only ever look at pending rows: keep their indexes partial and small.
for _t in (outbox, inbox):
    Index(f"{_t.name}_due_idx", _t.c.priority.desc(), _t.c.created_at, postgresql_where=PENDING)
    Index(f"{_t.name}_segment_idx", _t.c.segment, _t.c.created_at, postgresql_where=text(pending_in_segment()))
    Index(f"{_t.name}_created_at_idx", _t.c.created_at)
# Migration 0003 (worker): rows in flight or left by a dead worker, looked up every cycle.
Index(
    "inbox_suspect_idx",
    inbox.c.locked_until,
    postgresql_where=text("processed_at IS NULL AND abandoned_at IS NULL AND started_attempts > finished_attempts"),
)
Index("dead_letters_message_id_idx", dead_letters.c.message_id)
Index("dead_letters_fingerprint_idx", dead_letters.c.fingerprint, dead_letters.c.died_at.desc())
Index("dead_letters_died_at_idx", dead_letters.c.died_at.desc())
Index(
    "dead_letters_open_idx",
    dead_letters.c.died_at.desc(),
    postgresql_where=text("replayed_at IS NULL AND discarded_at IS NULL"),
)
# Migration 0004 (dead-letter tooling).
Index(
    "dead_letters_delivery_key_idx",
    dead_letters.c.delivery_key,
    unique=True,
    postgresql_where=text("delivery_key IS NOT NULL"),
)
Index(
    "dead_letters_unresolved_idx",
    dead_letters.c.message_id,
    postgresql_where=text("replayed_at IS NOT NULL AND resolved_at IS NULL AND discarded_at IS NULL"),
)
Index(
    "dead_letters_open_fingerprint_idx",
    dead_letters.c.fingerprint,
    dead_letters.c.died_at,
    postgresql_where=text("replayed_at IS NULL AND discarded_at IS NULL"),
)
# Migration 0007: tombstones by the time their dedup window starts (framework/dedup.py).
Index(
    "inbox_tombstone_idx",
    func.coalesce(inbox.c.processed_at, inbox.c.abandoned_at),
    postgresql_where=text("archived_at IS NOT NULL"),
)
for _t in (inbox, outbox):
    Index(f"{_t.name}_abandoned_idx", _t.c.abandoned_at, postgresql_where=text("abandoned_at IS NOT NULL"))


def translate_map(schema: str) -> dict[str, str] | None:
    """Execution option that moves the framework's tables to ``schema``; None if default."""
    return None if schema == SCHEMA else {SCHEMA: schema}


# --- Report tables of the Spark job (`txbox analyze`, migration 0005) ----------------
# Columns are documented in framework/analytics/__init__.py (the dashboard reads them).
# Every row carries the run that wrote it; a run is complete once its analytics_runs row
# exists (written last), so readers join on that and never see half a run.


def _run_columns() -> list[Any]:
    return [
        Column("run_id", Text, nullable=False),
        Column("run_at", DateTime(timezone=True), nullable=False),
    ]


ANALYTICS_COLUMNS: dict[str, list[tuple[str, Any]]] = {
    "analytics_findings": [
        ("kind", Text),
        ("service", Text),
        ("publisher", Text),
        ("message_type", Text),
        ("message_id", Text),
        ("state", Text),
        ("reason", Text),
        ("fingerprint", Text),
        ("since", DateTime(timezone=True)),
        ("age_seconds", Double),
        ("count", Integer),
        ("detail", Text),
        ("tenant", Text),  # migration 0012: added last, as ADD COLUMN puts it
    ],
    "analytics_latency": [
        ("service", Text),
        ("publisher", Text),
        ("message_type", Text),
        ("stage", Text),
        ("samples", BigInteger),
        ("p50_ms", Double),
        ("p90_ms", Double),
        ("p99_ms", Double),
        ("max_ms", Double),
        ("mean_ms", Double),
    ],
    "analytics_throughput": [
        ("service", Text),
        ("message_type", Text),
        ("event", Text),
        ("minute", DateTime(timezone=True)),
        ("messages", BigInteger),
    ],
    "analytics_attempts": [
        ("service", Text),
        ("side", Text),
        ("message_type", Text),
        ("attempts", Integer),
        ("messages", BigInteger),
    ],
    "analytics_message_types": [
        ("service", Text),
        ("side", Text),
        ("message_type", Text),
        ("total", BigInteger),
        ("processed", BigInteger),
        ("abandoned", BigInteger),
        ("pending", BigInteger),
        ("attempts", BigInteger),
        ("failed_attempts", BigInteger),
        ("failure_rate", Double),
        ("abandon_rate", Double),
    ],
    "analytics_fingerprints": [
        ("service", Text),
        ("source", Text),
        ("reason", Text),
        ("fingerprint", Text),
        ("message_type", Text),
        ("dead_letters", BigInteger),
        ("open", BigInteger),
        ("first_died_at", DateTime(timezone=True)),
        ("last_died_at", DateTime(timezone=True)),
        ("sample_error", Text),
        ("message_ids", Text),
    ],
    "analytics_dead_letter_trend": [
        ("service", Text),
        ("reason", Text),
        ("hour", DateTime(timezone=True)),
        ("dead_letters", BigInteger),
    ],
}

analytics_runs = Table(
    "analytics_runs",
    metadata,
    Column("run_id", Text, primary_key=True),
    Column("run_at", DateTime(timezone=True), nullable=False),
    Column("finished_at", DateTime(timezone=True), nullable=False),
    Column("sources", Text, nullable=False),
    Column("window_start", DateTime(timezone=True)),
    Column("grace_seconds", Double, nullable=False),
    Column("sla_seconds", Double, nullable=False),
    Column("outbox_rows", BigInteger, nullable=False),
    Column("inbox_rows", BigInteger, nullable=False),
    Column("lost", Integer, nullable=False),
    Column("in_flight", Integer, nullable=False),
    Column("stuck", Integer, nullable=False),
    Column("abandoned", Integer, nullable=False),
    Column("unexpected", Integer, nullable=False),
    Column("redelivered", Integer, nullable=False),
    Column("notes", Text),
    comment="One row per completed `txbox analyze` run; written last.",
)

analytics_tables = {"analytics_runs": analytics_runs}
for _name, _cols in ANALYTICS_COLUMNS.items():
    analytics_tables[_name] = Table(
        _name,
        metadata,
        *_run_columns(),
        *(Column(c, t) for c, t in _cols),
        comment="Written by `txbox analyze`; see framework/analytics.",
    )
    Index(f"{_name}_run_idx", analytics_tables[_name].c.run_id)
