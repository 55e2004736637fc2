"""`txbox outbox list` / `txbox inbox list` in-process, against the real database."""

from __future__ import annotations

import json
from typing import Any

import pytest

from framework import names
from framework.cli import main
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed
from tests.integration.pending.conftest import SECRET_PAYLOAD, SECRETS, TOKEN, put


def cli(database_url: str, table: str, *args: str) -> list[str]:
    service = ["--service", "order-service", "--database-url", database_url, "--contracts-dir", str(CONTRACTS)]
    return [table, "list", *service, *args]


def test_table_filters_and_summary(database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]) -> None:
    failing = put(conn, started=1, finished=1, lease=30, last_error="KeyError: 'price'", age=7200, segment="order:o-1")
    due = put(conn, age=90, segment="order:o-2", message_type="CancelOrder")
    put(conn, processed=True)

    assert main(cli(database_url, "inbox")) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ID", "AGE", "STATE", "TYPE", "SEGMENT", "ATTEMPTS", "UNTIL", "LAST", "ERROR"]
    assert lines[1].split()[:6] == [str(failing), "2h", "failing", "PlaceOrder", "order:o-1", "1"]
    assert "KeyError: 'price'" in lines[1] and lines[1].split()[6] == "in"  # the backoff still holds it
    assert lines[2].split()[:5] == [str(due), "1m30s", "due", "CancelOrder", "order:o-2"]
    assert lines[3] == "(2 shown; 2 pending in the inbox: 1 failing, 1 due)"

    for args, expected in (
        (["--type", "CancelOrder"], [due]),
        (["--segment", "order:o-1"], [failing]),
        (["--state", "failing"], [failing]),
        (["--state", "leased"], []),
        (["--older-than", "1h"], [failing]),
        (["--older-than", "3h"], []),
        (["--limit", "1"], [failing]),
    ):
        assert main(cli(database_url, "inbox", *args, "--json")) == 0
        assert [json.loads(line)["id"] for line in capsys.readouterr().out.splitlines()] == [
            str(m) for m in expected
        ], args

    assert main(cli(database_url, "outbox")) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "(0 shown; 0 pending in the outbox)"


def test_parked_needs_the_park_policy(database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]) -> None:
    m = seed.envelope()
    seed.abandoned(conn, names.INBOX, m)
    behind = put(conn, segment=f"order:{m.aggregate_id}")
    assert main(cli(database_url, "inbox", "--state", "parked", "--segment-policy", "park", "--json")) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == [str(behind)]
    assert main(cli(database_url, "inbox", "--state", "parked", "--json")) == 0  # default policy: proceed
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize("table", [names.OUTBOX, names.INBOX])
def test_secrets_are_masked_as_in_dead_letters(
    database_url: str, conn: Any, table: str, capsys: pytest.CaptureFixture[str]
) -> None:
    put(conn, table, payload=SECRET_PAYLOAD, started=1, finished=1, last_error="401: token=s3cr3t-in-error refused")
    assert main(cli(database_url, table, "--json")) == 0
    out = capsys.readouterr().out
    row = json.loads(out)
    assert row["payload"]["customer"] == "ada"  # the message itself stays readable
    assert row["payload"]["password"].startswith("•••• (masked")
    assert row["payload"]["card"]["api_key"].startswith("•••• (masked")
    assert row["metadata"]["auth_token"] == f"•••• (masked, {len(TOKEN)} chars)"
    assert row["last_error"] == "401: token=[redacted] refused"
    assert main(cli(database_url, table)) == 0
    out += capsys.readouterr().out
    assert not [s for s in SECRETS if s in out]


def test_terminal_output_escapes_control_characters(
    database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    put(conn, started=1, finished=1, last_error="boom\x1b[2J\x1b]0;owned\x07 \u202eevil")
    assert main(cli(database_url, "inbox")) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\\x1b[2J" in out


@pytest.mark.parametrize(
    ("args", "complaint"),
    [
        (["--older-than", "10x"], "'10x' is not an age: give a duration like 90s, 10m, 2h or 7d"),
        (["--limit", "0"], "the limit is a number from 1 to 1000"),
        (["--limit", "lots"], "the limit is a number from 1 to 1000"),
        (["--state", "stuck"], "invalid choice: 'stuck'"),
    ],
)
def test_bad_filters_fail_with_a_clear_error(
    database_url: str, args: list[str], complaint: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(cli(database_url, "inbox", *args))
    assert exit_.value.code == 2 and complaint in capsys.readouterr().err


def test_filters_are_bound_parameters(database_url: str, conn: Any, capsys: pytest.CaptureFixture[str]) -> None:
    put(conn)
    for evil in ("x' OR '1'='1", "'; DROP TABLE txbox.inbox; --"):
        assert main(cli(database_url, "inbox", "--type", evil, "--json")) == 0
        assert main(cli(database_url, "inbox", "--segment", evil, "--json")) == 0
        assert capsys.readouterr().out == ""
    assert main(cli(database_url, "inbox", "--json")) == 0
    assert len(capsys.readouterr().out.splitlines()) == 1
