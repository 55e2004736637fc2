"""The row codecs of framework/sql name real columns of the tables the migrations build."""

from __future__ import annotations

from dataclasses import fields

import pytest
from sqlalchemy import Table

from framework import names, tables
from framework.sql import dead_letters, inbox, outbox, rendered


@pytest.mark.parametrize(
    ("table", "columns"),
    [
        (tables.outbox, outbox.COLUMNS),
        (tables.inbox, tuple(f.name for f in fields(inbox.InboxRow))),
        (tables.inbox, inbox.CLAIM_COLUMNS),
        (tables.dead_letters, dead_letters.COLUMNS),
    ],
)
def test_every_column_a_statement_names_is_in_its_table(table: Table, columns: tuple[str, ...]) -> None:
    assert set(columns) - set(table.c.keys()) == set()


def test_the_outbox_insert_writes_every_column_a_writer_sets() -> None:
    # Left to their defaults: what the relay and the worker set later.
    later = {"created_at", "started_attempts", "finished_attempts", "processed_at", "abandoned_at", "last_error"}
    assert set(outbox.COLUMNS) == set(tables.outbox.c.keys()) - later
    text = outbox.insert_text("txbox")
    assert text.count("$") == len(outbox.COLUMNS) and "COALESCE($14::timestamptz, clock_timestamp())" in text


@pytest.mark.parametrize("schema", ["txbox", "orders_2", "_x"])
def test_statements_rendered_once_are_the_bytes_every_client_encoding_sends(schema: str) -> None:
    # The daemons render their per-batch statements once, without a connection
    # (framework.sql.rendered): right only while every name in them is ASCII.
    assert names.valid_schema(schema)
    claims = (outbox.claim(schema), inbox.claim(schema, suspects=False, park=True))
    for statement in (inbox.insert_sql(schema), *map(rendered, claims)):
        assert statement.isascii() and f'"{schema}".'.encode() in statement


@pytest.mark.parametrize("schema", ["Txbox", "tx-box", "txbox\n", "schéma", "1x", ""])
def test_a_schema_name_outside_lower_case_ascii_is_refused(schema: str) -> None:
    assert not names.valid_schema(schema)


@pytest.mark.parametrize("service", ["orders\n", "Orders", "-orders", ""])
def test_a_service_id_with_a_final_newline_or_outside_its_alphabet_is_refused(service: str) -> None:
    # It names queues, connections and metric labels; re.match with $ let "orders\n" through.
    assert not names.valid_service_id(service) and names.valid_service_id("orders-2_b")
