"""Statements over the columns the outbox and the inbox share, for either table.

The dead-letter replay (framework/dead_letters/replay.py) puts a message back where it was
abandoned, the inbox or the outbox, with the same statements; what differs between the
two tables is decided here, next to the SQL. The dashboard's numbers of both tables
(their health, and the timeline that also counts dead letters) follow.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from framework import names
from framework.tables import pending_by_id


def current(schema: str, table: str, same: sql.Composable) -> sql.Composed:
    """Params: id (and ``same``'s). The message's row, locked: its attempts, outcome and
    ``archived_at`` (inbox tombstones; NULL in the outbox), and ``same`` as a column."""
    archived = "r.archived_at" if table == names.INBOX else "NULL::timestamptz"
    return sql.SQL(
        "SELECT message_type, routing_key, started_attempts, finished_attempts, last_error, processed_at, "
        "abandoned_at, "
        "{archived} AS archived_at, {same} AS same FROM {t} r WHERE id = %(id)s FOR UPDATE"
    ).format(archived=sql.SQL(archived), same=same, t=sql.Identifier(schema, table))


def reset(schema: str, table: str) -> sql.Composed:
    """Params: id, auth_token. An abandoned row due again at once, with a fresh set of attempts and no
    expiry: replaying is someone's decision to run it now (docs/explanation/receive.md, "Expiry and filters").
    Its auth_token is the one given (the operator's, or NULL: none), never one it kept."""
    return sql.SQL(
        """UPDATE {t} SET processed_at = NULL, abandoned_at = NULL, last_error = NULL,
               started_attempts = 0, finished_attempts = 0, locked_until = clock_timestamp(),
               metadata = (metadata - 'expires_at' - 'auth_token')
                   || jsonb_strip_nulls(jsonb_build_object('auth_token', %(auth_token)s::text))
           WHERE id = %(id)s"""
    ).format(t=sql.Identifier(schema, table))


def take_back(schema: str, table: str) -> sql.Composed:
    """Params: id, why. Abandon again a row a replay made due, if it has not started:
    returns its id. An inbox row not locked by a worker can be taken back even while
    claimed (the worker's fence, pending and the same ``started_attempts``, then leaves it
    alone); an outbox row only while no
    publisher claimed it, since a publish cannot be recalled."""
    where = pending_by_id()
    if table == names.OUTBOX:
        where += " AND started_attempts <= finished_attempts"
    return sql.SQL(
        """UPDATE {t} SET abandoned_at = clock_timestamp(), locked_until = clock_timestamp(), last_error = %(why)s
           WHERE id = (SELECT id FROM {t} WHERE id = %(id)s AND {where} FOR UPDATE SKIP LOCKED)
           RETURNING id"""
    ).format(t=sql.Identifier(schema, table), where=sql.SQL(where))


# --- the dashboard's numbers (framework/dead_letters/queries.py) -------------------------------


def health(conn: psycopg.Connection[Any], schema: str, table: str) -> dict[str, Any]:
    """Pending/in flight from the partial pending index, abandoned from its partial index,
    processed in the last 24 h from the created_at index (rows received in the last 25 h),
    and the table's total from the planner's estimate — no full scan of a big table."""
    t = sql.Identifier(schema, table)
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


# The dashboard's timeline: per series, its table, the time column binned and the guard
# that lets an index on created_at (or died_at) bound the scan.
TIMELINE_SERIES = (
    ("received", names.INBOX, "created_at", "created_at >= %(start)s"),
    ("processed", names.INBOX, "processed_at", "created_at >= %(lookback)s AND processed_at >= %(start)s"),
    ("published", names.OUTBOX, "processed_at", "created_at >= %(lookback)s AND processed_at >= %(start)s"),
    ("dead", names.DEAD_LETTERS, "died_at", "died_at >= %(start)s"),
)


def timeline_bins(conn: psycopg.Connection[Any], schema: str, params: dict[str, Any]) -> dict[str, dict[datetime, int]]:
    """Params: start, bucket, lookback. Per series, the count of each non-empty bucket."""
    series: dict[str, dict[datetime, int]] = {}
    for name, table, col, guard in TIMELINE_SERIES:
        query = sql.SQL(
            "SELECT date_bin(%(bucket)s, "
            + col
            + ", %(start)s) AS b, count(*) AS n FROM {t} WHERE "
            + guard
            + " GROUP BY 1"
        ).format(t=sql.Identifier(schema, table))
        series[name] = {r["b"]: int(r["n"]) for r in conn.execute(query, params).fetchall()}
    return series
