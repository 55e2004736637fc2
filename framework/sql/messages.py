"""Statements over the columns the outbox and the inbox share, for either table.

The dead-letter replay (framework/dlq/replay.py) puts a message back where it was
abandoned, the inbox or the outbox, with the same statements; what differs between the
two tables is decided here, next to the SQL.
"""

from __future__ import annotations

from psycopg import sql

from framework import names
from framework.tables import pending_by_id


def current(schema: str, table: str, same: sql.Composable) -> sql.Composed:
    """Params: id (and ``same``'s). The message's row, locked: its attempts, outcome and
    ``archived_at`` (inbox tombstones; NULL in the outbox), and ``same`` as a column."""
    archived = "r.archived_at" if table == names.INBOX else "NULL::timestamptz"
    return sql.SQL(
        "SELECT started_attempts, finished_attempts, last_error, processed_at, abandoned_at, "
        "{archived} AS archived_at, {same} AS same FROM {t} r WHERE id = %(id)s FOR UPDATE"
    ).format(archived=sql.SQL(archived), same=same, t=sql.Identifier(schema, table))


def reset(schema: str, table: str) -> sql.Composed:
    """Params: id. An abandoned row due again at once, with a fresh set of attempts."""
    return sql.SQL(
        """UPDATE {t} SET processed_at = NULL, abandoned_at = NULL, last_error = NULL,
               started_attempts = 0, finished_attempts = 0, locked_until = clock_timestamp()
           WHERE id = %(id)s"""
    ).format(t=sql.Identifier(schema, table))


def take_back(schema: str, table: str) -> sql.Composed:
    """Params: id, why. Abandon again a row a replay made due, if it has not started:
    returns its id. An inbox row not locked by a worker can be taken back even while
    claimed (the worker's fence, pending and the same ``started_attempts``, then leaves it
    alone); an outbox row only while no
    publisher claimed it, since a publish cannot be recalled."""
    where = pending_by_id()
    if table == names.OUTBOX:
        where += " AND started_attempts <= finished_attempts"
    return sql.SQL(
        """UPDATE {t} SET abandoned_at = clock_timestamp(), locked_until = clock_timestamp(), last_error = %(why)s
           WHERE id = (SELECT id FROM {t} WHERE id = %(id)s AND {where} FOR UPDATE SKIP LOCKED)
           RETURNING id"""
    ).format(t=sql.Identifier(schema, table), where=sql.SQL(where))
