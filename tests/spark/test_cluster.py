"""`txbox analyze` and `txbox archive` on a Spark standalone cluster find and move exactly
what they do in local mode.

A master and one worker (one core, 512 MB) run on 127.0.0.1 from the pyspark package;
the executor is a JVM of its own that gets the JDBC driver from the job, reads the
databases in partitions, and writes Parquet through a ``file://`` URI. The executors are
given a Python that does not exist: the jobs must need none on them. One driver process
runs both commands on one Spark application, so the cluster's start-up is paid once.

``make spark-cluster`` (``TXBOX_SPARK_CLUSTER=1``) runs the larger version: two workers,
each of which must run tasks, and a few thousand more rows to archive in many batches.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.dataset as ds
import pytest

from framework.analytics.archive import Archiver
from framework.analytics.job import run_once
from framework.analytics.sources import Source
from framework.contracts import load_registry
from framework.db import conninfo
from tests import support
from tests.conftest import SPARK_JVM_OPTIONS
from tests.spark.cluster import Cluster
from tests.spark.seed import Seeder, at
from tests.spark.test_analyze import INVENTORY, ORDER, SETTINGS, World, seed

ROOT = Path(__file__).resolve().parents[2]
RUN_ID = re.compile(r"txbox analyze run (\S+) ")
FINDING = "kind, service, publisher, message_type, message_id, state, reason"
LARGE = bool(os.environ.get("TXBOX_SPARK_CLUSTER"))
WORKERS = 2 if LARGE else 1
BULK = 3000 if LARGE else 0  # extra old finished rows: many archive batches, each read in partitions
OLDER_THAN = timedelta(minutes=45)  # archives the seeded hour-old rows, keeps the recent ones
BATCH, PARTITION_ROWS = (1000, 250) if LARGE else (6, 2)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500 if LARGE else 900)]


@dataclass
class Databases:
    order: str
    inventory: str
    order_copy: str  # archived in local mode
    inventory_copy: str
    world: World


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    c = Cluster(tmp_path_factory.mktemp("spark"), workers=WORKERS)
    try:
        c.start()
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def databases(template_db: str) -> Iterator[Databases]:
    names = [support.unique("txbox_c") for _ in range(4)]
    order, inventory, order_copy, inventory_copy = names
    created = []
    try:
        for name in (order, inventory):
            support.create_database(name, template=template_db)
            created.append(name)
        world = seed(support.db_url(order), support.db_url(inventory), load_registry(ROOT / "contracts"))
        if BULK:
            bulk(support.db_url(order), world.now)
        for name, original in ((order_copy, order), (inventory_copy, inventory)):
            support.create_database(name, template=original)  # the same rows, ids and timestamps
            created.append(name)
        yield Databases(*(support.db_url(n) for n in names), world=world)
    finally:
        for name in created:
            support.drop_database(name)


def bulk(url: str, now: datetime) -> None:
    """Finished OrderCompleted rows (no subscriber: never a finding) from two to three hours ago."""
    s = Seeder(url, load_registry(ROOT / "contracts"), ORDER)
    try:
        for i in range(BULK):
            t = at(now, -7200 - i)
            s.outbox("OrderCompleted", t, processed_at=at(t, 1))
    finally:
        s.close()


@dataclass
class Runs:
    local_run: str  # analyze run ids
    cluster_run: str
    local_archive: Path
    cluster_archive: Path


@pytest.fixture(scope="module")
def runs(cluster: Cluster, databases: Databases, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Analyze, then archive: in local mode (this process's session) and on the cluster (a driver process)."""
    registry = load_registry(ROOT / "contracts")
    db = databases
    local_run = run_once(
        spark,
        sources=[Source(ORDER, db.order), Source(INVENTORY, db.inventory)],
        registry=registry,
        settings=SETTINGS,
        report_url=db.order,
    ).run_id
    shared = tmp_path_factory.mktemp("shared")
    cluster_archive, local_archive = shared / "cluster-archive", shared / "local-archive"
    out = drive(cluster, db, cluster_archive)
    found = RUN_ID.search(out)
    assert found, out
    for service, url in ((INVENTORY, db.inventory_copy), (ORDER, db.order_copy)):
        Archiver(
            database_url=url, service=service, root=local_archive, batch_size=BATCH, spark=spark, settings=SETTINGS
        ).run(OLDER_THAN)
    return Runs(local_run, found.group(1), local_archive, cluster_archive)


def drive(cluster: Cluster, db: Databases, archive: Path) -> str:
    """`txbox analyze` then `txbox archive` of both services on the cluster, in one driver process."""
    master = cluster.master_url
    common = ["--master", master, "--partition-rows", str(PARTITION_ROWS)]
    sources = ["--source", f"{ORDER}={db.order}", "--source", f"{INVENTORY}={db.inventory}"]
    commands = [["analyze", *common, "--window", "1d", *sources]]
    for service, url in ((INVENTORY, db.inventory), (ORDER, db.order)):
        archive_to = ["--older-than", "45m", "--to", f"file://{archive}", "--batch-size", str(BATCH)]
        commands.append(["archive", *common, *archive_to, "--service", service, "--database-url", url])
    conf = {
        "spark.executor.memory": "512m",
        "spark.executor.cores": "1",
        "spark.cores.max": str(WORKERS),
        "spark.executor.defaultJavaOptions": SPARK_JVM_OPTIONS,
    }
    script = textwrap.dedent(
        f"""
        from framework.analytics.session import job_session
        from framework.analytics.settings import AnalyzeSettings
        from framework.cli import main

        with job_session(AnalyzeSettings(master={master!r}, driver_memory="512m"), "txbox-cluster-test", {conf!r}):
            for command in {commands!r}:
                if main(command) != 0:
                    raise SystemExit(f"txbox {{command[0]}} failed")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "PYSPARK_PYTHON": "/nonexistent/python3"},  # the executors must need no Python
        capture_output=True,
        text=True,
        timeout=1200 if LARGE else 800,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc.stdout


def findings(url: str, run_id: str) -> set[tuple[str | None, ...]]:
    with psycopg.connect(conninfo(url)) as conn:
        rows = conn.execute(f"SELECT {FINDING} FROM txbox.analytics_findings WHERE run_id = %s", (run_id,)).fetchall()
    # The seeded lease ends 30 s after seeding: whether a run calls that row leased or
    # lease_expired depends on when it starts, not on where it runs.
    return {(*r[:5], "leased or expired" if r[5] in ("leased", "lease_expired") else r[5], r[6]) for r in rows}


def archived(root: Path, service: str, table: str) -> list[dict[str, Any]]:
    """Every archived row, whole, by id (batch ids differ between the runs)."""
    path = root / service / table
    if not path.is_dir():
        return []
    rows = ds.dataset(path, format="parquet", partitioning="hive").to_table().drop_columns(["batch"]).to_pylist()
    return sorted(rows, key=lambda r: str(r["id"]))


def left(url: str, table: str) -> set[tuple[str, bool]]:
    archived_at = "archived_at IS NOT NULL" if table == "inbox" else "FALSE"
    with psycopg.connect(conninfo(url)) as conn:
        return {(r[0], r[1]) for r in conn.execute(f"SELECT id::text, {archived_at} FROM txbox.{table}")}


def test_analyze_on_the_cluster_finds_what_local_mode_finds(runs: Runs, databases: Databases, cluster: Cluster) -> None:
    expected = findings(databases.order, runs.local_run)
    assert findings(databases.order, runs.cluster_run) == expected
    for kind in ("lost", "stuck", "abandoned", "unexpected"):
        assert {r[4] for r in expected if r[0] == kind} == databases.world.ids[kind], kind
    # Every worker ran an executor of the cluster run, and each of them ran tasks.
    for n in range(cluster.workers):
        logs = cluster.executor_logs(n)
        assert logs, f"worker {n} ran no executor"
        assert any("Finished task" in p.read_text(errors="replace") for p in logs), f"worker {n} ran no task"


def test_archive_on_the_cluster_moves_what_local_mode_moves(runs: Runs, databases: Databases) -> None:
    db = databases
    moved = 0
    for service, url, copy in ((ORDER, db.order, db.order_copy), (INVENTORY, db.inventory, db.inventory_copy)):
        for table in ("outbox", "inbox"):
            on_cluster = archived(runs.cluster_archive, service, table)
            assert on_cluster == archived(runs.local_archive, service, table), (service, table)
            assert left(url, table) == left(copy, table), (service, table)
            moved += len(on_cluster)
    assert moved > 10 + BULK  # the hour-old rows of both services
    # Left before the cutoff: pending rows only.
    finished_old = "SELECT count(*) FROM txbox.outbox WHERE created_at < %s AND processed_at IS NOT NULL"
    with psycopg.connect(conninfo(db.order)) as conn:
        row = conn.execute(finished_old, (datetime.now(UTC) - OLDER_THAN,)).fetchone()
    assert row is not None and row[0] == 0
