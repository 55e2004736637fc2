"""Named SQL of the receiver: batch insert into the inbox, the redelivery counter.

One ``INSERT ... SELECT FROM unnest(arrays)`` stores a whole batch in one round trip;
``ON CONFLICT (id) DO NOTHING`` makes a duplicate delivery a no-op and ``RETURNING id``
tells duplicates from new rows.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from framework import dead_letters as dl
from framework import dedup, names
from framework.receiver.intake import InboxRow

_COLUMNS: tuple[tuple[str, str], ...] = (
    ("id", "uuid"),
    ("message_type", "text"),
    ("aggregate_type", "text"),
    ("aggregate_id", "text"),
    ("message_version", "text"),
    ("kind", "text"),
    ("routing_key", "text"),
    ("payload", "jsonb"),
    ("message_context", "jsonb"),
    ("metadata", "jsonb"),
    ("segment", "text"),
    ("concurrency", "text"),
    ("priority", "int2"),
    ("message_timestamp", "timestamptz"),
    ("queue", "text"),
    ("redelivered", "bool"),
)


def insert_inbox_sql(schema: str) -> sql.Composed:
    # jsonb arrives as text[] and is cast per element: psycopg has no jsonb[] adapter
    # for plain strings, and text keeps the JSON exactly as the receiver serialized it.
    def array_type(t: str) -> str:
        return "text" if t == "jsonb" else t

    return sql.SQL(
        "INSERT INTO {table} ({cols}) SELECT {select} FROM unnest({arrays}) AS u({cols}) "
        "ON CONFLICT (id) DO NOTHING RETURNING id"
    ).format(
        table=sql.Identifier(schema, names.INBOX),
        cols=sql.SQL(", ").join(sql.Identifier(c) for c, _ in _COLUMNS),
        select=sql.SQL(", ").join(
            sql.SQL("{}::jsonb").format(sql.Identifier(c)) if t == "jsonb" else sql.Identifier(c) for c, t in _COLUMNS
        ),
        arrays=sql.SQL(", ").join(sql.SQL("%b::{}[]").format(sql.SQL(array_type(t))) for _, t in _COLUMNS),
    )


def insert_rows(cur: psycopg.Cursor[Any], schema: str, rows: Sequence[InboxRow]) -> set[uuid.UUID]:
    """Store ``rows``; returns the ids that were new (the others were duplicates)."""
    if not rows:
        return set()
    arrays = [[getattr(r, c) for r in rows] for c, _ in _COLUMNS]
    cur.execute(insert_inbox_sql(schema), arrays)
    return {row[0] for row in cur.fetchall()}


# What makes two messages with one id the same message (docs/architecture.md, "Receiver
# intake"): type, aggregate and payload, the payload compared as jsonb (key order and
# number spelling do not matter), or by its digest where the archive left a tombstone
# (framework.dedup). Context, timestamp, version, token and headers may differ between
# two sends of one message and are not compared.
def _conflicts_sql(schema: str) -> sql.Composed:
    u = {c: sql.SQL("u." + c) for c in ("message_type", "aggregate_type", "aggregate_id")}
    payload = sql.SQL("u.payload::jsonb")
    return sql.SQL(
        "SELECT u.n, concat_ws(', ', "
        "CASE WHEN i.message_type IS DISTINCT FROM u.message_type THEN 'message_type' END, "
        "CASE WHEN i.aggregate_type IS DISTINCT FROM u.aggregate_type THEN 'aggregate_type' END, "
        "CASE WHEN i.aggregate_id IS DISTINCT FROM u.aggregate_id THEN 'aggregate_id' END, "
        "CASE WHEN NOT coalesce({same_payload}, false) THEN 'payload' END) "
        "FROM unnest(%s::int[], %s::uuid[], %s::text[], %s::text[], %s::text[], %s::text[]) "
        "AS u(n, id, message_type, aggregate_type, aggregate_id, payload) "
        "JOIN {table} i ON i.id = u.id WHERE NOT coalesce({same}, false) ORDER BY u.n"
    ).format(
        table=sql.Identifier(schema, names.INBOX),
        same_payload=dedup.same_payload("i", payload),
        same=dedup.same_content("i", u["message_type"], u["aggregate_type"], u["aggregate_id"], payload),
    )


def conflicting(
    cur: psycopg.Cursor[Any], schema: str, rows: Sequence[InboxRow], new: set[uuid.UUID]
) -> list[tuple[int, str]]:
    """(index in ``rows``, fields that differ) of rows whose id is stored with other content.

    Only rows that did not insert are looked at (the first of several rows with one id
    in ``rows`` is the one that did): with no duplicate in a batch, no statement at all.
    """
    inserted: set[uuid.UUID] = set()
    candidates: list[int] = []
    for index, row in enumerate(rows):
        if row.id in new and row.id not in inserted:
            inserted.add(row.id)
        else:
            candidates.append(index)
    if not candidates:
        return []
    picked = [rows[i] for i in candidates]
    cur.execute(
        _conflicts_sql(schema),
        (
            candidates,
            [r.id for r in picked],
            [r.message_type for r in picked],
            [r.aggregate_type for r in picked],
            [r.aggregate_id for r in picked],
            [r.payload for r in picked],
        ),
    )
    return [(int(n), str(fields)) for n, fields in cur.fetchall()]


def count_redelivery(cur: psycopg.Cursor[Any], schema: str, queue: str, key: str) -> int:
    """Add one to the message's redelivery counter and return the new count."""
    cur.execute(
        sql.SQL(
            "INSERT INTO {t} (queue, message_id) VALUES (%s, %s) ON CONFLICT (queue, message_id) "
            "DO UPDATE SET count = {t}.count + 1, last_seen = clock_timestamp() RETURNING count"
        ).format(t=sql.Identifier(schema, names.REDELIVERIES)),
        (queue, key),
    )
    row = cur.fetchone()
    assert row is not None
    return int(row[0])


def forget_redeliveries(cur: psycopg.Cursor[Any], schema: str, queue: str, keys: Sequence[str]) -> None:
    """Drop counters of messages that were settled (stored or dead): the table stays small."""
    if keys:
        cur.execute(
            sql.SQL("DELETE FROM {t} WHERE queue = %s AND message_id = ANY(%s::text[])").format(
                t=sql.Identifier(schema, names.REDELIVERIES)
            ),
            (queue, list(keys)),
        )


def insert_dead_letters(cur: psycopg.Cursor[Any], schema: str, letters: Sequence[dl.DeadLetter]) -> None:
    if letters:
        cur.executemany(dl.insert_sql(schema), [letter.row() for letter in letters])
