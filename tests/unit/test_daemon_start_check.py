"""Every daemon command runs the assembly check at start (framework/cli/common.py
``check_assembly``): a misfit fails the process before it connects anywhere, naming the fix.

The commands run as processes, with the app written by the test and no TXBOX_JWT_*: the
URLs point at a port nothing listens on, so a daemon that skipped the check would keep
reconnecting instead of exiting.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"
TXBOX = str(Path(sys.executable).parent / "txbox")
SECRET = "s3cret-password"

APP = f"""
from framework import CommandHandler, EventHandler, Service


class PlaceOrder(CommandHandler):
    message_type = "PlaceOrder"
    permissions = frozenset({{"orders:write"}})  # needs TXBOX_JWT_*, which is not set

    def handle(self, message, session, outbox):
        pass


class StockReserved(EventHandler):
    message_type = "StockReserved"


class Typo(EventHandler):
    message_type = "StockRejectd"


service = Service(
    name="order-service",
    database_url="postgresql://txbox:{SECRET}@127.0.0.1:1/nowhere",
    amqp_url="amqp://txbox:{SECRET}@127.0.0.1:1/%2F",
    contracts_dir={str(CONTRACTS)!r},
)
for handler in (PlaceOrder(), StockReserved(), Typo()):
    service.register(handler)
"""


@pytest.mark.parametrize("command", ["receiver", "publisher", "collector", "worker"])
def test_a_daemon_that_does_not_assemble_fails_at_start_naming_the_fix(command: str, tmp_path: Path) -> None:
    (tmp_path / "misfit_app.py").write_text(APP)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TXBOX_")}
    try:
        done = subprocess.run(
            [TXBOX, command, "--app", "misfit_app:service"],
            check=False,
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,  # a bound on a daemon that did not check: it would never exit
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"txbox {command} started although the service does not assemble")
    assert done.returncode == 2, (done.returncode, done.stdout, done.stderr)
    assert done.stderr.startswith(f"txbox {command}: error: the service does not assemble"), done.stderr
    assert "TXBOX_JWT_AUDIENCE is not set" in done.stderr  # the fix: Example: TXBOX_JWT_AUDIENCE=...
    assert "handles unknown message type 'StockRejectd'" in done.stderr
    assert SECRET not in done.stdout + done.stderr
