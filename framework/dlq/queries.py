"""Read side of the dead letters and the service's health numbers, as named SQL.

Every filter value is a bound parameter; only the schema (a validated identifier) is
composed into the text, with ``psycopg.sql.Identifier``. The list pages order by
``died_at DESC, id DESC`` so the ``dead_letters_died_at_idx`` / ``dead_letters_open_idx``
indexes answer them without sorting 100,000 rows.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row
from sqlalchemy.engine import Engine

from framework import names
from framework.db import database_errors

Status = Literal["open", "replayed", "resolved", "discarded", "all"]
STATUSES: tuple[Status, ...] = ("open", "replayed", "resolved", "discarded", "all")
SOURCES = ("broker", "inbox", "outbox")

# The status of a row, as SQL over its own columns (the partial indexes use the same text).
STATUS_SQL = {
    "open": "replayed_at IS NULL AND discarded_at IS NULL",
    "replayed": "replayed_at IS NOT NULL AND resolved_at IS NULL AND discarded_at IS NULL",
    "resolved": "resolved_at IS NOT NULL",
    "discarded": "discarded_at IS NOT NULL",
    "all": "TRUE",
}
STATUS_CASE = (
    "CASE WHEN discarded_at IS NOT NULL THEN 'discarded' WHEN resolved_at IS NOT NULL THEN 'resolved' "
    "WHEN replayed_at IS NOT NULL THEN 'replayed' ELSE 'open' END"
)


@contextmanager
def connection(engine: Engine) -> Iterator[psycopg.Connection[dict[str, Any]]]:
    """A pooled raw psycopg connection in autocommit mode with dict rows."""
    with database_errors("cannot reach the service's database"):
        raw = engine.raw_connection()
    conn: psycopg.Connection[Any] = raw.driver_connection  # type: ignore[assignment]
    try:
        # Reads need no transaction; writers (replay, discard) open their own.
        conn.autocommit = True
        conn.row_factory = dict_row
        yield conn
    finally:
        if not conn.closed:
            conn.row_factory = tuple_row
            conn.autocommit = False
        raw.close()  # back to the pool


@dataclass(frozen=True, kw_only=True)
class Filters:
    """What the list shows. Empty strings count as 'not given' (as HTML forms send them)."""

    status: Status = "open"
    source: str | None = None
    message_type: str | None = None
    reason: str | None = None
    fingerprint: str | None = None
    message_id: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            if getattr(self, f.name) == "":
                object.__setattr__(self, f.name, None)
        if self.status not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}, not {self.status!r}")

    def where(self) -> tuple[sql.Composable, dict[str, Any]]:
        parts: list[sql.Composable] = [sql.SQL(STATUS_SQL[self.status])]
        params: dict[str, Any] = {}
        for column in ("source", "message_type", "reason", "fingerprint"):
            value = getattr(self, column)
            if value is not None:
                parts.append(sql.SQL("{} = {}").format(sql.Identifier(column), sql.Placeholder(column)))
                params[column] = value
        if self.message_id is not None:
            # Compare as text: a malformed id simply matches nothing instead of failing the query.
            parts.append(sql.SQL("message_id::text = lower({})").format(sql.Placeholder("message_id")))
            params["message_id"] = self.message_id.strip()
        if self.since is not None:
            parts.append(sql.SQL("died_at >= {}").format(sql.Placeholder("since")))
            params["since"] = self.since
        if self.until is not None:
            parts.append(sql.SQL("died_at < {}").format(sql.Placeholder("until")))
            params["until"] = self.until
        return sql.SQL(" AND ").join(parts), params

    def as_query(self) -> dict[str, str]:
        """The filters as URL query parameters (given ones only)."""
        out: dict[str, str] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and not (f.name == "status" and value == "open"):
                out[f.name] = value.isoformat() if isinstance(value, datetime) else str(value)
        return out

    def with_(self, **changes: Any) -> Filters:
        return replace(self, **changes)


def parse_when(text: str) -> datetime:
    """`2h` (that long ago) or an ISO 8601 time (UTC when it has no zone); ValueError else."""
    from framework.settings import parse_duration

    try:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    except ValueError:
        pass
    try:
        value = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is neither a duration (2h, 30m) nor an ISO time") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _t(schema: str, table: str) -> sql.Identifier:
    return sql.Identifier(schema, table)


LIST_COLUMNS = (
    "id, message_id, source, reason, left(error, 240) AS error, fingerprint, message_type, routing_key, "
    f"died_at, replayed_at, replay_count, resolved_at, discarded_at, {STATUS_CASE} AS status"
)


def list_letters(
    conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 50, offset: int = 0
) -> list[dict[str, Any]]:
    where, params = filters.where()
    query = sql.SQL(
        "SELECT "
        + LIST_COLUMNS
        + " FROM {t} WHERE {where} ORDER BY died_at DESC, id DESC LIMIT {limit} OFFSET {offset}"
    ).format(
        t=_t(schema, names.DEAD_LETTERS), where=where, limit=sql.Placeholder("limit"), offset=sql.Placeholder("offset")
    )
    return list(conn.execute(query, {**params, "limit": limit, "offset": offset}).fetchall())


def count_letters(conn: psycopg.Connection[Any], schema: str, filters: Filters) -> int:
    where, params = filters.where()
    query = sql.SQL("SELECT count(*) AS n FROM {t} WHERE {where}").format(t=_t(schema, names.DEAD_LETTERS), where=where)
    row = conn.execute(query, params).fetchone()
    return int(row["n"]) if row else 0


def groups(conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 100) -> list[dict[str, Any]]:
    """Letters grouped by fingerprint, biggest first, each with its latest error as sample.

    A fingerprint includes the message type, so each group has one type (from the sample).
    """
    where, params = filters.where()
    query = sql.SQL(
        """WITH g AS (
               SELECT fingerprint, count(*) AS count, min(died_at) AS first_died_at, max(died_at) AS last_died_at
               FROM {t} WHERE {where} GROUP BY fingerprint ORDER BY count(*) DESC, max(died_at) DESC
               LIMIT {limit})
           SELECT g.*, s.message_type, s.reason, s.source, left(s.error, 300) AS error
           FROM g CROSS JOIN LATERAL (
               SELECT message_type, reason, source, error FROM {t} d
               WHERE d.fingerprint = g.fingerprint ORDER BY died_at DESC LIMIT 1) s
           ORDER BY g.count DESC, g.last_died_at DESC"""
    ).format(t=_t(schema, names.DEAD_LETTERS), where=where, limit=sql.Placeholder("limit"))
    return list(conn.execute(query, {**params, "limit": limit}).fetchall())


def get_letter(conn: psycopg.Connection[Any], schema: str, letter_id: int) -> dict[str, Any] | None:
    """One letter in full, plus the current state of its inbox/outbox row when there is one."""
    query = sql.SQL("SELECT *, " + STATUS_CASE + " AS status FROM {t} WHERE id = %(id)s").format(
        t=_t(schema, names.DEAD_LETTERS)
    )
    row = conn.execute(query, {"id": letter_id}).fetchone()
    if row is None:
        return None
    row = dict(row)
    row["current"] = None
    if row["message_id"] is not None:
        table = names.OUTBOX if row["source"] == "outbox" else names.INBOX
        state = sql.SQL(
            "SELECT {table_name} AS table, created_at, locked_until, started_attempts, finished_attempts, "
            "processed_at, abandoned_at, last_error FROM {t} WHERE id = %(id)s"
        ).format(table_name=sql.Literal(table), t=_t(schema, table))
        row["current"] = conn.execute(state, {"id": row["message_id"]}).fetchone()
    return row


def ids_matching(conn: psycopg.Connection[Any], schema: str, filters: Filters, *, limit: int = 100_000) -> list[int]:
    """Ids of the letters a filter selects (replay or discard of a whole group)."""
    where, params = filters.where()
    query = sql.SQL("SELECT id FROM {t} WHERE {where} ORDER BY died_at, id LIMIT {limit}").format(
        t=_t(schema, names.DEAD_LETTERS), where=where, limit=sql.Placeholder("limit")
    )
    return [r["id"] for r in conn.execute(query, {**params, "limit": limit}).fetchall()]


def distinct_values(conn: psycopg.Connection[Any], schema: str, column: str, *, limit: int = 200) -> list[str]:
    """Values of a low-cardinality column for the filter drop-downs. Scans the table (~100 ms
    at 100k letters): the dashboard caches the answer for a minute."""
    if column not in ("message_type", "reason", "source"):
        raise ValueError(column)
    query = sql.SQL("SELECT {c} AS v FROM {t} WHERE {c} IS NOT NULL GROUP BY {c} ORDER BY {c} LIMIT {limit}").format(
        c=sql.Identifier(column), t=_t(schema, names.DEAD_LETTERS), limit=sql.Literal(limit)
    )
    return [r["v"] for r in conn.execute(query).fetchall()]


def _table_health(conn: psycopg.Connection[Any], schema: str, table: str) -> dict[str, Any]:
    """Pending/in flight from the partial pending index, abandoned from its partial index,
    processed in the last 24 h from the created_at index (rows received in the last 25 h),
    and the table's total from the planner's estimate — no full scan of a big table."""
    t = _t(schema, table)
    row = conn.execute(
        sql.SQL(
            """SELECT
                 (SELECT count(*) FROM {t} WHERE processed_at IS NULL AND abandoned_at IS NULL) AS pending,
                 (SELECT count(*) FROM {t} WHERE processed_at IS NULL AND abandoned_at IS NULL
                     AND started_attempts > finished_attempts AND locked_until > clock_timestamp()) AS in_flight,
                 (SELECT count(*) FROM {t} WHERE abandoned_at IS NOT NULL) AS abandoned,
                 (SELECT count(*) FROM {t} WHERE created_at >= now() - interval '25 hours'
                     AND processed_at >= now() - interval '24 hours') AS processed_24h,
                 (SELECT extract(epoch FROM clock_timestamp() - min(created_at)) FROM {t}
                     WHERE processed_at IS NULL AND abandoned_at IS NULL) AS oldest_pending_seconds,
                 (SELECT greatest(reltuples, 0)::bigint FROM pg_class
                     WHERE oid = {regclass}::regclass) AS rows_estimate"""
        ).format(t=t, regclass=sql.Literal(f"{schema}.{table}")),
    ).fetchone()
    return dict(row) if row else {}


def overview(conn: psycopg.Connection[Any], schema: str) -> dict[str, Any]:
    """The numbers of one service's overview card."""
    dl = _t(schema, names.DEAD_LETTERS)
    letters = conn.execute(
        sql.SQL(
            """SELECT count(*) AS open, count(DISTINCT fingerprint) AS open_groups, min(died_at) AS oldest_open_at,
                      (SELECT count(*) FROM {t} WHERE died_at >= now() - interval '24 hours') AS died_24h
               FROM {t} WHERE replayed_at IS NULL AND discarded_at IS NULL"""
        ).format(t=dl)
    ).fetchone()
    return {
        "inbox": _table_health(conn, schema, names.INBOX),
        "outbox": _table_health(conn, schema, names.OUTBOX),
        "dead_letters": dict(letters) if letters else {},
    }


WINDOWS: dict[str, tuple[timedelta, timedelta]] = {
    # window → (span, bucket)
    "1h": (timedelta(hours=1), timedelta(minutes=1)),
    "6h": (timedelta(hours=6), timedelta(minutes=10)),
    "24h": (timedelta(hours=24), timedelta(hours=1)),
    "7d": (timedelta(days=7), timedelta(hours=6)),
}


def timeline(conn: psycopg.Connection[Any], schema: str, window: str = "1h") -> dict[str, Any]:
    """Per bucket: messages received and processed by the inbox, published by the outbox and
    dead letters, over ``window``. Buckets without events are present with zeros."""
    span, bucket = WINDOWS[window]
    now = datetime.now(UTC)
    # Align to the bucket so consecutive page loads show the same bars.
    step = bucket.total_seconds()
    end = datetime.fromtimestamp((now.timestamp() // step + 1) * step, UTC)
    start = end - span
    params = {"start": start, "end": end, "bucket": bucket, "lookback": start - timedelta(hours=1)}
    series: dict[str, dict[datetime, int]] = {}

    def bins(name: str, query: sql.Composed) -> None:
        series[name] = {r["b"]: int(r["n"]) for r in conn.execute(query, params).fetchall()}

    binned = "date_bin(%(bucket)s, {col}, %(start)s)"
    for name, table, col, guard in (
        ("received", names.INBOX, "created_at", "created_at >= %(start)s"),
        ("processed", names.INBOX, "processed_at", "created_at >= %(lookback)s AND processed_at >= %(start)s"),
        ("published", names.OUTBOX, "processed_at", "created_at >= %(lookback)s AND processed_at >= %(start)s"),
        ("dead", names.DEAD_LETTERS, "died_at", "died_at >= %(start)s"),
    ):
        bins(
            name,
            sql.SQL(
                "SELECT " + binned.format(col=col) + " AS b, count(*) AS n FROM {t} WHERE " + guard + " GROUP BY 1"
            ).format(t=_t(schema, table)),
        )
    buckets = []
    at = start
    while at < end:
        buckets.append(at)
        at += bucket
    return {
        "window": window,
        "bucket_seconds": int(step),
        "buckets": [b.isoformat() for b in buckets],
        "series": {name: [values.get(b, 0) for b in buckets] for name, values in series.items()},
    }


LATENCY_ROWS = 10_000  # a run writes one row per publisher, message type and stage: never near this


def analytics(
    conn: psycopg.Connection[Any], schema: str, service: str, *, covering: bool = False
) -> dict[str, Any] | None:
    """The latest ``txbox analyze`` run's reconciliation and latency rows (per publisher,
    message type and stage), when its report tables are in this database (migration 0005
    and a finished run); None otherwise. ``covering``: only a run whose sources include
    ``service`` (a report database shared by services)."""
    found = conn.execute("SELECT to_regclass(%(t)s) IS NOT NULL AS ok", {"t": f"{schema}.analytics_runs"}).fetchone()
    if not found or not found["ok"]:
        return None
    run = conn.execute(
        sql.SQL(
            "SELECT run_id, run_at, finished_at, lost, stuck, in_flight, abandoned, unexpected, redelivered "
            "FROM {t} WHERE NOT %(covering)s OR %(service)s = ANY(string_to_array(sources, ',')) "
            "ORDER BY run_at DESC LIMIT 1"
        ).format(t=_t(schema, "analytics_runs")),
        {"covering": covering, "service": service},
    ).fetchone()
    if run is None:
        return None
    latency = conn.execute(
        sql.SQL(
            """SELECT stage, message_type, samples, p50_ms, p90_ms, p99_ms, max_ms, mean_ms FROM {t}
               WHERE run_id = %(run)s AND (service = %(service)s OR service IS NULL)
               ORDER BY stage, message_type LIMIT %(most)s"""
        ).format(t=_t(schema, "analytics_latency")),
        {"run": run["run_id"], "service": service, "most": LATENCY_ROWS},
    ).fetchall()
    return {"run": dict(run), "latency": [dict(r) for r in latency]}
