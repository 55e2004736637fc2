"""The README's 25-line example works as printed: its contract loads, its send writes an
outbox row in the business transaction, and its handler stores the greeting when the
message is delivered (framework.testing, as the worker runs it)."""

from __future__ import annotations

import re
import runpy
from pathlib import Path

import psycopg
import pytest

from framework.testing import Harness

README = Path(__file__).resolve().parents[2] / "README.md"


def _block(text: str, fence: str, after: str) -> str:
    match = re.compile(rf"```{fence}\n(.*?)\n```", re.DOTALL).search(text, text.index(after))
    assert match, f"no ```{fence} block after {after!r}"
    return match.group(1)


def test_the_readme_example_sends_and_handles(
    tmp_path: Path, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    readme = README.read_text()
    contract, code = _block(readme, "yaml", "## In 25 lines"), _block(readme, "python", "## In 25 lines")
    assert len(contract.splitlines()) + len(code.splitlines()) <= 35  # the example stays short
    (tmp_path / "contracts").mkdir()
    (tmp_path / "contracts" / "greeter-service.yml").write_text(contract)
    (tmp_path / "app.py").write_text(code)
    plain = database_url.replace("+psycopg", "")
    with psycopg.connect(plain, autocommit=True) as conn:
        conn.execute("CREATE TABLE greetings (name text NOT NULL)")
    monkeypatch.setenv("TXBOX_SERVICE", "greeter-service")
    monkeypatch.setenv("TXBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("TXBOX_CONTRACTS_DIR", str(tmp_path / "contracts"))

    try:
        service = runpy.run_path(str(tmp_path / "app.py"))["service"]  # runs the send too
        with psycopg.connect(plain) as conn:
            sent = conn.execute("SELECT message_type, kind, payload FROM txbox.outbox").fetchall()
        assert sent == [("SendGreeting", "command", {"name": "Ada"})]

        with Harness(service, database_url=database_url) as harness:
            harness.deliver("SendGreeting", aggregate_id="1", payload={"name": "Ada"})
        with psycopg.connect(plain) as conn:
            assert conn.execute("SELECT name FROM greetings").fetchall() == [("Ada",)]
    finally:
        with psycopg.connect(plain, autocommit=True) as conn:
            conn.execute("DROP TABLE greetings")  # the database goes back to the pool
