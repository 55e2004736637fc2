"""The commands as people run them: validation before the JVM starts, spark-submit, exit codes."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest

from framework.analytics.sources import jdbc_target, load_sources_file, parse_source
from framework.contracts import load_registry
from framework.db import conninfo
from framework.errors import ConfigurationError
from tests.spark.test_analyze import INVENTORY, ORDER, seed
from tests.support import wait_until

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def txbox(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "txbox"), *args],
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def test_jdbc_url_keeps_credentials_out_of_the_url() -> None:
    target = jdbc_target("postgresql+psycopg://alice:s3cret@db.example:6432/orders?sslmode=require")
    assert target.url == "jdbc:postgresql://db.example:6432/orders?sslmode=require"
    assert (target.user, target.password) == ("alice", "s3cret")
    assert jdbc_target("postgresql://postgres@127.0.0.1/x").url == "jdbc:postgresql://127.0.0.1:5432/x"


def test_sources_are_validated(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match="must be service=url"):
        parse_source("postgresql://postgres@127.0.0.1/x")
    with pytest.raises(ConfigurationError, match="only PostgreSQL"):
        parse_source("a=mysql://root@localhost/x")
    path = tmp_path / "sources.yml"
    path.write_text("sources:\n  order-service: postgresql://postgres@127.0.0.1/o\nreport: postgresql://r@h/rep\n")
    sources, report = load_sources_file(path)
    assert [s.service for s in sources] == ["order-service"] and report == "postgresql://r@h/rep"


def test_misconfiguration_fails_before_spark_naming_the_fix(
    make_database: Callable[[], str], empty_database_url: str, tmp_path: Path
) -> None:
    url = make_database()
    out = txbox("analyze", "--source", f"order-service={url}", "--jdbc-jar", str(tmp_path / "missing.jar"))
    assert out.returncode == 2
    assert "TXBOX_JDBC_JAR" in out.stderr and "libpostgresql-jdbc-java" in out.stderr
    out = txbox("analyze", env={"TXBOX_SERVICE": "", "TXBOX_DATABASE_URL": ""})
    assert out.returncode == 2 and "no sources" in out.stderr
    out = txbox("analyze", "--source", f"order-service={url}", "--report-url", empty_database_url)
    assert out.returncode == 2 and "run `txbox migrate` against it" in out.stderr
    out = txbox("analyze", "--source", f"order-service={url}", "--parquet", "s3://bucket/report")
    assert out.returncode == 2 and "s3a://bucket/report" in out.stderr


def test_an_unreachable_master_fails_in_seconds_in_one_line(make_database: Callable[[], str]) -> None:
    """Spark itself retries for a minute and prints some 200 lines of Java before giving up."""
    url = make_database()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))  # bound but not listening: refused
        master = f"spark://127.0.0.1:{sock.getsockname()[1]}"
        started = time.monotonic()
        out = txbox("analyze", "--source", f"order-service={url}", "--master", master, timeout=30)
    assert out.returncode == 2
    assert out.stderr.count("\n") == 1 and f"{master} is unreachable" in out.stderr
    assert time.monotonic() - started < 20


def _driver_pid(spark_submit: int) -> int | None:
    """The Python driver spark-submit's JVM started (its child running the job's file)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile, or not ours to read
        if parent == spark_submit and b"analytics/job.py" in command:
            return int(entry.name)
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)  # a second JVM; on a loaded machine its start alone takes a minute
def test_spark_submit_repeats_and_fails_on_lost(make_database: Callable[[], str], tmp_path: Path) -> None:
    """The documented spark-submit line runs the job; `--every` repeats it in one Spark session
    until SIGTERM, which ends it after the current run; lost messages make it exit 1.

    One JVM for what were two tests (spark-submit, and `txbox analyze --every`): the
    command is the same `analyze` either way, and each JVM costs a minute on a busy machine.
    """
    order_url, inventory_url = make_database(), make_database()
    seed(order_url, inventory_url, load_registry(ROOT / "contracts"))
    from framework.analytics import job

    proc = subprocess.Popen(
        [
            str(BIN / "spark-submit"),
            "--master",
            "local[2]",
            "--driver-memory",
            "1g",
            "--conf",
            "spark.ui.enabled=false",
            "--jars",
            "/usr/share/java/postgresql.jar",
            job.__file__,
            "--source",
            f"{ORDER}={order_url}",
            "--source",
            f"{INVENTORY}={inventory_url}",
            "--window",
            "1d",
            "--parquet",
            str(tmp_path / "report"),
            "--fail-on-lost",
            "--every",
            "1s",
        ],
        cwd=ROOT,
        # As with an activated venv: spark-submit finds SPARK_HOME through this python.
        env={
            **os.environ,
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:

        def runs() -> int:
            with psycopg.connect(conninfo(order_url)) as conn:
                row = conn.execute("SELECT count(*) FROM txbox.analytics_runs").fetchone()
            return int(row[0]) if row else 0

        wait_until(lambda: runs() >= 2, timeout=600, interval=0.5, message="two analyze runs")
        driver = _driver_pid(proc.pid)
        assert driver is not None, "the job's Python driver under spark-submit"
        os.kill(driver, signal.SIGTERM)  # as a supervisor stops it
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err[-3000:]  # the last run's status, not a signal's
    assert out.count("txbox analyze run ") >= 2 and "lost         3" in out
    assert (tmp_path / "report" / "analytics_runs").is_dir()


def test_bench_analyze_smoke(spark: object) -> None:
    """`txbox bench analyze` end to end on a few thousand rows (the figure itself is not judged)."""
    import argparse

    from txbox_tools.bench import analyze as bench

    parser = argparse.ArgumentParser()
    bench.configure(parser)
    args = parser.parse_args(["--rows", "2000"])
    result = bench.run(args)
    data = result.as_dict()
    assert (data["stage"], data["messages"]) == ("analyze", 4000)
    assert data["findings"]["lost"] == 2 and data["raw_limit_rate"] > 0
