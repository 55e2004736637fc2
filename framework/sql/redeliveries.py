"""All SQL of ``txbox.redeliveries``: the receiver's count of deliveries of one message.

A row per (queue, message key) that RabbitMQ delivered again; it survives a receiver
that crashes on a delivery, so the redelivery limit still holds (docs/explanation/receive.md,
"Receiver intake"). Rows of settled messages are deleted at once: the table stays small.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import sql

from framework import names


def count(cur: psycopg.Cursor[Any], schema: str, queue: str, key: str) -> int:
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


def forget(cur: psycopg.Cursor[Any], schema: str, queue: str, keys: Sequence[str]) -> None:
    """Drop counters of messages that were settled (stored or dead): the table stays small."""
    if keys:
        cur.execute(
            sql.SQL("DELETE FROM {t} WHERE queue = %s AND message_id = ANY(%s::text[])").format(
                t=sql.Identifier(schema, names.REDELIVERIES)
            ),
            (queue, list(keys)),
        )
