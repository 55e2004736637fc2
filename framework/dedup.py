"""The inbox's dedup memory: what may remove an inbox row, and how a stored id is compared.

The inbox's primary key is the dedup memory: the receiver inserts with ``ON CONFLICT
(id) DO NOTHING``, the replay of a dead letter looks the id up first. Whatever removes
inbox rows (``txbox archive``, any later retention) must therefore go through
:func:`forget`, which keeps every row finished within ``TXBOX_DEDUP_WINDOW`` as a
*tombstone* and deletes only the older ones. See docs/architecture.md, "Dedup memory".

Why tombstones in the inbox and not a table of remembered ids: with a second table the
receiver's insert would need a second unique probe per row (its hot path) and would race
with the archive moving an id from one table to the other between the probe and the
insert. A tombstone is the same row under the same primary key, so the existing
``ON CONFLICT`` dedups it with no change and no race; stripped of payload, context,
metadata and error it costs about a hundred bytes per id.

A tombstone keeps type and aggregate, and the SHA-256 of its payload's canonical jsonb
text in ``metadata ->> 'payload_sha256'``: :func:`same_content` tells a true duplicate
(quiet) from an id reused for other content (``id_conflict``) for live rows and
tombstones alike; the receiver's conflict check and the replay both use it.
Payloads equal as jsonb but spelled differently as numbers (``1`` and
``1.0``) compare equal on a live row and unequal on a tombstone.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg
from psycopg import sql

from framework import names

DIGEST_KEY = "payload_sha256"
FINISHED = "(processed_at IS NOT NULL OR abandoned_at IS NOT NULL)"
# The time a message's dedup window starts: when it was processed (or abandoned).
FINISHED_AT = "coalesce(processed_at, abandoned_at)"


def payload_digest(payload: sql.Composable) -> sql.Composed:
    """SQL: hex SHA-256 of a jsonb value's canonical text (keys sorted, spacing normalized)."""
    return sql.SQL("encode(sha256(convert_to(({})::text, 'UTF8')), 'hex')").format(payload)


def same_content(
    row: str,
    message_type: sql.Composable,
    aggregate_type: sql.Composable,
    aggregate_id: sql.Composable,
    payload: sql.Composable,
) -> sql.Composed:
    """SQL predicate: inbox row ``row`` (an alias) holds this content, live or tombstone.

    ``payload`` must be a jsonb expression.
    """
    r = sql.Identifier(row)
    return sql.SQL(
        "({r}.message_type = {mt} AND {r}.aggregate_type = {at} AND {r}.aggregate_id = {ai} AND {p})"
    ).format(r=r, mt=message_type, at=aggregate_type, ai=aggregate_id, p=same_payload(row, payload))


def same_payload(row: str, payload: sql.Composable) -> sql.Composed:
    """SQL predicate: inbox row ``row`` holds this payload (a jsonb expression), live or tombstone."""
    return sql.SQL(
        "CASE WHEN {r}.archived_at IS NULL THEN {r}.payload = {p} ELSE {r}.metadata ->> {key} = {digest} END"
    ).format(r=sql.Identifier(row), p=payload, key=sql.Literal(DIGEST_KEY), digest=payload_digest(payload))


@dataclass(frozen=True)
class Forgotten:
    deleted: int = 0
    tombstoned: int = 0
    resolved: int = 0  # dead letters of processed messages marked resolved


def forget(cur: psycopg.Cursor[Any], schema: str, ids: Sequence[Any], window: timedelta) -> Forgotten:
    """Remove finished inbox rows ``ids`` as far as dedup allows, in the caller's transaction.

    A row finished within ``window`` becomes a tombstone (or stays one); an older row or
    tombstone is deleted. Pending rows are left alone. Open or replayed dead letters of
    a *processed* message with the same content are marked resolved first, so replaying
    them later — even once the id is forgotten — cannot run the message again; a letter
    with other content (an id conflict) stays open.
    """
    inbox = sql.Identifier(schema, names.INBOX)
    params = {"ids": list(ids), "window": window}
    letter = "d.message"
    resolved = cur.execute(
        sql.SQL(
            """UPDATE {dl} d SET resolved_at = i.processed_at FROM {inbox} i
               WHERE i.id = ANY(%(ids)s::uuid[]) AND i.processed_at IS NOT NULL AND d.message_id = i.id
                 AND d.source IN ('inbox', 'broker') AND d.resolved_at IS NULL AND d.discarded_at IS NULL
                 AND jsonb_typeof({m}) = 'object' AND {same}"""
        ).format(
            dl=sql.Identifier(schema, names.DEAD_LETTERS),
            inbox=inbox,
            m=sql.SQL(letter),
            same=same_content(
                "i",
                sql.SQL(f"{letter} ->> 'message_type'"),
                sql.SQL(f"{letter} ->> 'aggregate_type'"),
                sql.SQL(f"{letter} ->> 'aggregate_id'"),
                sql.SQL(f"{letter} -> 'payload'"),
            ),
        ),
        params,
    ).rowcount
    tombstoned = cur.execute(
        sql.SQL(
            f"""UPDATE {{inbox}} SET archived_at = clock_timestamp(), payload = '{{{{}}}}'::jsonb,
                   message_context = '{{{{}}}}'::jsonb, last_error = NULL,
                   metadata = jsonb_build_object({{key}}, {{digest}})
               WHERE id = ANY(%(ids)s::uuid[]) AND {FINISHED} AND archived_at IS NULL
                 AND {FINISHED_AT} >= now() - %(window)s::interval"""
        ).format(inbox=inbox, key=sql.Literal(DIGEST_KEY), digest=payload_digest(sql.SQL("payload"))),
        params,
    ).rowcount
    deleted = cur.execute(
        sql.SQL(
            f"""DELETE FROM {{inbox}} WHERE id = ANY(%(ids)s::uuid[]) AND {FINISHED}
                 AND {FINISHED_AT} < now() - %(window)s::interval"""
        ).format(inbox=inbox),
        params,
    ).rowcount
    return Forgotten(deleted=deleted, tombstoned=tombstoned, resolved=resolved)


def expired_tombstones(cur: psycopg.Cursor[Any], schema: str, window: timedelta, limit: int) -> list[Any]:
    """Ids of up to ``limit`` tombstones whose window has passed (through inbox_tombstone_idx)."""
    rows = cur.execute(
        sql.SQL(
            f"""SELECT id FROM {{inbox}} WHERE archived_at IS NOT NULL AND {FINISHED_AT} < now() - %(window)s::interval
                ORDER BY {FINISHED_AT} LIMIT %(limit)s"""
        ).format(inbox=sql.Identifier(schema, names.INBOX)),
        {"window": window, "limit": limit},
    ).fetchall()
    return [r[0] if isinstance(r, tuple) else r["id"] for r in rows]
