"""The inbox INSERT (framework/sql/inbox.py): the batch travels as one JSON parameter.

Every field of an :class:`InboxRow` must land in its own column unchanged, whatever its
text holds (quotes, backslashes, text that looks like JSON or like the batch's own
brackets), and a row PostgreSQL refuses must fail its statement, never shift into a
neighbour's values.
"""

from __future__ import annotations

import uuid
from dataclasses import fields, replace
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import psycopg
import pytest

from framework.db import conninfo
from framework.sql import inbox as inbox_sql
from framework.sql.inbox import InboxRow, insert_rows

_HOSTILE = '"],["x", 1, {"a": [\\"b\\"]}, \\\\, \\u0041, é €, 😀, \t\n'


def _row(n: int, **overrides: Any) -> InboxRow:
    values: dict[str, Any] = {
        "id": uuid.uuid4(),
        "message_type": "PlaceOrder",
        "aggregate_type": "order",
        "aggregate_id": f"agg-{n}",
        "message_version": "",
        "kind": "command",
        "routing_key": "order-service.order.place",
        "payload": '{"quantity": 1, "sku": "SKU-1", "nested": {"a": [1, 2.5, null, true]}}',
        "message_context": "{}",
        "metadata": '{"properties": {"headers": {}}}',
        "segment": f"order:{n}",
        "concurrency": "sequential",
        "priority": 0,
        "message_timestamp": datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        "queue": "order-service:inbox",
        "redelivered": False,
    }
    values.update(overrides)
    return InboxRow(**values)


def _stored(database_url: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, InboxRow]:
    names = [f.name for f in fields(InboxRow)]
    json_columns = {"payload", "message_context", "metadata"}
    select = ", ".join(f"{n}::text" if n in json_columns else n for n in names)
    with psycopg.connect(conninfo(database_url)) as conn:
        rows = conn.execute(f"SELECT {select} FROM txbox.inbox WHERE id = ANY(%s)", (ids,)).fetchall()
    return {row[0]: InboxRow(**dict(zip(names, row, strict=True))) for row in rows}


def _jsonb_text(database_url: str, text: str) -> str:
    with psycopg.connect(conninfo(database_url)) as conn:
        return str(conn.execute("SELECT %s::jsonb::text", (text,)).fetchone()[0])  # type: ignore[index]


def test_every_field_lands_in_its_column_unchanged(database_url: str) -> None:
    rows = [
        _row(0),
        _row(
            1,
            message_type=_HOSTILE,
            aggregate_type=_HOSTILE,
            aggregate_id=_HOSTILE,
            message_version=_HOSTILE,
            routing_key=_HOSTILE,
            payload='{"text": "' + '\\"],[\\"x\\", 1, \\\\' + '", "n": 12345678901234567890}',
            message_context='{"k": "\\u00e9\\ud83d\\ude00"}',
            metadata='{"properties": {"headers": {"x": ["]", "["]}}}',
            segment=_HOSTILE,
            concurrency="parallel",
            priority=-32768,
            message_timestamp=datetime(1999, 12, 31, 23, 59, 59, tzinfo=timezone(timedelta(hours=-5))),
            queue=_HOSTILE,
            redelivered=True,
        ),
        _row(2, priority=32767, message_timestamp=datetime(2026, 6, 1, tzinfo=UTC)),
    ]
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        assert insert_rows(cur, "txbox", rows) == {r.id for r in rows}
    stored = _stored(database_url, [r.id for r in rows])
    for row in rows:
        expected = replace(
            row,
            payload=_jsonb_text(database_url, row.payload),
            message_context=_jsonb_text(database_url, row.message_context),
            metadata=_jsonb_text(database_url, row.metadata),
        )
        assert stored[row.id] == expected


def test_duplicates_are_not_new_and_the_first_of_a_batch_wins(database_url: str) -> None:
    first = _row(0)
    again = replace(first, aggregate_id="other")
    fresh = _row(1)
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        assert insert_rows(cur, "txbox", [first]) == {first.id}
        conn.commit()
        assert insert_rows(cur, "txbox", [again, fresh, fresh]) == {fresh.id}
    assert _stored(database_url, [first.id])[first.id].aggregate_id == "agg-0"


def test_a_batch_too_large_for_one_jsonb_value_goes_in_parts_and_the_first_still_wins(
    database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch past jsonb's limit (here a small stand-in for 256 MB) is stored whole, in parts."""
    monkeypatch.setattr(inbox_sql, "MAX_BATCH_CHARS", 1_000)  # a row is about 500 characters
    rows = [_row(n) for n in range(7)]
    again = replace(rows[1], aggregate_id="later")

    class Counting:
        """The cursor, counting its statements."""

        def __init__(self, cur: psycopg.Cursor[Any]) -> None:
            self.cur, self.statements = cur, 0

        def execute(self, *args: Any) -> None:
            self.statements += 1
            self.cur.execute(*args)

        def fetchall(self) -> list[Any]:
            return self.cur.fetchall()

    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        counting = Counting(cur)
        assert insert_rows(counting, "txbox", [*rows, again]) == {row.id for row in rows}  # type: ignore[arg-type]
    assert counting.statements > 1
    stored = _stored(database_url, [row.id for row in rows])
    # Every row stored once, and the duplicate in a later part did not win.
    assert {i: r.aggregate_id for i, r in stored.items()} == {row.id: row.aggregate_id for row in rows}


@pytest.mark.parametrize(
    "bad",
    [
        {"payload": '{"a": "\\u0000"}'},  # jsonb refuses NUL
        {"payload": '{"a": 1}, "x"'},  # not one JSON value: refused, never spread over the next columns
        {"aggregate_id": "nul\x00"},
        {"aggregate_id": "lone \ud800 surrogate"},
        {"priority": 40_000},
    ],
)
def test_a_row_postgresql_refuses_fails_its_statement(database_url: str, bad: dict[str, Any]) -> None:
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        with pytest.raises((psycopg.DataError, TypeError, ValueError)):
            insert_rows(cur, "txbox", [_row(0), _row(1, **bad)])
        conn.rollback()
        count = cur.execute("SELECT count(*) FROM txbox.inbox").fetchone()
    assert count == (0,)
