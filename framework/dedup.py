"""The inbox's dedup memory: what may remove an inbox row, and how a stored id is compared.

The inbox's primary key is the dedup memory: the receiver inserts with ``ON CONFLICT
(id) DO NOTHING``, the replay of a dead letter looks the id up first. Whatever removes
inbox rows (``txbox archive``, any later retention) must therefore go through
:func:`forget`, which keeps every row finished within ``TXBOX_DEDUP_WINDOW`` as a
*tombstone* and deletes only the older ones. See docs/explanation/guarantees.md, "Dedup memory".

Why tombstones in the inbox and not a table of remembered ids: with a second table the
receiver's insert would need a second unique probe per row (its hot path) and would race
with the archive moving an id from one table to the other between the probe and the
insert. A tombstone is the same row under the same primary key, so the existing
``ON CONFLICT`` dedups it with no change and no race; stripped of payload, context,
metadata and error it keeps little more than its key (docs/explanation/guarantees.md, "Dedup memory").

A tombstone keeps type and aggregate, and the SHA-256 of its payload's canonical jsonb
text in ``metadata ->> 'payload_sha256'``: ``framework.sql.inbox.same_content`` tells a
true duplicate (quiet) from an id reused for other content (``id_conflict``) for live
rows and tombstones alike; the receiver's conflict check and the replay both use it.
Payloads equal as jsonb but spelled differently as numbers (``1`` and ``1.0``) compare
equal on a live row and unequal on a tombstone. The statements are in
framework/sql/inbox.py (the dead letters' in framework/sql/dead_letters.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import psycopg

from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql


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
    params = {"ids": list(ids), "window": window}
    resolved = cur.execute(dead_letters_sql.resolve_forgotten(schema), params).rowcount
    tombstoned = cur.execute(inbox_sql.tombstone(schema), params).rowcount
    deleted = cur.execute(inbox_sql.forget_expired(schema), params).rowcount
    return Forgotten(deleted=deleted, tombstoned=tombstoned, resolved=resolved)


def expired_tombstones(cur: psycopg.Cursor[Any], schema: str, window: timedelta, limit: int) -> list[Any]:
    """Ids of up to ``limit`` tombstones whose window has passed (through inbox_tombstone_idx)."""
    rows = cur.execute(inbox_sql.expired_tombstones(schema), {"window": window, "limit": limit}).fetchall()
    return [r[0] if isinstance(r, tuple) else r["id"] for r in rows]
