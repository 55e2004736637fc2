"""`txbox demo` end to end: the README's first command, small, in its own databases and vhost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

from tests import support
from tests.conftest import ROOT
from txbox_tools.processes import txbox_command


def daemons_of(prefix: str) -> list[int]:
    """PIDs of processes whose environment points at the demo's databases (Linux /proc)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue  # gone meanwhile, or not ours
        if b"TXBOX_DATABASE_URL=" in environ and prefix.encode() in environ:
            found.append(int(proc.name))
    return found


def test_demo_runs_the_saga_and_every_check_passes(tmp_path: Path) -> None:
    prefix, vhost = support.unique("txbox_t_demo"), support.unique("txbox-test-demo")
    try:
        argv = [
            *txbox_command(),
            "demo",
            *("--orders", "300", "--window", "150", "--db-prefix", prefix, "--vhost", vhost),
            *("--pg-url", support.PG_ADMIN_URL, "--rabbitmq-api", support.MGMT_URL),
            *("--log-dir", str(tmp_path / "logs"), "--no-analyze", "--no-dashboard", "--json"),
        ]
        done = subprocess.run(
            argv, cwd=ROOT, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=240, check=False
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        summary = json.loads(done.stdout.strip().splitlines()[-1])
        assert summary["orders"] == 300
        assert summary["completed"] + summary["cancelled"] == 300
        assert summary["cancelled"] > 0  # stock is below demand: both outcomes happen
        assert summary["unfinished"] == 0
        assert all(summary["checks"].values()), summary["checks"]
        assert "RESULT: OK" in done.stdout
        assert "stopping the daemons" in done.stdout
        assert daemons_of(prefix) == []  # every daemon it started is gone
    finally:
        for pid in daemons_of(prefix):  # only if the demo failed to stop its own daemons
            os.kill(pid, signal.SIGKILL)
        support.drop_database(f"{prefix}_orders")
        support.drop_database(f"{prefix}_inventory")
        support.delete_vhost(vhost)


def test_demo_stopped_midway_stops_every_daemon(tmp_path: Path) -> None:
    """SIGTERM (or Ctrl-C) in the middle of the run: the demo stops all it started, then exits."""
    prefix, vhost = support.unique("txbox_t_demo"), support.unique("txbox-test-demo")
    log = tmp_path / "demo.out"
    argv = [
        *txbox_command(),
        "demo",
        *("--orders", "50000", "--db-prefix", prefix, "--vhost", vhost),
        *("--pg-url", support.PG_ADMIN_URL, "--rabbitmq-api", support.MGMT_URL),
        *("--log-dir", str(tmp_path / "logs"), "--no-analyze", "--no-dashboard"),
    ]
    try:
        with log.open("w") as out:
            demo = subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        try:
            support.wait_until(lambda: "orders [" in log.read_text(), timeout=120, message="orders flowing")
            assert len(daemons_of(prefix)) >= 6  # the daemons are up
            demo.send_signal(signal.SIGTERM)
            assert demo.wait(60) == 130, log.read_text()[-2000:]
        finally:
            if demo.poll() is None:  # the test failed before the SIGTERM: let it clean up
                demo.send_signal(signal.SIGTERM)
                try:
                    demo.wait(60)
                except subprocess.TimeoutExpired:
                    demo.kill()
        assert "stopping the daemons" in log.read_text()
        assert daemons_of(prefix) == []
    finally:
        for pid in daemons_of(prefix):  # only if the demo failed to stop its own daemons
            os.kill(pid, signal.SIGKILL)
        support.drop_database(f"{prefix}_orders")
        support.drop_database(f"{prefix}_inventory")
        support.delete_vhost(vhost)
