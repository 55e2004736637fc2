"""Every writer's letters (receiver, worker, relay) are rows PostgreSQL stores, whatever they hold."""

from __future__ import annotations

import json
import math
import uuid
from typing import Any

import pytest
from psycopg import sql

from framework import dead_letters as dl
from framework import names
from framework.dead_letters import DeadLetter
from framework.sql import dead_letters as dead_letters_sql


def _deep_json(depth: int) -> Any:
    return json.loads("[" * depth + "]" * depth)  # as deep as the envelope parser accepts


HOSTILE: dict[str, dict[str, Any]] = {
    "parser-deep message": {"message": {"payload": _deep_json(900)}},
    "parser-deep headers": {"headers": {"h": _deep_json(900)}, "attempts": {"a": _deep_json(900)}},
    "nul and surrogates": {
        "message": {"p\x00": "\x00\ud800"},
        "headers": {"\x00": ["\udfff"]},
        "message_type": "T\x00",
        "routing_key": "rk\x00\ud800",
        "error": "e\x00\ud800",
    },
    "numbers jsonb refuses": {"message": {"nan": math.nan, "inf": math.inf, "big": 10**5000}},
    "1 MiB body": {"raw_body": b"x" * (1 << 20), "message": {"blob": "y" * (1 << 20)}},
    "binary body": {"raw_body": bytes(range(256)) * 4096},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_letter_is_stored_bounded(conn: Any, case: str) -> None:
    letter = DeadLetter(source="inbox", reason="poison", message_id=uuid.uuid4(), **{"error": "boom", **HOSTILE[case]})
    returning = sql.SQL("{} RETURNING reason, pg_column_size(message) AS m, length(raw_body) AS r, headers")
    row = conn.execute(
        returning.format(dead_letters_sql.insert_sql("txbox")),
        letter.row(),
    ).fetchone()
    assert row["reason"] == "poison"  # stored as itself, not even as the last resort
    assert (row["m"] or 0) <= dl.MESSAGE_LIMIT and (row["r"] or 0) <= 2 * dl.BODY_LIMIT
    if letter.raw_body is not None:
        assert row["headers"][names.BODY_FACTS]["length"] == len(letter.raw_body)
