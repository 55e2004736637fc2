"""`txbox dlq list / show / replay / discard` in-process, against the real database."""

from __future__ import annotations

import json
from typing import Any

import pytest

from framework.cli import main
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed


def dlq(database_url: str, *args: str) -> list[str]:
    return [
        "dlq",
        "--service",
        "order-service",
        "--database-url",
        database_url,
        "--contracts-dir",
        str(CONTRACTS),
        *args,
    ]


def test_list_show_replay_discard(database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]) -> None:
    m = seed.envelope(customer="alice")
    a = seed.abandoned(conn, "inbox", m, error="KeyError: 'price'")
    b = seed.abandoned(conn, "inbox", seed.envelope(), error="KeyError: 'price'")
    c = seed.rejected(conn, None, raw=b"garbage")

    assert main(dlq(database_url, "list")) == 0
    out = capsys.readouterr().out
    assert "(3 of 3 open dead letters)" in out and "max_attempts" in out and "not_json" in out

    assert main(dlq(database_url, "list", "--groups")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "2" and "KeyError" in lines[1]

    assert main(dlq(database_url, "list", "--reason", "not_json", "--json")) == 0
    assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [c]

    assert main(dlq(database_url, "show", str(a))) == 0
    out = capsys.readouterr().out
    # The token was dropped before the letter was stored (framework.redaction): nothing to mask.
    assert '"customer": "alice"' in out and m.auth_token not in out  # type: ignore[operator]

    assert main(dlq(database_url, "replay", str(a), "--dry-run")) == 0
    assert "would replay: 1 of 1 (dry run" in capsys.readouterr().out
    assert (
        conn.execute("SELECT replay_count FROM txbox.dead_letters WHERE id = %s", (a,)).fetchone()["replay_count"] == 0
    )

    fp = conn.execute("SELECT fingerprint FROM txbox.dead_letters WHERE id = %s", (a,)).fetchone()["fingerprint"]
    assert main(dlq(database_url, "replay", "--fingerprint", fp)) == 0
    out = capsys.readouterr().out
    assert f"{a}: inbox-reset" in out and f"{b}: inbox-reset" in out and "replayed: 2 of 2" in out

    assert main(dlq(database_url, "replay", str(c))) == 1  # a raw body cannot be replayed: exit 1, says why
    assert "refused" in capsys.readouterr().out
    assert main(dlq(database_url, "discard", str(c))) == 0
    assert main(dlq(database_url, "list", "--status", "discarded", "--json")) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines() if x.startswith("{")] == [c]

    # A replayed letter whose message has not run yet: discarding it takes the replay back.
    assert main(dlq(database_url, "discard", str(a))) == 0
    assert f"{a}: discarded: replay taken back" in capsys.readouterr().out
    pending = "SELECT count(*) AS n FROM txbox.inbox WHERE id = %s AND abandoned_at IS NULL"
    assert conn.execute(pending, (m.message_id,)).fetchone()["n"] == 0


def test_filters_are_bound_parameters(database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]) -> None:
    seed.abandoned(conn, "inbox", seed.envelope())
    for evil in ("x' OR '1'='1", "'; DROP TABLE txbox.dead_letters; --", "PlaceOrder\\' OR 1=1 --"):
        assert main(dlq(database_url, "list", "--type", evil, "--json")) == 0
        assert capsys.readouterr().out == ""
        assert main(dlq(database_url, "list", "--message-id", evil, "--json")) == 0
        assert capsys.readouterr().out == ""
    assert conn.execute("SELECT count(*) AS n FROM txbox.dead_letters").fetchone()["n"] == 1


def test_replay_without_selection_fails_with_the_fix(database_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(dlq(database_url, "replay")) == 2
    assert "give dead-letter ids or a filter" in capsys.readouterr().err
