"""`txbox archive`: old finished rows → Parquet (a Spark job), deleted only after verification,
and an interruption at any step (exception or kill -9) neither loses nor duplicates a row."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.dataset as ds
import pytest

from framework import names
from framework.analytics.archive import Archiver
from framework.cli import main
from framework.contracts import Registry, load_registry
from framework.db import conninfo
from framework.errors import ArchiveError
from tests.spark.seed import Seeder, at

ROOT = Path(__file__).resolve().parents[2]
SERVICE = "order-service"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return load_registry(ROOT / "contracts")


def seed_old_rows(url: str, registry: Registry) -> dict[str, set[str]]:
    """Old finished rows over two days and two types (to archive) and rows that must stay."""
    now = datetime.now(UTC)
    s = Seeder(url, registry, SERVICE)
    out: dict[str, set[str]] = {"outbox": set(), "inbox": set(), "keep": set()}
    try:
        for day in (9, 8):
            for i in range(4):
                t = at(now, -day * 86400 + i)
                mtype = "OrderPlaced" if i % 2 else "OrderCompleted"
                out["outbox"].add(str(s.outbox(mtype, t, processed_at=at(t, 1))))
            t = at(now, -day * 86400 + 10)
            mid = uuid.uuid4()
            s.inbox("StockReserved", mid, t, at(t, 1), processed_at=at(t, 2))
            out["inbox"].add(str(mid))
            mid = uuid.uuid4()
            s.inbox("StockRejected", mid, t, at(t, 1), abandoned_at=at(t, 2), started=5, finished=5)
            out["inbox"].add(str(mid))
        # Stays: old but still pending, and recent but processed.
        out["keep"].add(str(s.outbox("OrderPlaced", at(now, -10 * 86400))))
        out["keep"].add(str(s.outbox("OrderPlaced", at(now, -3600), processed_at=at(now, -3599))))
    finally:
        s.close()
    return out


def archived_ids(root: Path, table: str) -> list[str]:
    path = root / SERVICE / table
    if not path.is_dir():
        return []
    return list(ds.dataset(path, format="parquet", partitioning="hive").to_table(columns=["id"])["id"].to_pylist())


def remaining(url: str, table: str) -> set[str]:
    with psycopg.connect(conninfo(url)) as conn:
        return {r[0] for r in conn.execute(f"SELECT id::text FROM txbox.{table}")}


def pending_batches(url: str) -> int:
    with psycopg.connect(conninfo(url)) as conn:
        row = conn.execute("SELECT count(*) FROM txbox.archive_batches WHERE state = 'pending'").fetchone()
    return int(row[0]) if row else 0


def check_final(url: str, root: Path, seeded: dict[str, set[str]]) -> None:
    for table in ("outbox", "inbox"):
        ids = archived_ids(root, table)
        assert len(ids) == len(set(ids)), f"duplicated rows in the {table} archive"
        assert set(ids) == seeded[table]
        assert not (remaining(url, table) & seeded[table])
    assert remaining(url, "outbox") == seeded["keep"]
    assert pending_batches(url) == 0


class Interrupt(Exception):
    pass


def test_archive_writes_partitioned_parquet_and_deletes_exactly_those_rows(
    make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    url = make_database()
    seeded = seed_old_rows(url, registry)
    result = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark).run(
        timedelta(days=7)
    )
    check_final(url, tmp_path, seeded)
    assert result.archived == {"outbox": 8, "inbox": 4} == result.deleted
    assert result.batches == 3  # 5 + 3 outbox rows, 4 inbox rows
    outbox = tmp_path / SERVICE / "outbox"
    assert len({p.name for p in outbox.glob("batch=*/day=*")}) == 2
    types = {p.name for p in outbox.glob("batch=*/day=*/*")}
    assert types == {"message_type=OrderPlaced", "message_type=OrderCompleted"}
    table = ds.dataset(tmp_path / SERVICE / "inbox", format="parquet", partitioning="hive").to_table()
    assert sorted(set(table["message_type"].to_pylist())) == ["StockRejected", "StockReserved"]
    # A second run finds nothing more to do.
    again = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark).run(timedelta(days=7))
    assert again.batches == 0
    check_final(url, tmp_path, seeded)


@pytest.mark.parametrize("stage", ["manifest", "written", "deleted"])
def test_interrupted_archive_finishes_on_rerun(
    stage: str, make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    url = make_database()
    seeded = seed_old_rows(url, registry)
    hits = {"n": 0}

    def fail(at_stage: str) -> None:
        if at_stage == stage:
            hits["n"] += 1
            if hits["n"] == 2:  # the second batch, so one batch is already complete
                raise Interrupt(stage)

    with pytest.raises(Interrupt):
        Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, checkpoint=fail, spark=spark).run(
            timedelta(days=7)
        )
    # Nothing is lost in between: every seeded row is in the database or in the archive.
    for table in ("outbox", "inbox"):
        assert seeded[table] <= remaining(url, table) | set(archived_ids(tmp_path, table))
    result = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark).run(
        timedelta(days=7)
    )
    assert result.recovered == (0 if stage == "deleted" else 1)
    check_final(url, tmp_path, seeded)


def test_a_batch_whose_files_lost_a_row_is_not_deleted(
    make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    url = make_database()
    seeded = seed_old_rows(url, registry)

    def lose_a_file(stage: str) -> None:
        if stage == "written":
            next((tmp_path / SERVICE).rglob("*.parquet")).unlink()

    with pytest.raises(ArchiveError, match="nothing was deleted"):
        Archiver(
            database_url=url, service=SERVICE, root=tmp_path, batch_size=5, checkpoint=lose_a_file, spark=spark
        ).run(timedelta(days=7))
    assert seeded["outbox"] <= remaining(url, "outbox")
    assert pending_batches(url) == 1
    result = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark).run(
        timedelta(days=7)
    )
    assert result.recovered == 1
    check_final(url, tmp_path, seeded)


def test_an_interrupted_batch_whose_rows_were_removed_meanwhile_finishes_empty(
    make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    url = make_database()
    seed_old_rows(url, registry)

    def stop(stage: str) -> None:
        if stage == "manifest":
            raise Interrupt(stage)

    with pytest.raises(Interrupt):
        Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, checkpoint=stop, spark=spark).run(
            timedelta(days=7)
        )
    with psycopg.connect(conninfo(url)) as conn:  # another retention removed them
        conn.execute("DELETE FROM txbox.outbox WHERE id = ANY((SELECT ids FROM txbox.archive_batches)::uuid[])")
    result = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark).move(
        "inbox", datetime.now(UTC)
    )
    assert result.recovered == 1 and result.archived.get("outbox", 0) == 0
    assert pending_batches(url) == 0


def test_a_second_archive_of_the_service_at_once_is_refused(
    make_database: Callable[[], str], registry: Registry, tmp_path: Path
) -> None:
    url = make_database()
    seeded = seed_old_rows(url, registry)
    with psycopg.connect(conninfo(url), autocommit=True) as running:
        running.execute("SELECT pg_advisory_lock(%s)", (names.archive_lock_key(SERVICE),))
        with pytest.raises(ArchiveError, match="another `txbox archive` of order-service is running"):
            Archiver(database_url=url, service=SERVICE, root=tmp_path).run(timedelta(days=7))
    assert seeded["outbox"] <= remaining(url, "outbox")
    assert pending_batches(url) == 0


def _archive_locks(url: str) -> int:
    """Advisory locks held on the archive's key of SERVICE in this database (pg_locks splits a
    bigint key into its high 32 bits, ``classid``, and its low 32 bits, ``objid``)."""
    key = names.archive_lock_key(SERVICE) & 0xFFFFFFFFFFFFFFFF
    with psycopg.connect(conninfo(url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objsubid = 1"
            " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            " AND classid::bigint = %s AND objid::bigint = %s AND granted",
            (key >> 32, key & 0xFFFFFFFF),
        ).fetchone()
    assert row is not None
    return int(row[0])


@pytest.mark.parametrize("fails_at", [None, "written"])
def test_the_archive_lock_is_released_explicitly_when_the_run_ends(
    fails_at: str | None, make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    """At stage ``unlocked`` the run's lock connection is still open: the lock is gone from
    pg_locks because the run released it, not because its connection ended."""
    url = make_database()
    seed_old_rows(url, registry)
    seen: dict[str, int] = {}

    def look(stage: str) -> None:
        seen.setdefault(stage, _archive_locks(url))
        if stage == fails_at:
            raise RuntimeError(f"stopped at {stage}")

    archiver = Archiver(database_url=url, service=SERVICE, root=tmp_path, batch_size=5, spark=spark, checkpoint=look)
    if fails_at is None:
        archiver.run(timedelta(days=7))
    else:
        with pytest.raises(RuntimeError, match=f"stopped at {fails_at}"):
            archiver.run(timedelta(days=7))
    assert seen["manifest"] == 1, "the run holds the lock"
    assert seen.get("unlocked") == 0, seen
    assert _archive_locks(url) == 0


def test_kill_9_mid_batch_then_txbox_archive_recovers(
    make_database: Callable[[], str],
    registry: Registry,
    tmp_path: Path,
    spark: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    url = make_database()
    seeded = seed_old_rows(url, registry)
    script = textwrap.dedent(
        f"""
        import os, signal
        from datetime import timedelta
        from framework.analytics.archive import Archiver
        from framework.analytics.settings import AnalyzeSettings

        def die(stage):
            if stage == "written":
                os.kill(os.getpid(), signal.SIGKILL)

        Archiver(database_url={url!r}, service={SERVICE!r}, root={str(tmp_path)!r}, batch_size=5, checkpoint=die,
                 settings=AnalyzeSettings(master="local[1]", driver_memory="512m")).run(timedelta(days=7))
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, timeout=300, check=False)
    assert proc.returncode == -signal.SIGKILL
    assert pending_batches(url) == 1  # killed between the write and the delete
    assert set(archived_ids(tmp_path, "outbox")) <= remaining(url, "outbox")
    # The command as an operator runs it, on this run's Spark session: the killed process
    # above is the one that must be a process, and a second JVM would cost a minute on a
    # busy machine. The command as a process is run by test_archive_flags_are_validated
    # and, against real daemons, by tests/acceptance/test_secrets_canary.py.
    monkeypatch.setenv("TXBOX_SERVICE", SERVICE)
    monkeypatch.setenv("TXBOX_DATABASE_URL", url)
    assert main(["archive", "--older-than", "7d", "--to", f"file://{tmp_path}"]) == 0
    assert "finished 1 interrupted batch" in capsys.readouterr().out
    check_final(url, tmp_path, seeded)


def test_archive_flags_are_validated(tmp_path: Path) -> None:
    txbox = str(Path(sys.executable).parent / "txbox")
    out = subprocess.run(
        [txbox, "archive", "--older-than", "soon", "--to", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2
    assert "--older-than 'soon' is not a duration" in out.stderr


def test_history_keeps_archived_rows_visible_to_analyze(
    make_database: Callable[[], str], registry: Registry, tmp_path: Path, spark: Any
) -> None:
    from framework.analytics.job import run_once
    from framework.analytics.sources import Source
    from tests.spark.test_analyze import INVENTORY, ORDER, SETTINGS, seed

    order_url, inventory_url = make_database(), make_database()
    seed(order_url, inventory_url, registry)
    sources = [Source(ORDER, order_url), Source(INVENTORY, inventory_url)]
    before = run_once(spark, sources=sources, registry=registry, settings=SETTINGS)
    # Archive the subscriber only, with a dedup window short enough that no tombstone is
    # kept: its delivered messages vanish from its inbox and look lost.
    Archiver(
        database_url=inventory_url, service=INVENTORY, root=tmp_path, dedup_window=timedelta(seconds=1), spark=spark
    ).run(timedelta(minutes=45))
    assert len(remaining(inventory_url, "inbox")) == 2  # the expired lease and the late one (~30 min old)
    without = run_once(spark, sources=sources, registry=registry, settings=SETTINGS)
    assert without.lost > before.lost
    Archiver(database_url=order_url, service=ORDER, root=tmp_path, spark=spark).run(timedelta(minutes=45))
    with_history = run_once(spark, sources=sources, registry=registry, settings=SETTINGS, history=tmp_path)
    assert with_history.counts == before.counts
    assert (with_history.outbox_rows, with_history.inbox_rows) == (before.outbox_rows, before.inbox_rows)
