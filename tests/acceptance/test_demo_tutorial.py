"""The tutorial works as printed: its files, and every command of its steps 1 to 6, run for real.

The contract, schema and handler module are cut out of docs/tutorial/index.md, and every
command of its shell blocks is run through bash as it is printed there (`psql`, `txbox
migrate`, `txbox check`, `txbox run &`, the senders, `txbox dlq list` and `discard`), in a
database and vhost of this test's own: only the database name and the broker URL are
replaced. What the page says a command prints is checked against what it printed, so
the tutorial cannot rot silently. The web endpoint of docs/how-to/async.md is run too,
on a real uvicorn. Step 7 (`pytest tutorial`) is run by
tests/integration/test_testing_kit.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import psycopg

from tests import support
from txbox_tools.processes import ProcessGroup

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = ROOT / "docs" / "tutorial" / "index.md"
ASYNC = ROOT / "docs" / "how-to" / "async.md"
BIN = Path(sys.executable).parent


def block(text: str, after: str, fence: str) -> str:
    """The first ``fence`` code block following the text ``after``."""
    start = text.index(after)
    match = re.compile(rf"```{fence}\n(.*?)\n```", re.DOTALL).search(text, start)
    assert match, f"no ```{fence} block after {after!r}"
    return match.group(1)


def commands(shell: str) -> list[str]:
    """The commands of a shell block: one a line, a here-document with its lines."""
    found: list[str] = []
    lines = iter(shell.splitlines())
    for line in lines:
        if "<<'PY'" in line:
            body = [line]
            for more in lines:
                body.append(more)
                if more == "PY":
                    break
            found.append("\n".join(body))
        elif line.strip():
            found.append(line)
    return found


def masked(output: str) -> str:
    """What a command printed, with what changes from run to run (times, ids) masked."""
    output = re.sub(r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d(:\d\d(\.\d+)?)?Z?", "<time>", output)
    output = re.sub(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", "<id>", output)
    output = re.sub(r"\b[0-9a-f]{12,}\b", "<hex>", output)
    output = re.sub(r"\(at \S+", "(at <where>", output)  # where the handler raised: this test's folder
    return "\n".join(line.rstrip() for line in output.strip().splitlines())


def printed(text: str, after: str) -> str:
    """The ```text block the page shows as what the command block after ``after`` printed."""
    shell_end = text.index("```\n", text.index("```sh", text.index(after)) + 5) + 4
    match = re.compile(r"```text\n(.*?)\n```", re.DOTALL).search(text, shell_end)
    assert match and "```" not in text[shell_end : match.start()], f"no ```text block after the commands of {after!r}"
    return match.group(1)


def test_the_tutorial_runs_as_printed(tmp_path: Path, amqp_url: str) -> None:
    page = TUTORIAL.read_text()
    _write_the_files(page, tmp_path / "tutorial")
    (tmp_path / ".venv").symlink_to(BIN.parent)  # `.venv/bin/txbox` as printed, from this test's folder
    tutorial = _Tutorial(page, tmp_path, support.unique("txbox_tut"), amqp_url)
    sh, outputs = tutorial.sh, tutorial.outputs
    try:
        ran = tutorial.step("**3. Database")
        assert any("CREATE DATABASE" in c for c in ran) and any("txbox migrate" in c for c in ran), ran
        check = next(c for c in ran if "txbox check" in c)
        assert "0 error(s)" in outputs[check]

        send, select = commands(block(page, "**4. Send a command**", "sh"))
        sh(send)
        support.wait_until(lambda: "Ada" in sh(select), timeout=60, message="the greeting handled")
        assert " Ada" in outputs[select] and "(1 row)" in outputs[select]

        refuse, listing = commands(block(page, "**5. The first dead letter**", "sh"))
        sh(refuse)
        support.wait_until(lambda: "nobody is not a name" in sh(listing), timeout=60, message="the dead letter")
        assert masked(outputs[listing]) == masked(printed(page, "**5. The first dead letter**"))
        with psycopg.connect(support.db_url(tutorial.database, "postgresql")) as conn:
            assert conn.execute("SELECT name FROM greetings").fetchall() == [("Ada",)]  # nobody was not greeted

        (discard,) = commands(block(page, "not want with", "sh"))
        sh(discard)
        assert masked(outputs[discard]) == masked(printed(page, "not want with"))

        _post_from_the_web(tutorial)
        support.wait_until(lambda: "Grace" in sh(select), timeout=60, message="the web greeting handled")

        # Step 6: `kill %1` is a SIGTERM; the service finishes what it holds and exits 0.
        run = tutorial.group.daemons[0]
        run.process.send_signal(signal.SIGTERM)
        assert run.process.wait(timeout=60) == 0, run.log_tail()
    finally:
        tutorial.group.stop_all()
        support.drop_database(tutorial.database)


def _write_the_files(page: str, folder: Path) -> None:
    """The tutorial's contract, schema and handler, and the async how-to's web endpoint, as the pages show them."""
    (folder / "contracts" / "commands").mkdir(parents=True)
    (folder / "contracts" / "greeter-service.yml").write_text(block(page, "**1. The contract**", "yaml"))
    (folder / "contracts" / "commands" / "send-greeting.json").write_text(block(page, "send-greeting.json`:", "json"))
    (folder / "__init__.py").write_text("")
    (folder / "app.py").write_text(block(page, "**2. The handler**", "python"))
    (folder / "web.py").write_text(block(ASYNC.read_text(), "## From a web endpoint", "python"))


class _Tutorial:
    """Runs the page's commands from ``tmp_path`` as printed, on this test's database and broker."""

    BROKER = "amqp://guest:guest@127.0.0.1:5672/%2F"

    def __init__(self, page: str, tmp_path: Path, database: str, amqp_url: str) -> None:
        self.page, self.tmp_path, self.database, self.amqp_url = page, tmp_path, database, amqp_url
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TXBOX_")} | {"PYTHONPATH": str(tmp_path)}
        self.group = ProcessGroup(tmp_path / "logs", env={})
        self.outputs: dict[str, str] = {}

    def ours(self, command: str) -> str:
        # The page's database (`greeter`, not `greeter-service`) and broker, made this test's own.
        return re.sub(r"\bgreeter\b(?!-)", self.database, command).replace(self.BROKER, self.amqp_url)

    def sh(self, command: str) -> str:
        result = subprocess.run(
            ["bash", "-c", self.ours(command)], cwd=self.tmp_path, env=self.env, capture_output=True, text=True,
            timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, f"{command}\n{result.stdout}{result.stderr}"
        self.outputs[command] = result.stdout
        return result.stdout

    def step(self, after: str) -> list[str]:
        ran = []
        for command in commands(block(self.page, after, "sh")):
            if command.startswith("export "):
                name, _, value = command.removeprefix("export ").partition("=")
                self.env[name] = self.ours(shlex.split(value)[0])
            elif command.split("#")[0].rstrip().endswith("&"):
                # `txbox run ... &`: started in the background as printed, stopped with SIGTERM as `kill %1` does.
                words = shlex.split(command.split("#")[0].rstrip().rstrip("&"))
                assert words[0] == ".venv/bin/txbox", command
                self.group.env = {k: v for k, v in self.env.items() if k.startswith(("TXBOX_", "PYTHON"))}
                self.group.start("run", words[1:], cwd=self.tmp_path)
            else:
                self.sh(command)
            ran.append(command)
        return ran


def _post_from_the_web(tutorial: _Tutorial) -> None:
    """The web endpoint of the async how-to, on a real uvicorn beside the running service, takes a greeting."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    web = tutorial.group.start(
        "web",
        ["-m", "uvicorn", "tutorial.web:app", "--port", str(port)],
        cwd=tutorial.tmp_path,
        program=[sys.executable],
    )
    request = urllib.request.Request(f"http://127.0.0.1:{port}/greetings", data=b'{"name": "Grace"}')

    def posted() -> int:
        assert web.alive, web.log_tail()
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                return int(response.status)
        except urllib.error.URLError:
            return 0  # not listening yet

    assert support.wait_until(posted, timeout=60, message="the web endpoint answered") == 202
