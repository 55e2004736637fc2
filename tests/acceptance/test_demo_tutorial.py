"""The README's 5-minute tutorial works as printed: its files and snippets, run for real.

The contract, schema, handler module and the sending snippet are cut out of README.md
and executed with the real `txbox` command (`check`, `run`) in a database and vhost of
this test's own, so the tutorial cannot rot silently.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import psycopg

from tests import support
from txbox_tools.processes import ProcessGroup, txbox_command

README = Path(__file__).resolve().parents[2] / "README.md"


def block(text: str, after: str, fence: str) -> str:
    """The first ``fence`` code block following the heading text ``after``."""
    start = text.index(after)
    match = re.compile(rf"```{fence}\n(.*?)\n```", re.DOTALL).search(text, start)
    assert match, f"no ```{fence} block after {after!r}"
    return match.group(1)


def test_tutorial_from_the_readme(tmp_path: Path, database_url: str, amqp_url: str) -> None:
    readme = README.read_text()
    tutorial = readme[readme.index("## Tutorial") :]
    folder = tmp_path / "tutorial"
    (folder / "contracts" / "commands").mkdir(parents=True)
    (folder / "contracts" / "greeter-service.yml").write_text(block(tutorial, "**1. The contract**", "yaml"))
    (folder / "contracts" / "commands" / "send-greeting.json").write_text(
        block(tutorial, "send-greeting.json`:", "json")
    )
    (folder / "__init__.py").write_text("")
    (folder / "app.py").write_text(block(tutorial, "**2. The handler**", "python"))
    shell = block(tutorial, "**4. Send a command**", "sh")
    sender = shell[shell.index("<<'PY'\n") + 7 : shell.index("\nPY")]
    setup = block(tutorial, "**3. Database", "sh")
    create_table = re.search(r"-c '(CREATE TABLE greetings[^']*)'", setup)
    assert create_table, "the tutorial creates the greetings table"
    with psycopg.connect(database_url.replace("+psycopg", ""), autocommit=True) as conn:
        conn.execute(create_table.group(1))

    env = {
        **os.environ,
        "TXBOX_SERVICE": "greeter-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_CONTRACTS_DIR": "tutorial/contracts",
        "TXBOX_AMQP_URL": amqp_url,
        "PYTHONPATH": str(tmp_path),
    }
    check = subprocess.run(
        [*txbox_command(), "check", "--app", "tutorial.app:service"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "0 error(s)" in check.stdout

    group = ProcessGroup(tmp_path / "logs", env={k: v for k, v in env.items() if k.startswith(("TXBOX_", "PYTHON"))})
    group.start("run", ["run", "--app", "tutorial.app:service"], cwd=tmp_path)
    try:
        sent = subprocess.run(
            [sys.executable, "-c", sender], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60,
            check=False,
        )  # fmt: skip
        assert sent.returncode == 0, sent.stderr

        def greeted() -> list[tuple[str]]:
            with psycopg.connect(database_url.replace("+psycopg", "")) as conn:
                return conn.execute("SELECT name FROM greetings").fetchall()

        assert support.wait_until(greeted, timeout=60, message="the greeting handled") == [("Ada",)], group.daemons[
            0
        ].log_tail()
    finally:
        group.stop_all()
    run = group.daemons[0]
    assert run.process.returncode == 0, run.log_tail()
