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
tombstones alike. Payloads equal as jsonb but spelled differently as numbers (``1`` and
``1.0``) compare equal on a live row and unequal on a tombstone.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

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
        "({r}.message_type = {mt} AND {r}.aggregate_type = {at} AND {r}.aggregate_id = {ai} AND "
        "CASE WHEN {r}.archived_at IS NULL THEN {r}.payload = {p} "
        "ELSE {r}.metadata ->> {key} = {digest} END)"
    ).format(
        r=r,
        mt=message_type,
        at=aggregate_type,
        ai=aggregate_id,
        p=payload,
        key=sql.Literal(DIGEST_KEY),
        digest=payload_digest(payload),
    )


class Content(Protocol):
    """What identifies a message's content (the receiver's ``InboxRow`` has these)."""

    @property
    def id(self) -> uuid.UUID: ...
    @property
    def message_type(self) -> str: ...
    @property
    def aggregate_type(self) -> str: ...
    @property
    def aggregate_id(self) -> str: ...
    @property
    def payload(self) -> str: ...  # JSON text


def conflicting_ids_sql(schema: str) -> sql.Composed:
    """Of the given messages, the ids the inbox already holds (live or tombstone) with other content.

    Parameters: ``ids`` uuid[], ``types``, ``aggregate_types``, ``aggregate_ids``,
    ``payloads`` (JSON text) text[]. One index probe per id that is already stored.
    """
    return sql.SQL(
        "SELECT u.id FROM unnest(%(ids)s::uuid[], %(types)s::text[], %(aggregate_types)s::text[], "
        "%(aggregate_ids)s::text[], %(payloads)s::text[]) "
        "AS u(id, message_type, aggregate_type, aggregate_id, payload) "
        "JOIN {inbox} i ON i.id = u.id WHERE NOT {same}"
    ).format(
        inbox=sql.Identifier(schema, names.INBOX),
        same=same_content(
            "i",
            sql.SQL("u.message_type"),
            sql.SQL("u.aggregate_type"),
            sql.SQL("u.aggregate_id"),
            sql.SQL("u.payload::jsonb"),
        ),
    )


def conflicting_ids(cur: psycopg.Cursor[Any], schema: str, messages: Sequence[Content]) -> set[uuid.UUID]:
    """The ids among ``messages`` stored with different content: these are ``id_conflict``,
    the others that were not inserted are true duplicates."""
    if not messages:
        return set()
    cur.execute(
        conflicting_ids_sql(schema),
        {
            "ids": [m.id for m in messages],
            "types": [m.message_type for m in messages],
            "aggregate_types": [m.aggregate_type for m in messages],
            "aggregate_ids": [m.aggregate_id for m in messages],
            "payloads": [m.payload for m in messages],
        },
    )
    return {row[0] if isinstance(row, tuple) else row["id"] for row in cur.fetchall()}


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
