"""`txbox publisher` as a process: graceful drain, metrics endpoint, idle cost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from framework.db import conninfo
from framework.service import Service
from framework.settings import Settings
from tests.integration.publisher.conftest import drain_queue, inbox_queue, insert_rows, orders, outbox_state
from tests.support import wait_until

Spawn = Callable[..., subprocess.Popen[bytes]]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.startswith("txbox_"):
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def test_sigterm_drains_records_confirms_releases_leases_and_exits_0(
    settings: Settings, service: Service, spawn: Spawn, tmp_path: Path
) -> None:
    insert_rows(settings, service.registry, orders(50, 100))
    proc = spawn(settings, "--batch-size", "100", "--drain-timeout", "20s", "--lease", "5m")
    wait_until(lambda: outbox_state(settings)["processed"] >= 200, 60, message="the relay is busy")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    log = (tmp_path / "publisher-0.log").read_text()
    assert "draining" in log and "stopped" in log and "Traceback" not in log
    state = outbox_state(settings)
    assert state["processed"] < 5000, "stopped before the end (else nothing was drained)"
    # Nothing stays leased for 5 minutes: confirmed rows are marked, the rest released.
    assert state["leased"] == 0
    in_queue = {d.body["message_id"] for d in drain_queue(settings.amqp_url, inbox_queue(settings), idle=1)}
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        processed = {r[0] for r in conn.execute("SELECT id::text FROM txbox.outbox WHERE processed_at IS NOT NULL")}
    assert processed <= in_queue, "a row was marked published without reaching the broker"


def test_metrics_endpoint_serves_counts_gauges_and_backlog(settings: Settings, service: Service, spawn: Spawn) -> None:
    later = datetime.now(UTC) + timedelta(hours=1)
    insert_rows(settings, service.registry, orders(10, 5))
    insert_rows(
        settings,
        service.registry,
        [
            {"message_type": "RestockItem", "aggregate_id": "SKU-1", "payload": {"sku": "SKU-1", "quantity": 1}},
            {**orders(1, 1, aggregate_id="blocked")[0], "not_before": later},  # a head not due yet ...
            orders(1, 1, aggregate_id="blocked")[0],  # ... so this due row waits: the oldest due row
        ],
    )
    port = free_port()
    spawn(
        settings,
        "--metrics-port",
        str(port),
        "--max-attempts",
        "1",
        TXBOX_PUBLISHER_METRICS_INTERVAL="0.2s",
    )
    wait_until(lambda: outbox_state(settings)["processed"] == 50, 60, message="50 rows published")

    service, tenant = ("service", settings.service), ("tenant", "")  # no tenants: the empty one

    def settled() -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
        try:
            m = scrape(port)
        except OSError:
            return None
        wanted = {
            ("txbox_publisher_published_total", (("message_type", "PlaceOrder"), service, tenant)): 50.0,
            (
                "txbox_publisher_failed_total",
                (("message_type", "RestockItem"), ("reason", "unroutable"), service, tenant),
            ): 1.0,
            ("txbox_publisher_abandoned_total", (("message_type", "RestockItem"), service, tenant)): 1.0,
            ("txbox_publisher_in_flight_messages", (service, tenant)): 0.0,
            ("txbox_publisher_outbox_backlog_rows", (service, tenant)): 2.0,
        }
        return m if all(m.get(k) == v for k, v in wanted.items()) else None

    metrics = wait_until(settled, 30, message="metrics with the expected values")
    assert metrics is not None
    assert metrics[("txbox_publisher_oldest_due_age_seconds", (service, tenant))] > 0


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime = int(fields[11]), int(fields[12])
    return (utime + stime) / os.sysconf("SC_CLK_TCK")


def test_idle_publisher_costs_almost_no_cpu(settings: Settings, spawn: Spawn, tmp_path: Path) -> None:
    proc = spawn(settings)
    wait_until(lambda: "running" in (tmp_path / "publisher-0.log").read_text(), 30, message="the publisher runs")
    before, started = cpu_seconds(proc.pid), time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(10)  # observe the idle process for 10 s: the measurement window; it must not exit
    used = (cpu_seconds(proc.pid) - before) / (time.monotonic() - started)
    print(f"idle publisher CPU: {used:.2%} of a core")
    assert proc.poll() is None
    assert used < 0.02, f"idle publisher used {used:.2%} of a core"


def test_metrics_labels_never_carry_a_urls_password(settings: Settings, service: Service, spawn: Spawn) -> None:
    """A row's message_type is a label value: one quoting a URL or a DSN (a row that
    another writer, or an older version, put there with plain SQL) is shown masked."""
    password = "pw" + os.urandom(12).hex()
    quoted = [
        f"Legacy postgresql://app:{password}@db1,db2/orders",
        f"Legacy amqps://mq/%2F?password={password}&heartbeat=5",
        f"Legacy host=db user=app password={password}",
    ]
    ids = insert_rows(settings, service.registry, orders(len(quoted), 1))
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        for row_id, message_type in zip(ids, quoted, strict=True):
            conn.execute("UPDATE txbox.outbox SET message_type = %s WHERE id = %s", (message_type, row_id))
    port = free_port()
    spawn(settings, "--metrics-port", str(port), TXBOX_PUBLISHER_METRICS_INTERVAL="0.2s")
    wait_until(lambda: outbox_state(settings)["processed"] == len(quoted), 60, message="the rows published")

    def published() -> set[str] | None:
        try:
            scraped = scrape(port)
        except OSError:
            return None
        found = {dict(labels)["message_type"] for (name, labels) in scraped if name.endswith("published_total")}
        return found if len(found) >= len(quoted) else None

    assert wait_until(published, 30, message="the published counters") == {
        "Legacy postgresql://app:***@db1,db2/orders",
        "Legacy amqps://mq/%2F?password=***&heartbeat=5",
        "Legacy host=db user=app password=***",
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert password not in resp.read().decode()
