"""`--history N` of `txbox bench relay|worker|e2e`: the same measurement over a table that has a past.

A service that has run for a while has an outbox and an inbox full of finished rows
(until retention takes them: docs/architecture.md, "Retention"). The benches measure on
empty tables first, then pre-fill ``N`` historical rows with one ``INSERT ... SELECT
generate_series`` per million (a realistic mix: mostly processed, some abandoned with
their dead letters, in the inbox some tombstones), VACUUM ANALYZE and CHECKPOINT (history
is old: vacuumed, and flushed long ago), and measure again in the same run;
``history.ratio`` is the second rate over the first (the bar: ≥ 0.9 at N = 5,000,000).

Their ids are UUIDv7 of their creation time, as txbox makes them (framework/ids.py), and
they are shaped like the rows the bench itself writes: an aggregate id as short, the
bench's payload with its own ``n``, and in the inbox the delivery record the receiver
keeps. Rows of another size would not be history of this service, and they would change
what is measured: PostgreSQL puts a new row (or a row's new version) on any page whose
free space the free-space map says fits it, so history rows a little longer than the new
ones leave on each old page a leftover that fits a new row, and every insert then reads
and dirties an old page out of cache (docs/architecture.md, "The tables").
The rows were created over ``SPAN`` up to an hour ago, inside each table's default
retention, so the daemons' pruners have nothing to delete during the measurement: what
is measured is the cost of a big table, not of pruning it.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, NamedTuple

import psycopg
from psycopg import sql

from framework import names
from framework.contracts import MessageSpec
from framework.db import conninfo

CHUNK = 1_000_000  # rows per INSERT: a bounded transaction (and WAL) each
ABANDONED_EVERY = 50  # 2 % abandoned, each with its dead letter
TOMBSTONE_EVERY = 50  # inbox: 2 % tombstones (archived, kept for dedup)
AGGREGATE_PREFIX = "h-"  # the history rows' aggregate ids: 'h-<n>', as short as the benches' own
SPAN = {names.OUTBOX: "20 hours", names.INBOX: "6 days"}  # inside TXBOX_OUTBOX_/INBOX_RETENTION's defaults


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--history",
        type=int,
        default=0,
        metavar="N",
        help="also measure with N finished rows already in the tables (processed, abandoned; same run) "
        "and report history.ratio, that rate over the empty tables' rate",
    )


_ROWS = """
INSERT INTO {table} (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, metadata, segment,
                     created_at, locked_until, started_attempts, finished_attempts, processed_at, abandoned_at,
                     last_error{inbox_columns})
SELECT k.id, s.shape->>'message_type', s.shape->>'aggregate_type', %(prefix)s || i, s.shape->>'kind',
       s.shape->>'routing_key',
       CASE WHEN {tombstone} THEN '{{}}'::jsonb
            WHEN s.shape->'payload' ? 'n' THEN (s.shape->'payload') || jsonb_build_object('n', i)
            ELSE s.shape->'payload' END,
       CASE WHEN {tombstone} THEN jsonb_build_object('payload_sha256', md5(i::text) || md5(i::text))
            ELSE {metadata} END,
       (s.shape->>'aggregate_type') || ':' || %(prefix)s || i,
       t, t, 1, 1,
       CASE WHEN i %% {every} = 0 THEN NULL ELSE t + interval '50 milliseconds' END,
       CASE WHEN i %% {every} = 0 THEN t + interval '5 seconds' END,
       CASE WHEN i %% {every} = 0 THEN 'history: gave up' END{inbox_values}
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i,
     LATERAL (SELECT %(shapes)s::jsonb -> (i %% jsonb_array_length(%(shapes)s::jsonb))::int) AS s(shape),
     LATERAL (SELECT now() - interval '1 hour' - %(span)s::interval * (1 - i::float8 / %(n)s)) AS c(t),
     LATERAL (SELECT md5(i::text || random()::text)) AS h(r),
     LATERAL (SELECT (lpad(to_hex(floor(extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7' || substr(r, 1, 3)
                      || '8' || substr(r, 4, 15))::uuid) AS k(id)
"""

_LETTERS = """
INSERT INTO {letters} (message_id, source, reason, error, fingerprint, message_type, routing_key, message, died_at)
SELECT id, %(source)s, 'max_attempts', last_error, 'history', message_type, routing_key,
       jsonb_build_object('message_id', id, 'message_type', message_type, 'aggregate_type', aggregate_type,
                          'aggregate_id', aggregate_id, 'payload', payload), abandoned_at
FROM {table} WHERE abandoned_at IS NOT NULL AND last_error = 'history: gave up'
"""


class Shape(NamedTuple):
    """One kind of row the bench writes; the history repeats the benches' own mix of them."""

    message_type: str
    aggregate_type: str
    kind: str
    routing_key: str
    payload: dict[str, Any]  # its "n", if it has one, becomes the row's number

    @classmethod
    def of(cls, spec: MessageSpec, payload: dict[str, Any]) -> Shape:
        """The rows of message type ``spec`` with ``payload``."""
        return cls(spec.message_type, spec.aggregate_type, spec.kind, spec.routing_key, payload)


def prefill(
    database_url: str, table: str, n: int, shapes: list[Shape], *, queue: str = "", schema: str = "txbox"
) -> dict[str, Any]:
    """``n`` finished rows in ``table`` (created over its ``SPAN`` up to now, taking ``shapes`` in
    turn), their dead letters, VACUUM ANALYZE, CHECKPOINT."""
    inbox = table == names.INBOX
    statement = sql.SQL(_ROWS).format(
        table=sql.Identifier(schema, table),
        every=sql.Literal(ABANDONED_EVERY),
        # The inbox keeps the delivery record the receiver wrote (framework/receiver/intake.py).
        metadata=sql.SQL(
            "jsonb_set(jsonb_set(s.shape->'delivery', '{properties,message_id}', to_jsonb(k.id::text)), "
            "'{fields,delivery_tag}', to_jsonb(i))"
            if inbox
            else "'{}'::jsonb"
        ),
        tombstone=sql.SQL(f"i %% {TOMBSTONE_EVERY} = 1" if inbox else "FALSE"),
        inbox_columns=sql.SQL(", message_timestamp, received_at, queue, archived_at" if inbox else ""),
        inbox_values=sql.SQL(
            f", t, t, %(queue)s, CASE WHEN i %% {TOMBSTONE_EVERY} = 1 THEN t + interval '1 minute' END" if inbox else ""
        ),
    )
    params: dict[str, Any] = {
        "shapes": json.dumps(
            [
                {**shape._asdict(), "delivery": _delivery(shape.message_type, shape.kind, shape.routing_key)}
                for shape in shapes
            ]
        ),
        "prefix": AGGREGATE_PREFIX,
        "queue": queue,
        "span": SPAN[table],
        "n": max(n, 1),
    }
    started = time.perf_counter()
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        for first in range(1, n + 1, CHUNK):
            conn.execute(statement, {**params, "first": first, "last": min(first + CHUNK - 1, n)})
        letters = conn.execute(
            sql.SQL(_LETTERS).format(
                letters=sql.Identifier(schema, names.DEAD_LETTERS), table=sql.Identifier(schema, table)
            ),
            {"source": "outbox" if table == names.OUTBOX else "inbox"},
        ).rowcount
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, table)))
        conn.execute(sql.SQL("ANALYZE {}").format(sql.Identifier(schema, names.DEAD_LETTERS)))
        # Gigabytes written just now would otherwise be flushed by a checkpoint spread over
        # the next minutes, during the measurement, and its fsyncs would stall every commit
        # of it: a service's history was checkpointed long ago.
        conn.execute("CHECKPOINT")
        size = conn.execute("SELECT pg_total_relation_size(%s::regclass)", (f"{schema}.{table}",)).fetchone()
    return {
        "table": table,
        "rows": n,
        "abandoned": letters,
        "fill_seconds": round(time.perf_counter() - started, 1),
        "table_bytes": int(size[0]) if size else 0,
    }


def _delivery(message_type: str, exchange: str, routing_key: str) -> dict[str, Any]:
    """The delivery record the receiver keeps with an inbox row, as it keeps it for the benches' messages."""
    return {
        "properties": {
            "type": message_type,
            "headers": {},
            "user_id": "guest",
            "timestamp": 1_790_000_000,
            "message_id": "",
            "content_type": "application/json",
            "delivery_mode": 2,
        },
        "fields": {"exchange": exchange, "routing_key": routing_key, "delivery_tag": 0, "redelivered": False},
    }


def summary(n: int, empty_rate: float, history_rate: float, filled: list[dict[str, Any]]) -> dict[str, Any]:
    """The ``history`` field of a bench's JSON."""
    return {
        "rows": n,
        "empty_rate": round(empty_rate, 1),
        "rate": round(history_rate, 1),
        "ratio": round(history_rate / empty_rate, 3) if empty_rate else None,
        "bar_ratio": 0.9,
        "filled": filled,
    }
