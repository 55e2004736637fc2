"""All SQL that writes ``txbox.dead_letters``: the one INSERT every writer uses.

:meth:`framework.dead_letters.DeadLetter.row` is the row codec and :func:`insert_sql`
the one INSERT, used by the receiver, the worker, the relay and the collector alike;
``ON CONFLICT`` on the collector's ``delivery_key`` makes a broker delivery stored twice
(a crash before its ack) one row, and is never hit by the other writers, whose key is
NULL. The read side (list, groups, a letter, the dashboard's numbers) is
framework/dlq/queries.py; replay and discard are framework/dlq/replay.py.
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
