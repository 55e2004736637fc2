"""`--history N` of `txbox bench relay|worker|e2e`: the same measurement over a table that has a past.

A service that has run for a while has an outbox and an inbox full of finished rows
(until retention takes them: docs/explanation/operations.md, "Retention"). The benches measure on
empty tables first, then pre-fill ``N`` historical rows with one ``INSERT ... SELECT
generate_series`` per million (a realistic mix: mostly processed, some abandoned with
their dead letters, in the inbox some tombstones), VACUUM ANALYZE and CHECKPOINT (history
is old: vacuumed, and flushed long ago), and measure again in the same run;
``history.ratio`` is the second rate over the first (the bar: ≥ 0.9 at N = 5,000,000).

Their ids are UUIDv7 of their creation time, as txbox makes them (framework/ids.py), and
each repeats a row the bench itself wrote and finished in its run on the empty tables
(:func:`sample`, a random sample of them, so the history has the bench's own mix): every
column but the row's own id, times and outcome is that row's, its aggregate ids
included. Rows of another size would not be history of this service, and they would
change what is measured: PostgreSQL puts a new row (or a row's new version) on any page
whose free space the free-space map says fits it, so history rows a little longer than
the new ones leave on each old page a leftover that fits a new row, and every insert
then reads and dirties an old page out of cache (docs/explanation/how-it-works.md, "The tables").
The rows were created over ``SPAN`` ending ``AGE`` ago, inside each table's default
retention, so the daemons' pruners have nothing to delete during the measurement: what
is measured is the cost of a big table, not of pruning it. The partial indexes the
claims read hold no finished row, so sharing the bench's aggregate ids adds nothing to
its lane and segment probes.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import psycopg
from psycopg import sql

from framework import names
from framework.db import conninfo
from framework.errors import TxboxError

CHUNK = 1_000_000  # rows per INSERT: a bounded transaction (and WAL) each
ABANDONED_EVERY = 50  # 2 % abandoned, each with its dead letter
TOMBSTONE_EVERY = 50  # inbox: 2 % tombstones (archived, kept for dedup)
SAMPLE = 1_000  # the bench's rows the history repeats
AGE = "1 hour"  # the newest history row is this old: the bench's own rows are newer
SPAN = {names.OUTBOX: "20 hours", names.INBOX: "6 days"}  # inside TXBOX_OUTBOX_/INBOX_RETENTION's defaults
# What each history row sets itself (SQL over the row's number i, its time t, its id k.id
# and its template p.template); every other column is its template's.
_ABANDONED = f"i %% {ABANDONED_EVERY} = 0"
_TOMBSTONE = f"i %% {TOMBSTONE_EVERY} = 1"
_OWN = {
    "id": "k.id",
    "created_at": "t",
    "locked_until": "t",
    "started_attempts": "1",
    "finished_attempts": "1",
    "processed_at": f"CASE WHEN {_ABANDONED} THEN NULL ELSE t + interval '50 milliseconds' END",
    "abandoned_at": f"CASE WHEN {_ABANDONED} THEN t + interval '5 seconds' END",
    "last_error": f"CASE WHEN {_ABANDONED} THEN 'history: gave up' END",
}
# The inbox's own: the receiver's times; the delivery record naming the row's own id
# (where the template's has one); a tombstone stripped as `txbox archive` strips it.
_INBOX_OWN = {
    "message_timestamp": "t",
    "received_at": "t",
    "archived_at": f"CASE WHEN {_TOMBSTONE} THEN t + interval '1 minute' END",
}
_INBOX_STRIPPED = {
    "payload": f"CASE WHEN {_TOMBSTONE} THEN '{{}}'::jsonb ELSE (p.template).payload END",
    "message_context": f"CASE WHEN {_TOMBSTONE} THEN '{{}}'::jsonb ELSE (p.template).message_context END",
    "metadata": f"CASE WHEN {_TOMBSTONE} THEN jsonb_build_object('payload_sha256', md5(i::text) || md5(i::text)) "
    "ELSE jsonb_set((p.template).metadata, '{properties,message_id}', to_jsonb(k.id::text), false) END",
}
OWN_COLUMNS = [*_OWN, *_INBOX_OWN]  # left out of a template


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
INSERT INTO {table} ({columns})
SELECT {values}
FROM generate_series(%(first)s::bigint, %(last)s::bigint) AS i
JOIN (SELECT e.k - 1, t FROM jsonb_array_elements(%(templates)s::jsonb) WITH ORDINALITY AS e(value, k),
                              LATERAL jsonb_populate_record(NULL::{table}, e.value) AS t) AS p(k, template)
  ON p.k = i %% %(count)s,
     LATERAL (SELECT now() - %(age)s::interval - %(span)s::interval * (1 - i::float8 / %(n)s)) AS c(t),
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


def sample(database_url: str, table: str, *, schema: str = "txbox", limit: int = SAMPLE) -> list[dict[str, Any]]:
    """At most ``limit`` of the finished rows the bench wrote into ``table``, picked at random
    (so in the bench's own mix), without the columns each history row sets itself: what
    :func:`prefill` repeats."""
    statement = sql.SQL(
        "SELECT to_jsonb(t) - %s::text[] FROM {} t WHERE processed_at IS NOT NULL ORDER BY random() LIMIT %s"
    ).format(sql.Identifier(schema, table))
    with psycopg.connect(conninfo(database_url)) as conn:
        rows = [row[0] for row in conn.execute(statement, (OWN_COLUMNS, limit))]
    if not rows:
        raise TxboxError(f"no processed rows in {schema}.{table} to repeat as history: the bench's own run made none")
    return rows


def prefill(
    database_url: str, table: str, n: int, templates: list[dict[str, Any]], *, schema: str = "txbox"
) -> dict[str, Any]:
    """``n`` finished rows in ``table`` (created over its ``SPAN``, taking ``templates`` in
    turn: rows of :func:`sample`), their dead letters, VACUUM ANALYZE, CHECKPOINT."""
    own = {**_OWN, **_INBOX_OWN, **_INBOX_STRIPPED} if table == names.INBOX else _OWN
    params: dict[str, Any] = {
        "templates": json.dumps(templates),
        "count": len(templates),
        "age": AGE,
        "span": SPAN[table],
        "n": max(n, 1),
    }
    started = time.perf_counter()
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        columns = [
            row[0]
            for row in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
                "ORDER BY ordinal_position",
                (schema, table),
            )
        ]
        statement = sql.SQL(_ROWS).format(
            table=sql.Identifier(schema, table),
            columns=sql.SQL(", ").join(map(sql.Identifier, columns)),
            values=sql.SQL(", ").join(
                sql.SQL(own[c]) if c in own else sql.SQL("(p.template).{}").format(sql.Identifier(c)) for c in columns
            ),
        )
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
