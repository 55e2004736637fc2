"""Dead letters as the receiver, worker and publisher write them, for the dead-letter tests."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

from framework import dead_letters, migrate, names
from framework.envelope import Message
from framework.reasons import Reason
from framework.sql import dead_letters as dead_letters_sql

SCHEMA = "txbox"


def envelope(
    *,
    message_id: uuid.UUID | None = None,
    customer: str = "c-1",
    quantity: int = 1,
    auth_token: str | None = "eyJhbGciOiJIUzI1NiJ9.eyJ0ZW5hbnQiOiJ0MSJ9.c2VjcmV0LXNpZ25hdHVyZQ",
) -> Message:
    return Message(
        message_id=message_id or uuid.uuid4(),
        message_type="PlaceOrder",
        aggregate_type="order",
        aggregate_id=str(uuid.uuid4())[:8],
        payload={"customer": customer, "sku": "SKU-1", "quantity": quantity},
        message_context={"example_correlation_id": str(uuid.uuid4())},
        timestamp=datetime.now(UTC),
        auth_token=auth_token,
    )


def insert_letter(conn: psycopg.Connection[Any], letter: dead_letters.DeadLetter, *, schema: str = SCHEMA) -> int:
    row = conn.execute(sql.SQL("{} RETURNING id").format(dead_letters_sql.insert_sql(schema)), letter.row()).fetchone()
    assert row is not None
    return int(row["id"] if isinstance(row, dict) else row[0])


def _message_row(m: Message, table: str) -> dict[str, Any]:
    row = {
        "id": m.message_id,
        "message_type": m.message_type,
        "aggregate_type": m.aggregate_type,
        "aggregate_id": m.aggregate_id,
        "message_version": m.message_version,
        "kind": "command",
        "routing_key": "order-service.order.place",
        "payload": json.dumps(m.payload),
        "message_context": json.dumps(m.message_context),
        "metadata": json.dumps({"auth_token": m.auth_token} if m.auth_token else {}),
        "segment": f"order:{m.aggregate_id}",
    }
    if table == names.INBOX:
        row.update(message_timestamp=m.timestamp, queue="order-service:inbox")
    return row


def abandoned(
    conn: psycopg.Connection[Any],
    table: str,
    m: Message,
    *,
    error: str = "KeyError: 'price'",
    attempts: int = 5,
    schema: str = SCHEMA,
) -> int:
    """An inbox (worker) or outbox (publisher) row abandoned after ``attempts`` plus its
    dead letter, in one transaction as the daemons write them."""
    row = _message_row(m, table)
    cols = list(row)
    with conn.transaction():
        conn.execute(
            sql.SQL(
                "INSERT INTO {t} ({cols}, started_attempts, finished_attempts, abandoned_at, last_error) "
                "VALUES ({vals}, %(n)s, %(n)s, clock_timestamp(), %(error)s)"
            ).format(
                t=sql.Identifier(schema, table),
                cols=sql.SQL(", ").join(map(sql.Identifier, cols)),
                vals=sql.SQL(", ").join(map(sql.Placeholder, cols)),
            ),
            {**row, "n": attempts, "error": error},
        )
        return insert_letter(
            conn,
            dead_letters.DeadLetter(
                source="inbox" if table == names.INBOX else "outbox",
                reason=Reason.MAX_ATTEMPTS if table == names.INBOX else Reason.UNROUTABLE,
                error=error,
                error_type=error.split(":", 1)[0],
                message_id=m.message_id,
                message_type=m.message_type,
                routing_key="order-service.order.place",
                message=m.to_dict(),
                attempts={"started": attempts, "finished": attempts},
            ),
            schema=schema,
        )


def rejected(conn: psycopg.Connection[Any], m: Message | None, *, raw: bytes | None = None) -> int:
    """A delivery the receiver rejected (never stored in the inbox)."""
    with conn.transaction():
        return insert_letter(
            conn,
            dead_letters.DeadLetter(
                source="broker",
                reason=Reason.UNKNOWN_MESSAGE_TYPE if m else "not_json",
                error="no handler deployed yet" if m else "the body is not JSON",
                message_id=m.message_id if m else None,
                message_type=m.message_type if m else None,
                routing_key="order-service.order.place",
                message=m.to_dict() if m else None,
                raw_body=raw,
            ),
        )


GLOBEX = "tenant_globex"  # the second tenant's schema in two_tenants


def two_tenants(conn: psycopg.Connection[Any], database_url: str, folder: Path) -> tuple[dict[str, list[int]], Path]:
    """acme (schema txbox) and globex (schema :data:`GLOBEX`, migrated now) in the test
    database, their dead letters by key; and the registry file listing them, in ``folder``."""
    migrate.upgrade(database_url, GLOBEX)
    acme = [
        abandoned(conn, "inbox", envelope(customer="acme-1"), error="KeyError: 'acme'"),
        abandoned(conn, "inbox", envelope(customer="acme-2"), error="KeyError: 'acme'"),
    ]
    globex = [abandoned(conn, "inbox", envelope(customer="globex-1"), error="ValueError: globex", schema=GLOBEX)]
    path = folder / "tenants.toml"
    path.write_text(f'[tenants.acme]\n\n[tenants.globex]\nschema = "{GLOBEX}"\n')
    return {"acme": acme, "globex": globex}, path


def tenant_state(conn: psycopg.Connection[Any], schema: str) -> list[tuple[Any, ...]]:
    """What a replay or discard would change in ``schema``: the letters and the inbox rows."""
    letters = conn.execute(
        sql.SQL("SELECT id, replay_count, replayed_at, discarded_at FROM {}.dead_letters ORDER BY id").format(
            sql.Identifier(schema)
        )
    ).fetchall()
    inbox = conn.execute(
        sql.SQL("SELECT id, abandoned_at, started_attempts FROM {}.inbox ORDER BY id").format(sql.Identifier(schema))
    ).fetchall()
    return [tuple(r.values()) for r in letters + inbox]
