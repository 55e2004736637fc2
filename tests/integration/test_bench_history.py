"""`--history N`: the history rows repeat the bench's own finished rows (txbox_tools.bench.history).

Rows longer than the ones the bench writes would leave on each old page a leftover that
fits a new row, so the measurement would read and dirty old pages on every insert
(docs/explanation/how-it-works.md, "The tables"): the fill's shape is part of what it measures.
"""

from __future__ import annotations

import uuid
from collections import Counter
from typing import Any

import psycopg

from framework import ids, names
from framework.db import conninfo
from txbox_tools.bench import history

TEMPLATE = """
INSERT INTO txbox.{table} (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
                           message_context, metadata, segment, processed_at{inbox_columns})
VALUES (%(id)s, %(type)s, 'ping', %(aggregate)s, 'event', 'bench.ping.' || %(type)s, %(payload)s,
        %(context)s, %(metadata)s, 'ping:' || %(aggregate)s, {processed}{inbox_values})
"""


def _write(conn: psycopg.Connection[Any], table: str, n: int, *, processed: bool = True) -> None:
    message_id = ids.message_id()
    inbox = table == names.INBOX
    metadata = {"properties": {"message_id": str(message_id), "type": f"T{n}"}, "fields": {"delivery_tag": n}}
    conn.execute(
        TEMPLATE.format(
            table=table,
            processed="now()" if processed else "NULL",
            inbox_columns=", queue, message_timestamp" if inbox else "",
            inbox_values=", 'bench:inbox', now()" if inbox else "",
        ),
        {
            "id": message_id,
            "type": f"T{n}",
            "aggregate": f"p{n}",
            "payload": psycopg.types.json.Jsonb({"n": n, "pad": "x" * n}),
            "context": psycopg.types.json.Jsonb({"correlation_id": f"c{n}"}),
            "metadata": psycopg.types.json.Jsonb(metadata if inbox else {}),
        },
    )


def _kept(row: dict[str, Any]) -> dict[str, Any]:
    """A row's columns that its template gives (the delivery record's message id aside)."""
    kept = {k: v for k, v in row.items() if k not in history.OWN_COLUMNS}
    if "properties" in kept["metadata"]:
        kept["metadata"] = {**kept["metadata"], "properties": {**kept["metadata"]["properties"], "message_id": ""}}
    return kept


def test_history_rows_repeat_the_benches_own_finished_rows(database_url: str) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        for table in (names.OUTBOX, names.INBOX):
            for n in range(3):
                _write(conn, table, n)
            _write(conn, table, 99, processed=False)  # pending: not history's to repeat
    samples = {table: history.sample(database_url, table) for table in (names.OUTBOX, names.INBOX)}
    for table, templates in samples.items():
        assert sorted(t["message_type"] for t in templates) == ["T0", "T1", "T2"], table
        assert not set(history.OWN_COLUMNS) & set(templates[0])
        history.prefill(database_url, table, 100, templates)
    with psycopg.connect(conninfo(database_url)) as conn:
        for table, templates in samples.items():
            rows = [
                r[0]
                for r in conn.execute(
                    f"SELECT to_jsonb(t) FROM txbox.{table} t WHERE created_at < now() - interval '{history.AGE}'"
                )
            ]
            assert len(rows) == 100, f"{table}: every history row older than the bench's own"
            # Each row repeats a template whole, and the mix is the sample's: each in turn.
            finished = [r for r in rows if r.get("archived_at") is None]
            expected = [_kept(t) for t in templates]
            assert all(_kept(r) in expected for r in finished), table
            assert sorted(Counter(r["message_type"] for r in rows).values()) == [33, 33, 34], table
            assert len({r["id"] for r in rows}) == 100
            assert {uuid.UUID(r["id"]).version for r in rows} == {7}
            assert sum(r["abandoned_at"] is not None for r in rows) == 2, "2 % abandoned"
            assert all(r["processed_at"] is not None for r in rows if r["abandoned_at"] is None)
            letters = conn.execute(
                "SELECT count(*) FROM txbox.dead_letters WHERE source = %s AND fingerprint = 'history'",
                ("outbox" if table == names.OUTBOX else "inbox",),
            ).fetchone()
            assert letters == (2,)
        inbox = [
            r[0]
            for r in conn.execute(
                f"SELECT to_jsonb(t) FROM txbox.inbox t WHERE created_at < now() - interval '{history.AGE}'"
            )
        ]
    # The inbox's delivery record names the row's own id; its tombstones are stripped as archive strips them.
    live = [r for r in inbox if r["archived_at"] is None]
    assert all(r["metadata"]["properties"]["message_id"] == r["id"] for r in live)
    tombstones = [r for r in inbox if r["archived_at"] is not None]
    assert len(tombstones) == 2
    assert all((t["payload"], t["message_context"]) == ({}, {}) for t in tombstones)
    assert all(set(t["metadata"]) == {"payload_sha256"} for t in tombstones)
