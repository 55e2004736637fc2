"""Replay and discard dead letters; mark replayed ones resolved once processed.

Replay semantics (each covered by tests/integration/test_dlq_replay.py):

* **inbox** letters (the worker abandoned the message): the inbox row is reset in the
  transaction that marks the letter replayed — ``abandoned_at``/``last_error`` cleared,
  ``started_attempts``/``finished_attempts`` back to 0 so the max-attempts and poison
  checks give it a fresh set of attempts, ``locked_until = now()`` so it is due at
  once. The attempt history is not lost: the row's counters, last error and abandon
  time are appended to the letter's ``attempts -> 'history'`` list first.
* **broker** letters (the message never made it into the inbox: rejected by the
  receiver or dead-lettered by RabbitMQ) are re-sent through this service's outbox in
  the transaction that marks them replayed (same ``message_id``, validated against the
  current contracts, routed by its contract): the relay publishes it, and the receiver
  stores it like any delivery, checks included. An event goes to every subscriber
  again; the others already have its id in their inboxes and drop it. If this
  service's inbox already holds that id, the inbox rules apply instead.
* **outbox** letters (the publisher gave up): the outbox row is reset the same way (or,
  if it is gone, a fresh outbox row with the same ``message_id`` is written), so the
  publisher relays it again; receivers dedupe by ``message_id``.
* A message already processed (or published) is never reset: the letter is marked
  resolved instead, so replaying twice cannot apply the business effect twice (the
  inbox also dedupes by ``message_id``).

Resolution: :func:`resolve_replayed` is one set-based UPDATE over the replayed, still
unresolved letters (a small partial index) joined to ``inbox``/``outbox.processed_at``;
the collector runs it every few seconds and the CLI and dashboard run it before they
read. :func:`resolve_processed` is the same for given message ids, for a worker that
wants letters resolved in its own completion transaction.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import psycopg
from psycopg import sql
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from framework import names
from framework.contracts import Registry
from framework.envelope import message_from_dict
from framework.errors import TxboxError
from framework.outbox import Outbox, default_segment, json_params
from framework.outbox import insert_sql as outbox_insert_sql

CHUNK = 500


@dataclass(frozen=True)
class Outcome:
    """What replay/discard did (or would do, with dry_run) to one letter."""

    id: int
    action: str
    detail: str
    ok: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "detail": self.detail, "ok": self.ok}


class ReplayRefused(TxboxError):
    """A letter that cannot be replayed as it is (no valid envelope, unknown type...)."""


def _x(conn: psycopg.Connection[Any], query: sql.Composed, params: Any = None) -> psycopg.Cursor[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(query, params)


def _t(schema: str, table: str) -> sql.Identifier:
    return sql.Identifier(schema, table)


def _chunks(ids: Sequence[int]) -> list[list[int]]:
    return [list(ids[i : i + CHUNK]) for i in range(0, len(ids), CHUNK)]


def replay(
    conn: psycopg.Connection[Any],
    schema: str,
    registry: Registry,
    service: str,
    ids: Sequence[int],
    *,
    dry_run: bool = False,
) -> list[Outcome]:
    """Replay letters, ``CHUNK`` per transaction; ``dry_run`` runs the same steps and rolls back.

    ``conn`` must be in autocommit mode (each chunk is its own transaction here).
    """
    outcomes: list[Outcome] = []
    for chunk in _chunks(ids):
        with conn.transaction(force_rollback=dry_run):
            letters = _x(
                conn,
                sql.SQL("SELECT * FROM {t} WHERE id = ANY(%(ids)s) ORDER BY id FOR UPDATE").format(
                    t=_t(schema, names.DEAD_LETTERS)
                ),
                {"ids": chunk},
            ).fetchall()
            found = {row["id"] for row in letters}
            outcomes += [Outcome(i, "missing", "no dead letter with this id", False) for i in chunk if i not in found]
            for letter in letters:
                outcomes.append(_replay_one(conn, schema, registry, service, letter))
    return outcomes


def _replay_one(
    conn: psycopg.Connection[Any], schema: str, registry: Registry, service: str, letter: dict[str, Any]
) -> Outcome:
    lid = letter["id"]
    if letter["discarded_at"] is not None:
        return Outcome(lid, "skipped", "discarded", False)
    if letter["resolved_at"] is not None:
        return Outcome(lid, "skipped", "already resolved", False)
    if letter["message_id"] is None:
        return Outcome(lid, "refused", "no valid message_id: nothing to replay (discard it)", False)
    try:
        with conn.transaction():  # a savepoint: a refused letter leaves the others of the chunk intact
            if letter["source"] == "broker":
                return _resend(conn, schema, registry, service, letter)
            table = names.OUTBOX if letter["source"] == "outbox" else names.INBOX
            return _replay_into(conn, schema, registry, service, letter, table)
    except ReplayRefused as exc:
        return Outcome(lid, "refused", str(exc), False)


def _resend(
    conn: psycopg.Connection[Any], schema: str, registry: Registry, service: str, letter: dict[str, Any]
) -> Outcome:
    """A broker letter: through the outbox again, unless the inbox has the message by now."""
    in_inbox = _x(
        conn,
        sql.SQL("SELECT 1 FROM {t} WHERE id = %(id)s").format(t=_t(schema, names.INBOX)),
        {"id": letter["message_id"]},
    ).fetchone()
    if in_inbox is not None:
        return _replay_into(conn, schema, registry, service, letter, names.INBOX)
    if letter["message_type"] is not None:
        _ensure_received(registry, service, letter["message_type"])
    return _replay_into(conn, schema, registry, service, letter, names.OUTBOX, resend=True)


def _replay_into(
    conn: psycopg.Connection[Any],
    schema: str,
    registry: Registry,
    service: str,
    letter: dict[str, Any],
    table: str,
    *,
    resend: bool = False,
) -> Outcome:
    """Reset (or write) the message's row in ``table``; ``resend``: an outbox row that
    was published already is published again (a broker letter never reached the inbox)."""
    lid, mid = letter["id"], letter["message_id"]
    row = _x(
        conn,
        sql.SQL(
            "SELECT started_attempts, finished_attempts, last_error, processed_at, abandoned_at "
            "FROM {t} WHERE id = %(id)s FOR UPDATE"
        ).format(t=_t(schema, table)),
        {"id": mid},
    ).fetchone()
    if row is None:
        _insert_from_envelope(conn, schema, registry, service, letter, table)
        action, detail = f"{table}-insert", f"written to {table} as {mid}" + (" to be sent again" if resend else "")
    elif row["processed_at"] is not None and not resend:
        _x(
            conn,
            sql.SQL("UPDATE {t} SET resolved_at = %(at)s WHERE id = %(id)s").format(t=_t(schema, names.DEAD_LETTERS)),
            {"at": row["processed_at"], "id": lid},
        )
        done = "published" if table == names.OUTBOX else "processed"
        return Outcome(
            lid,
            "already-" + done,
            f"{table} row {mid} was {done} at {row['processed_at']:%Y-%m-%d %H:%M:%S}; marked resolved",
        )
    elif row["abandoned_at"] is None and row["processed_at"] is None:
        action, detail = f"{table}-pending", f"{table} row {mid} is already pending"
    else:
        _x(
            conn,
            sql.SQL(
                """UPDATE {t} SET processed_at = NULL, abandoned_at = NULL, last_error = NULL,
                       started_attempts = 0, finished_attempts = 0, locked_until = clock_timestamp()
                   WHERE id = %(id)s"""
            ).format(t=_t(schema, table)),
            {"id": mid},
        )
        action, detail = f"{table}-reset", f"{table} row {mid} reset for processing"
    history = {
        "replayed_at": None,  # filled by SQL below (clock of the database)
        "table": table,
        "action": action,
        "started_attempts": row["started_attempts"] if row else None,
        "finished_attempts": row["finished_attempts"] if row else None,
        "last_error": row["last_error"] if row else None,
        "abandoned_at": row["abandoned_at"].isoformat() if row and row["abandoned_at"] else None,
    }
    _x(
        conn,
        sql.SQL(
            """UPDATE {t} SET replayed_at = clock_timestamp(), replay_count = replay_count + 1,
                   attempts = jsonb_set(attempts, '{{history}}',
                       coalesce(attempts -> 'history', '[]'::jsonb)
                       || jsonb_build_array(%(entry)s::jsonb || jsonb_build_object('replayed_at', clock_timestamp())))
               WHERE id = %(id)s"""
        ).format(t=_t(schema, names.DEAD_LETTERS)),
        {"entry": Jsonb(history), "id": lid},
    )
    return Outcome(lid, action, detail)


def _insert_from_envelope(
    conn: psycopg.Connection[Any],
    schema: str,
    registry: Registry,
    service: str,
    letter: dict[str, Any],
    table: str,
) -> None:
    envelope = letter["message"]
    if not isinstance(envelope, dict):
        raise ReplayRefused("the letter holds no JSON envelope (raw body only): fix the sender and discard it")
    try:
        message = message_from_dict(envelope)
        spec = registry.get(message.message_type)
        spec.validate(message.payload)
    except TxboxError as exc:
        raise ReplayRefused(f"cannot replay: {exc}") from None
    if message.message_id != letter["message_id"]:
        raise ReplayRefused(
            f"envelope message_id {message.message_id} differs from the letter's {letter['message_id']}"
        )
    if table == names.OUTBOX:
        row = Outbox(cast(Any, None), registry).build(
            spec,
            aggregate_id=message.aggregate_id,
            payload=message.payload,
            message_context=message.message_context,
            message_id=message.message_id,
            message_version=message.message_version,
            auth_token=message.auth_token,
        )
        _x(conn, outbox_insert_sql(schema), json_params(row))
        return
    _ensure_received(registry, service, spec.message_type)
    metadata: dict[str, Any] = {"replayed_from_dead_letter": letter["id"]}
    if message.auth_token is not None:
        metadata["auth_token"] = message.auth_token
    _x(
        conn,
        sql.SQL(
            """INSERT INTO {t} (id, message_type, aggregate_type, aggregate_id, message_version, kind, routing_key,
                   payload, message_context, metadata, segment, message_timestamp, queue, redelivered)
               VALUES (%(id)s, %(message_type)s, %(aggregate_type)s, %(aggregate_id)s, %(message_version)s, %(kind)s,
                   %(routing_key)s, %(payload)s, %(message_context)s, %(metadata)s, %(segment)s, %(timestamp)s,
                   %(queue)s, false)"""
        ).format(t=_t(schema, table)),
        {
            "id": message.message_id,
            "message_type": message.message_type,
            "aggregate_type": message.aggregate_type,
            "aggregate_id": message.aggregate_id,
            "message_version": message.message_version,
            "kind": spec.kind,
            "routing_key": letter["routing_key"] or spec.routing_key,
            "payload": json.dumps(message.payload),
            "message_context": json.dumps(message.message_context),
            "metadata": json.dumps(metadata),
            "segment": default_segment(message.aggregate_type, message.aggregate_id),
            "timestamp": message.timestamp,
            "queue": names.inbox_queue(service),
        },
    )


def discard(conn: psycopg.Connection[Any], schema: str, ids: Sequence[int], *, dry_run: bool = False) -> list[Outcome]:
    """Close letters nobody will replay (kept for the record, hidden from the open list)."""
    outcomes: list[Outcome] = []
    for chunk in _chunks(ids):
        with conn.transaction(force_rollback=dry_run):
            done = {
                r["id"]
                for r in _x(
                    conn,
                    sql.SQL(
                        """UPDATE {t} SET discarded_at = clock_timestamp()
                           WHERE id = ANY(%(ids)s) AND discarded_at IS NULL AND resolved_at IS NULL RETURNING id"""
                    ).format(t=_t(schema, names.DEAD_LETTERS)),
                    {"ids": chunk},
                ).fetchall()
            }
            outcomes += [
                Outcome(i, "discarded", "discarded")
                if i in done
                else Outcome(i, "skipped", "missing, resolved or already discarded", False)
                for i in chunk
            ]
    return outcomes


def resolve_replayed(conn: psycopg.Connection[Any], schema: str) -> int:
    """Mark replayed letters whose message has since been processed (inbox) or published
    (outbox) as resolved. Touches only the ``dead_letters_unresolved_idx`` rows."""
    total = 0
    for table, sources in ((names.INBOX, ["inbox", "broker"]), (names.OUTBOX, ["outbox"])):
        cur = _x(
            conn,
            sql.SQL(
                """UPDATE {dl} d SET resolved_at = m.processed_at FROM {m} m
                   WHERE d.replayed_at IS NOT NULL AND d.resolved_at IS NULL AND d.discarded_at IS NULL
                     AND d.source = ANY(%(sources)s) AND m.id = d.message_id AND m.processed_at IS NOT NULL"""
            ).format(dl=_t(schema, names.DEAD_LETTERS), m=_t(schema, table)),
            {"sources": sources},
        )
        total += cur.rowcount
    return total


def resolve_processed(cursor: psycopg.Cursor[Any], schema: str, message_ids: Sequence[uuid.UUID]) -> int:
    """For the worker, inside the transaction that marks ``message_ids`` processed: resolve
    their replayed letters at once (optional: the collector's sweep does it within seconds)."""
    cursor.execute(
        sql.SQL(
            """UPDATE {dl} SET resolved_at = clock_timestamp()
               WHERE message_id = ANY(%(ids)s) AND replayed_at IS NOT NULL AND resolved_at IS NULL
                 AND discarded_at IS NULL AND source IN ('inbox', 'broker')"""
        ).format(dl=_t(schema, names.DEAD_LETTERS)),
        {"ids": list(message_ids)},
    )
    return cursor.rowcount


def _ensure_received(registry: Registry, service: str, message_type: str) -> None:
    if message_type not in {s.message_type for s in registry.accepted_types(service)}:
        raise ReplayRefused(f"{service} does not receive {message_type} (check its contract's x-subscribes)")
