"""`txbox dlq` with a tenant registry, against the real database: two tenants as two
schemas of one test database, each with its own dead letters; `--tenant` reads and acts
on one, `--all-tenants` lists both with their keys (and a third, unreachable, on its own
line), and the errors of a missing registry, an unknown key and a missing choice."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from framework.cli import main
from tests import support
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed

GLOBEX = seed.GLOBEX


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, database_url: str) -> pytest.MonkeyPatch:
    """The service's environment: its database is the tenants' default (schema per tenant)."""
    for var in ("TXBOX_TENANTS_FILE", "TXBOX_TENANTS_DATABASE_URL", "TXBOX_TENANTS_SCHEMA", "TXBOX_APP"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("TXBOX_SERVICE", "order-service")
    monkeypatch.setenv("TXBOX_CONTRACTS_DIR", str(CONTRACTS))
    monkeypatch.setenv("TXBOX_DATABASE_URL", database_url)
    return monkeypatch


@pytest.fixture
def tenants(tmp_path: Path, database_url: str, conn: Any, env: pytest.MonkeyPatch) -> dict[str, list[int]]:
    """acme (schema txbox) and globex (schema tenant_globex) in the test database, their
    dead letters by key; the registry file in TXBOX_TENANTS_FILE."""
    letters, path = seed.two_tenants(conn, database_url, tmp_path)
    env.setenv("TXBOX_TENANTS_FILE", str(path))
    return letters


def _json_lines(out: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def test_one_tenant_is_listed_shown_and_replayed_alone(
    tenants: dict[str, list[int]], conn: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--tenant", "globex", "--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert [(r["tenant"], r["id"], r["error"]) for r in rows] == [
        ("globex", tenants["globex"][0], "ValueError: globex")
    ]

    assert main(["dlq", "list", "--tenant", "acme"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split()[:2] == ["TENANT", "ID"]
    assert "(2 of 2 open dead letters of tenant acme)" in out and "globex" not in out

    # Ids are each tenant's own: id 1 is globex's letter under --tenant globex.
    (letter,) = tenants["globex"]
    assert main(["dlq", "show", str(letter), "--tenant", "globex"]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].split() == ["tenant", "globex"] and '"customer": "globex-1"' in out
    assert main(["dlq", "show", str(letter), "--tenant", "globex", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tenant"] == "globex"

    acme_before = seed.tenant_state(conn, "txbox")
    globex_before = seed.tenant_state(conn, GLOBEX)
    assert main(["dlq", "replay", str(letter), "--tenant", "globex"]) == 0
    out = capsys.readouterr().out
    assert f"{letter}: inbox-reset" in out and "replayed: 1 of 1 of tenant globex" in out
    assert seed.tenant_state(conn, "txbox") == acme_before  # tenant acme: nothing changed
    assert seed.tenant_state(conn, GLOBEX) != globex_before
    replayed = conn.execute(f"SELECT replay_count FROM {GLOBEX}.dead_letters WHERE id = %s", (letter,)).fetchone()
    assert replayed["replay_count"] == 1

    assert main(["dlq", "discard", str(tenants["acme"][0]), "--tenant", "acme", "--json"]) == 0
    [outcome] = _json_lines(capsys.readouterr().out)
    assert outcome["tenant"] == "acme" and outcome["ok"]
    assert seed.tenant_state(conn, GLOBEX) != globex_before  # still only the replay's change
    assert (
        conn.execute(f"SELECT count(*) AS n FROM {GLOBEX}.dead_letters WHERE discarded_at IS NOT NULL").fetchone()["n"]
        == 0
    )


def test_all_tenants_lists_both_with_their_keys_and_reports_one_that_is_down(
    tenants: dict[str, list[int]], tmp_path: Path, env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["dlq", "list", "--all-tenants", "--json"]) == 0
    rows = _json_lines(capsys.readouterr().out)
    assert sorted((r["tenant"], r["id"]) for r in rows) == sorted(
        [("acme", i) for i in tenants["acme"]] + [("globex", i) for i in tenants["globex"]]
    )
    assert [r["died_at"] for r in rows] == sorted((r["died_at"] for r in rows), reverse=True)  # newest first

    assert main(["dlq", "list", "--all-tenants", "--groups"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:2] == ["TENANT", "COUNT"]
    assert [line.split()[:2] for line in lines[1:]] == [["acme", "2"], ["globex", "1"]]

    assert main(["dlq", "list", "--all-tenants", "--limit", "1", "--offset", "1"]) == 0
    out = capsys.readouterr().out
    assert "(1 of 3 open dead letters in 2 of 2 tenants)" in out

    # A third tenant whose database does not exist: its own line on stderr, the others shown.
    gone = support.db_url(support.unique("txbox_absent"))
    path = tmp_path / "three.toml"
    path.write_text(
        f'[tenants.acme]\n\n[tenants.gone]\ndatabase_url = "{gone}"\n\n[tenants.globex]\nschema = "{GLOBEX}"\n'
    )
    env.setenv("TXBOX_TENANTS_FILE", str(path))
    assert main(["dlq", "list", "--all-tenants"]) == 1
    out = capsys.readouterr()
    assert {line.split()[0] for line in out.out.splitlines()[1:-1]} == {"acme", "globex"}
    assert "in 2 of 3 tenants)" in out.out
    [failure] = out.err.splitlines()
    assert failure.startswith("tenant gone: FAILED: ") and "does not exist" in failure


def test_the_errors_say_what_to_give(
    tenants: dict[str, list[int]],
    database_url: str,
    conn: Any,
    env: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["dlq", "list", "--tenant", "initech"]) == 2
    err = capsys.readouterr().err
    assert "no tenant 'initech'" in err and "Its tenants: acme, globex" in err

    # A registry and no choice: not the default database in silence.
    for action, expected in (("list", "--tenant KEY or --all-tenants"), ("replay", "--tenant KEY (one tenant")):
        assert main(["dlq", action, "1"] if action == "replay" else ["dlq", action]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Its tenants: acme, globex" in err

    before = seed.tenant_state(conn, "txbox"), seed.tenant_state(conn, GLOBEX)
    for action in ("replay", "discard"):
        assert main(["dlq", action, "--all-tenants", "--reason", "max_attempts"]) == 2
        assert "one tenant at a time, never on all of them" in capsys.readouterr().err
    assert main(["dlq", "show", "1", "--all-tenants"]) == 2
    assert "--tenant KEY" in capsys.readouterr().err
    assert (seed.tenant_state(conn, "txbox"), seed.tenant_state(conn, GLOBEX)) == before

    # --database-url names one database: read as it is, the registry aside.
    assert main(["dlq", "--database-url", database_url, "list", "--json"]) == 0
    assert sorted(r["id"] for r in _json_lines(capsys.readouterr().out)) == tenants["acme"]

    env.delenv("TXBOX_TENANTS_FILE")
    for flag in ("--tenant=acme", "--all-tenants"):
        assert main(["dlq", "list", flag]) == 2
        err = capsys.readouterr().err
        assert f"{flag.split('=')[0]} needs a tenant registry" in err
        assert "TXBOX_TENANTS_FILE" in err and "TXBOX_TENANTS_DATABASE_URL" in err


def test_an_unknown_key_lists_at_most_twenty(
    tmp_path: Path, env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "many.toml"
    path.write_text("".join(f'[tenants.t{i:02}]\nschema = "s{i:02}"\n' for i in range(25)))
    env.setenv("TXBOX_TENANTS_FILE", str(path))
    assert main(["dlq", "list", "--tenant", "nope"]) == 2
    err = capsys.readouterr().err
    assert "t00, t01" in err and "t19 and 5 more" in err and "t20" not in err
