"""`txbox analyze` on a Spark standalone cluster finds exactly what the local run finds.

A master and two workers (one core, 512 MB each) run on 127.0.0.1 from the pyspark
package; executors are JVMs of their own that get the JDBC driver from the job, read the
databases in partitions, and write Parquet through a ``file://`` URI. The executors are
given a Python that does not exist: the job must need none on them.

Heavy (five JVMs on a two-core machine, a few minutes): run with ``make spark-cluster``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest

from framework.contracts import load_registry
from framework.db import conninfo
from tests.spark.cluster import Cluster
from tests.spark.test_analyze import INVENTORY, ORDER, seed

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RUN_ID = re.compile(r"txbox analyze run (\S+) ")
FINDING = "kind, service, publisher, message_type, message_id, state, reason"

pytestmark = [
    pytest.mark.skipif(
        not os.environ.get("TXBOX_SPARK_CLUSTER"), reason="starts a Spark cluster: run `make spark-cluster`"
    ),
    pytest.mark.slow,
    pytest.mark.timeout(1500),
]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Cluster]:
    c = Cluster(tmp_path / "spark")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def analyze(master: str, sources: list[str], *extra: str, env: dict[str, str] | None = None) -> str:
    """One `txbox analyze` run; returns its run id."""
    proc = subprocess.run(
        [str(BIN / "txbox"), "analyze", "--master", master, "--window", "1d", "--partition-rows", "5", *extra]
        + [a for s in sources for a in ("--source", s)],
        cwd=ROOT,
        env={**os.environ, "TXBOX_ANALYZE_DRIVER_MEMORY": "1g", **(env or {})},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = RUN_ID.search(proc.stdout)
    assert found, proc.stdout
    return found.group(1)


def findings(url: str, run_id: str) -> set[tuple[str | None, ...]]:
    with psycopg.connect(conninfo(url)) as conn:
        rows = conn.execute(f"SELECT {FINDING} FROM txbox.analytics_findings WHERE run_id = %s", (run_id,)).fetchall()
    # The seeded lease ends 30 s after seeding: whether a run calls that row leased or
    # lease_expired depends on when it starts, not on where it runs.
    return {(*r[:5], "leased or expired" if r[5] in ("leased", "lease_expired") else r[5], r[6]) for r in rows}


def test_the_cluster_finds_what_local_mode_finds(
    cluster: Cluster, make_database: Callable[[], str], tmp_path: Path
) -> None:
    import pyarrow.parquet as pq

    order_url, inventory_url = make_database(), make_database()
    world = seed(order_url, inventory_url, load_registry(ROOT / "contracts"))
    sources = [f"{ORDER}={order_url}", f"{INVENTORY}={inventory_url}"]

    local = analyze("local[2]", sources)
    report = tmp_path / "shared" / "report"
    on_cluster = analyze(
        cluster.master_url,
        sources,
        *("--conf", "spark.executor.memory=512m", "--conf", "spark.executor.cores=1", "--conf", "spark.cores.max=2"),
        *("--parquet", f"file://{report}"),
        env={"PYSPARK_PYTHON": "/nonexistent/python3"},  # the executors must need no Python
    )

    expected = findings(order_url, local)
    assert findings(order_url, on_cluster) == expected
    for kind in ("lost", "stuck", "abandoned", "unexpected"):
        assert {r[4] for r in expected if r[0] == kind} == world.ids[kind], kind
    written = pq.read_table(report / "analytics_findings" / f"run_id={on_cluster}")
    assert written.num_rows == len(expected)
    # Both workers ran an executor of the cluster run, and each of them ran tasks.
    for n in range(cluster.workers):
        logs = cluster.executor_logs(n)
        assert logs, f"worker {n} ran no executor"
        assert any("Finished task" in p.read_text(errors="replace") for p in logs), f"worker {n} ran no task"
