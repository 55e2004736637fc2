"""All SQL of ``txbox.archive_batches``: the manifest of each `txbox archive` batch.

A batch's row is written (state ``pending``, with the exact ids it covers) before any of
its Parquet; it turns ``done`` in the transaction that deletes the batch's rows. So a
``pending`` row means none of its rows were deleted, and a rerun rewrites the batch's
directory from them (docs/explanation/analytics.md, "The Spark job on a cluster").
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql

from framework import names
from framework.sql import inbox as inbox_sql

FINISHED = inbox_sql.FINISHED
# Tombstones (inbox rows kept for dedup) are archived already and stay out of the files.
NOT_ARCHIVED = {names.OUTBOX: "TRUE", names.INBOX: "archived_at IS NULL"}


@dataclass(frozen=True)
class Batch:
    batch_id: str
    table: str
    location: str  # the URI of the batch's directory
    size: int = 0
    last_created_at: datetime | None = None  # keyset of the next page
    last_id: str | None = None


def open_next(
    cur: psycopg.Cursor[Any],
    schema: str,
    *,
    batch_id: str,
    service: str,
    table: str,
    location: str,
    cutoff: datetime,
    after: tuple[datetime, str] | None,
    limit: int,
) -> Batch | None:
    """Record the next page of finished, not yet archived rows created before ``cutoff`` (None: no rows).

    Pages go by ``(created_at, id)`` so rows that stay (tombstones, rows that changed
    state) are never scanned twice in one run.
    """
    keyset = "AND (created_at, id) > (%(after_at)s, %(after_id)s::uuid)" if after else ""
    statement = sql.SQL(
        f"""WITH page AS (
              SELECT id, created_at FROM {{t}}
               WHERE created_at < %(cutoff)s AND {FINISHED} AND {NOT_ARCHIVED[table]} {keyset}
               ORDER BY created_at, id LIMIT %(limit)s)
            INSERT INTO {{b}} (batch_id, service, table_name, ids, location)
            SELECT %(batch_id)s, %(service)s, %(table)s, array_agg(id ORDER BY created_at, id), %(location)s
              FROM page HAVING count(*) > 0
            RETURNING cardinality(ids),
                      (SELECT created_at FROM page ORDER BY created_at DESC, id DESC LIMIT 1),
                      ids[cardinality(ids)]::text"""
    ).format(t=sql.Identifier(schema, table), b=sql.Identifier(schema, names.ARCHIVE_BATCHES))
    params = {
        "cutoff": cutoff,
        "limit": limit,
        "batch_id": batch_id,
        "service": service,
        "table": table,
        "location": location,
    }
    if after:
        params.update(after_at=after[0], after_id=after[1])
    row = cur.execute(statement, params).fetchone()
    if row is None:
        return None
    return Batch(batch_id, table, location, int(row[0]), row[1], row[2])


def unfinished(cur: psycopg.Cursor[Any], schema: str, service: str) -> list[Batch]:
    """The ``pending`` batches of ``service``, oldest first."""
    rows = cur.execute(
        sql.SQL(
            "SELECT batch_id, table_name, location, cardinality(ids) FROM {b} "
            "WHERE state = 'pending' AND service = %s ORDER BY created_at, batch_id"
        ).format(b=sql.Identifier(schema, names.ARCHIVE_BATCHES)),
        (service,),
    ).fetchall()
    return [Batch(r[0], r[1], r[2], int(r[3])) for r in rows]


def ids_array(schema: str, batch_id: str) -> str:
    """The batch's ids as a uuid[] expression, for the Spark job's JDBC reads (ids stay in PostgreSQL).

    ``id = ANY(<this>)`` is a lookup by primary key, ``unnest(<this>)`` lists them.
    """
    literal = batch_id.replace("'", "''")
    # The cast makes it one array value: `= ANY((SELECT ...))` would compare each id with a whole array.
    return f"(SELECT ids FROM {names.qualified(schema, names.ARCHIVE_BATCHES)} WHERE batch_id = '{literal}')::uuid[]"


def count_left(cur: psycopg.Cursor[Any], schema: str, batch: Batch) -> int:
    """How many rows of the batch are still in ``batch.table`` to archive."""
    row = cur.execute(
        sql.SQL(f"SELECT count(*) FROM {{t}} WHERE id = ANY({ids_array(schema, batch.batch_id)}) AND {{keep}}").format(
            t=sql.Identifier(schema, batch.table), keep=sql.SQL(NOT_ARCHIVED[batch.table])
        )
    ).fetchone()
    return int(row[0]) if row else 0


def lock_rows(cur: psycopg.Cursor[Any], schema: str, batch: Batch) -> list[Any]:
    """Lock the batch's manifest and its rows still to archive; returns those rows' ids."""
    found = cur.execute(
        sql.SQL("SELECT ids FROM {b} WHERE batch_id = %s AND state = 'pending' FOR UPDATE").format(
            b=sql.Identifier(schema, names.ARCHIVE_BATCHES)
        ),
        (batch.batch_id,),
    ).fetchone()
    if found is None:
        return []
    rows = cur.execute(
        sql.SQL(f"SELECT id FROM {{t}} WHERE id = ANY(%s::uuid[]) AND {NOT_ARCHIVED[batch.table]} FOR UPDATE").format(
            t=sql.Identifier(schema, batch.table)
        ),
        (found[0],),
    ).fetchall()
    return [r[0] for r in rows]


def delete_finished(cur: psycopg.Cursor[Any], schema: str, table: str, ids: list[Any]) -> int:
    """Delete outbox rows ``ids`` that are still processed or abandoned."""
    return cur.execute(
        sql.SQL(f"DELETE FROM {{t}} WHERE id = ANY(%s::uuid[]) AND {FINISHED}").format(t=sql.Identifier(schema, table)),
        (ids,),
    ).rowcount


def finish(cur: psycopg.Cursor[Any], schema: str, batch_id: str, rows: int, deleted: int) -> None:
    cur.execute(
        sql.SQL(
            "UPDATE {b} SET state = 'done', rows = %s, deleted = %s, finished_at = clock_timestamp() "
            "WHERE batch_id = %s"
        ).format(b=sql.Identifier(schema, names.ARCHIVE_BATCHES)),
        (rows, deleted, batch_id),
    )
