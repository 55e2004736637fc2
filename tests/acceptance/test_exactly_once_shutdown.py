"""SIGTERM stops `txbox receiver` and `txbox worker` cleanly mid-stream; metrics are served."""

from __future__ import annotations

import json
import os
import socket
import urllib.request

from framework import topology
from framework.worker.timeout import HARD_EXIT_CODE
from tests import support
from tests.apps import counter
from tests.apps.helpers import publish, query, scalar, store_in_inbox
from txbox_tools.processes import ProcessGroup

APP = ["--app", "tests.apps.counter:service"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def scrape(port: int) -> str:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return str(response.read().decode())
    except OSError:
        return ""


def test_sigterm_mid_stream_exits_0_holds_no_lease_and_loses_nothing(
    database_url: str, amqp_url: str, processes: ProcessGroup
) -> None:
    query(database_url, counter.TABLE)
    env = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
        "TXBOX_WORKER_BATCH_SIZE": "50",
    }
    app = counter.build(env)
    topology.declare(app.settings, app.registry)
    bodies = [counter.envelope(n, aggregate_id=str(n % 20)) for n in range(3000)]
    publish(amqp_url, bodies, routing_key=counter.ROUTING_KEY)

    receiver_port, worker_port = free_port(), free_port()
    receiver = processes.start("receiver", ["receiver", *APP, "--metrics-port", str(receiver_port)], env=env)
    worker = processes.start("worker", ["worker", *APP, "--metrics-port", str(worker_port)], env=env)
    support.wait_until(
        lambda: (scalar(database_url, "SELECT count(*) FROM counters") or 0) >= 200,
        60,
        message=f"work under way\n{receiver.log_tail()}\n{worker.log_tail()}",
    )
    received = support.wait_until(lambda: scrape(receiver_port), 10, message="receiver metrics")
    worked = support.wait_until(lambda: scrape(worker_port), 10, message="worker metrics")
    for name in ("txbox_receiver_received_total", "txbox_receiver_stored_total", "txbox_receiver_duplicates_total"):
        assert name in received
    for name in (
        'txbox_worker_processed_total{message_type="Count",service="counter-service",tenant=""}',
        "txbox_worker_handler_duration_seconds_bucket",
        "txbox_worker_inbox_backlog_rows",
        "txbox_worker_oldest_due_age_seconds",
    ):
        assert name in worked

    assert processes.stop(receiver) == 0, receiver.log_tail()
    assert processes.stop(worker) == 0, worker.log_tail()
    held = scalar(
        database_url,
        "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL"
        " AND (locked_until > now() OR started_attempts > finished_attempts)",
    )
    assert held == 0, "a stopped worker must not leave claims or leases behind"
    assert "stopped" in worker.log_tail() and "stopped" in receiver.log_tail()

    processes.start("receiver-2", ["receiver", *APP], env=env)
    processes.start("worker-2", ["worker", *APP], env=env)
    support.wait_until(
        lambda: scalar(database_url, "SELECT count(*) FROM counters") == len(bodies), 120, message="the rest"
    )
    ids = {json.loads(b)["message_id"] for b in bodies}
    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    assert set(counts) == ids and set(counts.values()) == {1}


def test_a_handler_that_ignores_its_timeout_does_not_outlive_its_lease(
    database_url: str, amqp_url: str, processes: ProcessGroup
) -> None:
    """Blocked in C (time.sleep), the handler cannot be interrupted: the process ends before the lease does."""
    query(database_url, counter.TABLE)
    env = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_WORKER_LEASE": "5s",
        "TXBOX_WORKER_TIMEOUT": "1s",
    }
    app = counter.build(env)
    store_in_inbox(app, [json.loads(counter.envelope(1, sleep=120))])
    worker = processes.start("worker", ["worker", *APP], env=env)
    support.wait_until(lambda: not worker.alive, 30, message=f"the worker to end itself\n{worker.log_tail()}")
    assert worker.process.returncode == HARD_EXIT_CODE
    assert "reached the end of its lease" in worker.log_tail()
    lease_left = scalar(database_url, "SELECT extract(epoch FROM locked_until - now()) FROM txbox.inbox")
    assert lease_left > 0, "it ended while its lease still held"
    assert scalar(database_url, "SELECT count(*) FROM counters") == 0
