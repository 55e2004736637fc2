"""Fixtures of the pending tests: an autocommit connection and rows in any state."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from framework import names
from framework.db import conninfo

TOKEN = "eyJhbGciOiJIUzI1NiJ9.cGVuZGluZy11c2Vy.c2lnbmF0dXJlLXBlbmRpbmc"
SECRET_PAYLOAD = {"customer": "ada", "password": "hunter2-pending", "card": {"api_key": "k-9f8e7d6c5b"}}
SECRETS = (TOKEN, "hunter2-pending", "k-9f8e7d6c5b", "s3cr3t-in-error")


@pytest.fixture
def conn(database_url: str) -> Iterator[psycopg.Connection[Any]]:
    with psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row) as c:
        yield c


def put(
    conn: psycopg.Connection[Any],
    table: str = names.INBOX,
    *,
    message_type: str = "PlaceOrder",
    segment: str | None = None,
    payload: dict[str, Any] | None = None,
    priority: int = 0,
    age: float = 1.0,
    lease: float = -1.0,
    started: int = 0,
    finished: int = 0,
    last_error: str | None = None,
    processed: bool = False,
) -> uuid.UUID:
    """One row as the daemons leave it: written ``age`` seconds ago, ``locked_until`` at
    now + ``lease`` seconds, the attempt counters and error given, auth_token in metadata."""
    mid = uuid.uuid4()
    row: dict[str, Any] = {
        "id": mid,
        "message_type": message_type,
        "aggregate_type": "order",
        "aggregate_id": mid.hex[:8],
        "kind": "command",
        "routing_key": "order-service.order.place",
        "payload": json.dumps(payload if payload is not None else {"customer": "ada"}),
        "metadata": json.dumps({"auth_token": TOKEN}),
        "segment": segment or f"order:{mid.hex[:8]}",
        "priority": priority,
        "started_attempts": started,
        "finished_attempts": finished,
        "last_error": last_error,
    }
    if table == names.INBOX:
        row.update(message_timestamp="2026-01-01T00:00:00Z", queue="order-service:inbox")
    conn.execute(
        sql.SQL(
            "INSERT INTO {t} ({cols}, created_at, locked_until, processed_at) VALUES ({vals}, "
            "now() - make_interval(secs => %(age)s), now() + make_interval(secs => %(lease)s), "
            "CASE WHEN %(processed)s THEN now() END)"
        ).format(
            t=sql.Identifier("txbox", table),
            cols=sql.SQL(", ").join(map(sql.Identifier, row)),
            vals=sql.SQL(", ").join(map(sql.Placeholder, row)),
        ),
        {**row, "age": age, "lease": lease, "processed": processed},
    )
    return mid
