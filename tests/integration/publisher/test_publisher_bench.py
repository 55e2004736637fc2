"""A smoke run of `txbox bench relay` (a few hundred rows): it cleans up and reports both rates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg

from tests import support
from tests.conftest import ROOT


def test_bench_relay_smoke_reports_rate_and_raw_limit_and_cleans_up() -> None:
    done = subprocess.run(
        [str(Path(sys.executable).parent / "txbox"), "bench", "relay", "--messages", "300", "--json"],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["stage"] == "relay" and result["messages"] == 300 and result["in_queue"] == 300
    assert result["rate"] > 0 and result["raw_limit_rate"] > 0 and result["ratio"] is not None
    scratch = result["scratch"]
    assert support.mgmt("GET", f"/vhosts/{support.vhost_path(scratch['vhost'])}") is None
    with psycopg.connect(support.PG_ADMIN_URL) as conn:
        left = conn.execute("SELECT count(*) FROM pg_database WHERE datname = %s", (scratch["database"],)).fetchone()
    assert left == (0,)


def test_bench_relay_history_smoke_measures_again_over_finished_rows() -> None:
    done = subprocess.run(
        [
            str(Path(sys.executable).parent / "txbox"),
            "bench",
            "relay",
            "--messages",
            "200",
            "--history",
            "2000",
            "--json",
        ],
        check=False,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    history = result["history"]
    assert history["rows"] == 2000 and history["rate"] > 0 and history["empty_rate"] == result["rate"]
    assert history["filled"] == [
        {"table": "outbox", "rows": 2000, "abandoned": 40, "fill_seconds": history["filled"][0]["fill_seconds"],
         "table_bytes": history["filled"][0]["table_bytes"]}
    ]  # fmt: skip
