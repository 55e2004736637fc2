"""The README's 5-minute tutorial works as printed: its files and snippets, run for real.

The contract, schema, handler module and the sending snippet are cut out of README.md
and executed with the real `txbox` command (`check`, `run`) in a database and vhost of
this test's own, so the tutorial cannot rot silently.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
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
    (folder / "web.py").write_text(block(tutorial, "**4b. From a web endpoint", "python"))
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

        # Step 4b: the same command from the web endpoint, on a real uvicorn.
        with contextlib.closing(socket.socket()) as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        web = group.start(
            "web", ["-m", "uvicorn", "tutorial.web:app", "--port", str(port)], cwd=tmp_path, program=[sys.executable]
        )
        request = urllib.request.Request(f"http://127.0.0.1:{port}/greetings", data=b'{"name": "Grace"}')

        def posted() -> int:
            assert web.alive, web.log_tail()
            try:
                with urllib.request.urlopen(request, timeout=30) as response:
                    return response.status
            except urllib.error.URLError:
                return 0  # not listening yet

        assert support.wait_until(posted, timeout=60, message="the web endpoint answered") == 202
        support.wait_until(lambda: ("Grace",) in greeted(), timeout=60, message="the web greeting handled")
    finally:
        group.stop_all()
    run = group.daemons[0]
    assert run.process.returncode == 0, run.log_tail()
