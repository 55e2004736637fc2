"""SQL of ``txbox.dead_letters``: the one INSERT every writer uses, replay and discard.

:meth:`framework.dead_letters.DeadLetter.row` is the row codec and :func:`insert_sql`
the one INSERT, used by the receiver, the worker, the relay and the collector alike;
``ON CONFLICT`` on the collector's ``delivery_key`` makes a broker delivery stored twice
(a crash before its ack) one row, and is never hit by the other writers, whose key is
NULL. The statements of replay and discard (framework/dlq/replay.py) follow; the read
side (list, groups, a letter, the dashboard's numbers) is framework/dlq/queries.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from framework import names
from framework.dead_letters import DeadLetter

# The columns a writer sets (DeadLetter.row()'s keys); the others have their defaults.
COLUMNS = (
    "message_id",
    "source",
    "reason",
    "error",
    "fingerprint",
    "message_type",
    "routing_key",
    "message",
    "raw_body",
    "raw_encoding",
    "headers",
    "attempts",
    "delivery_key",
)


def insert_sql(schema: str) -> sql.Composed:
    """The dead-letter INSERT with named parameters (``DeadLetter.row()``)."""
    return sql.SQL(
        "INSERT INTO {t} ({cols}) VALUES ({vals}) ON CONFLICT (delivery_key) WHERE delivery_key IS NOT NULL DO NOTHING"
    ).format(
        t=sql.Identifier(schema, names.DEAD_LETTERS),
        cols=sql.SQL(", ").join(map(sql.Identifier, COLUMNS)),
        vals=sql.SQL(", ").join(map(sql.Placeholder, COLUMNS)),
    )


def insert_letters(cur: psycopg.Cursor[Any], schema: str, letters: Sequence[DeadLetter]) -> None:
    """Store ``letters`` in the cursor's transaction."""
    if letters:
        cur.executemany(insert_sql(schema), [letter.row() for letter in letters])


# --- replay and discard (framework/dlq/replay.py) ------------------------------------


def _letters(schema: str) -> sql.Identifier:
    return sql.Identifier(schema, names.DEAD_LETTERS)


def lock(schema: str) -> sql.Composed:
    """Params: ids. The letters, locked, in id order (no deadlock between two operators)."""
    return sql.SQL("SELECT * FROM {t} WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE").format(t=_letters(schema))


def mark_resolved(schema: str) -> sql.Composed:
    """Params: id, at. The letter's message was processed (or published) at ``at``."""
    return sql.SQL("UPDATE {t} SET resolved_at = %(at)s WHERE id = %(id)s").format(t=_letters(schema))


def mark_discarded(schema: str) -> sql.Composed:
    """Params: id."""
    return sql.SQL("UPDATE {t} SET discarded_at = clock_timestamp() WHERE id = %(id)s").format(t=_letters(schema))


def note(schema: str, stamp: str, more: str) -> sql.Composed:
    """Params: id, entry (jsonb). Set column ``stamp`` to now, apply ``more`` (SQL of ours,
    never input) and append ``entry``, timed as ``stamp``, to the letter's history."""
    return sql.SQL(
        """UPDATE {t} SET {stamp} = clock_timestamp(), {more},
               attempts = jsonb_set(attempts, '{{history}}',
                   coalesce(attempts -> 'history', '[]'::jsonb)
                   || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object({key}, clock_timestamp())))
           WHERE id = %(id)s"""
    ).format(t=_letters(schema), stamp=sql.Identifier(stamp), more=sql.SQL(more), key=sql.Literal(stamp))


def resolve_replayed(schema: str, table: str) -> sql.Composed:
    """Params: sources, ids (or NULL: all). Replayed letters whose message ``table`` has since
    processed; touches only the ``dead_letters_unresolved_idx`` rows."""
    return sql.SQL(
        """UPDATE {dl} d SET resolved_at = m.processed_at FROM {m} m
           WHERE d.replayed_at IS NOT NULL AND d.resolved_at IS NULL AND d.discarded_at IS NULL
             AND d.source = ANY(%(sources)s) AND m.id = d.message_id AND m.processed_at IS NOT NULL
             AND (%(ids)s::bigint[] IS NULL OR d.id = ANY(%(ids)s::bigint[]))"""
    ).format(dl=_letters(schema), m=sql.Identifier(schema, table))


def resolve_processed(schema: str) -> sql.Composed:
    """Params: ids (message ids). Their replayed inbox and broker letters, resolved now."""
    return sql.SQL(
        """UPDATE {dl} SET resolved_at = clock_timestamp()
           WHERE message_id = ANY(%(ids)s) AND replayed_at IS NOT NULL AND resolved_at IS NULL
             AND discarded_at IS NULL AND source IN ('inbox', 'broker')"""
    ).format(dl=_letters(schema))
