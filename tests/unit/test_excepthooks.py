"""Tracebacks no log handler formats are masked too: a real `txbox` process whose
application fails, in a thread of its own and in the main thread, quoting a URL's password.

The application (tests/apps/leaky.py) raises exceptions that are not TxboxErrors, so
Python's hooks print them; `txbox` installs masking ones (framework.cli.install_excepthooks).
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.conftest import ROOT

TXBOX = Path(sys.executable).parent / "txbox"


@pytest.mark.parametrize("at_import", [False, True], ids=["thread", "thread-and-main"])
def test_an_uncaught_exception_quoting_a_url_is_printed_masked(at_import: bool) -> None:
    password = "pw" + uuid.uuid4().hex
    env = {
        **os.environ,
        "TXBOX_DATABASE_URL": f"postgresql://app:{password}@127.0.0.1:5432/orders",
        "TXBOX_AMQP_URL": "amqp://guest:guest@127.0.0.1:5672/%2F",
    }
    env.pop("LEAKY_FAIL_AT_IMPORT", None)
    if at_import:
        env["LEAKY_FAIL_AT_IMPORT"] = "1"
    done = subprocess.run(
        [str(TXBOX), "check", "--app", "tests.apps.leaky:service"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert password not in done.stdout + done.stderr
    # The hooks printed the failures, as Python's own would: name, traceback, message.
    assert "Exception in thread leaky pool:\nTraceback (most recent call last):" in done.stderr
    assert "ConnectionError: cannot reach postgresql://app:***@127.0.0.1:5432/orders nor" in done.stderr
    if at_import:
        assert done.returncode == 1 and "RuntimeError: cannot reach postgresql://app:***@127.0.0.1" in done.stderr
    else:
        assert "service order-service (0 handlers)" in done.stdout  # the thread died, the command went on
