"""`--history N`: the history rows are the bench's own rows, in its own mix (txbox_tools.bench.history).

Rows longer than the ones the bench writes would leave on each old page a leftover that
fits a new row, so the measurement would read and dirty old pages on every insert
(docs/architecture.md, "The tables"): the fill's shape is part of what it measures.
"""

from __future__ import annotations

import psycopg

from framework import names
from framework.db import conninfo
from txbox_tools.bench import history

SHAPES = [
    history.Shape("Ping", "ping", "command", "bench.ping.send", {"n": 0, "echo": True}),
    history.Shape("Ponged", "ping", "event", "bench.ping.ponged", {"n": 0}),
]


def test_history_rows_repeat_the_benches_shapes_with_their_own_numbers(database_url: str) -> None:
    for table in (names.OUTBOX, names.INBOX):
        history.prefill(database_url, table, 100, SHAPES, queue="bench:inbox")
    with psycopg.connect(conninfo(database_url)) as conn:
        outbox = conn.execute(
            "SELECT message_type, kind, routing_key, payload, aggregate_id, segment, metadata FROM txbox.outbox "
            "ORDER BY created_at LIMIT 2"
        ).fetchall()
        inbox = conn.execute(
            "SELECT id::text, message_type, payload, metadata FROM txbox.inbox WHERE archived_at IS NULL "
            "ORDER BY created_at LIMIT 2"
        ).fetchall()
    # i = 1 takes the second shape, i = 2 the first: the mix alternates.
    assert outbox == [
        ("Ponged", "event", "bench.ping.ponged", {"n": 1}, "h-1", "ping:h-1", {}),
        ("Ping", "command", "bench.ping.send", {"n": 2, "echo": True}, "h-2", "ping:h-2", {}),
    ]
    # The inbox keeps the delivery record the receiver writes, naming the row's own id.
    (first_id, first_type, first_payload, first_delivery), _ = inbox
    assert (first_type, first_payload) == ("Ping", {"n": 2, "echo": True})
    assert first_delivery["properties"]["message_id"] == first_id
    assert first_delivery["properties"]["type"] == "Ping"
    assert first_delivery["fields"] == {
        "exchange": "command",
        "routing_key": "bench.ping.send",
        "delivery_tag": 2,
        "redelivered": False,
    }
