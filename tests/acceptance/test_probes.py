"""/healthz and /readyz of real daemon processes: a stuck handler, a stopped database or broker.

docs/explanation/operations.md, "Probes, logs and liveness". The daemons run as ``txbox ... --app
tests.apps.counter:service --metrics-port P``; the outages use private PostgreSQL and
RabbitMQ instances (the shared ones serve other tests).
"""

from __future__ import annotations

import json
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest

from framework import migrate
from tests import support
from tests.apps import counter
from tests.apps.helpers import publish, query
from txbox_tools.chaos.instances import PrivatePostgres, PrivateRabbit, free_port
from txbox_tools.processes import Daemon, ProcessGroup

pytestmark = pytest.mark.slow

APP = ["--app", "tests.apps.counter:service"]
STUCK_AFTER = 2.0


def probe(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except OSError:  # not listening yet
        return 0, {}


def wait_for(
    port: int,
    path: str,
    status: int,
    daemon: Daemon,
    timeout: float = 60,
    until: Callable[[dict[str, Any]], bool] = lambda body: True,
) -> dict[str, Any]:
    def answered() -> dict[str, Any] | None:
        assert daemon.alive, daemon.log_tail()
        code, body = probe(port, path)
        return body if code == status and until(body) else None

    found = support.wait_until(answered, timeout, interval=0.2, message=f"{path} answering {status}")
    return found


def _env(database_url: str, amqp_url: str) -> dict[str, str]:
    return counter.daemon_env(
        database_url,
        amqp_url,
        TXBOX_STUCK_AFTER=f"{STUCK_AFTER}s",
        TXBOX_HEARTBEAT_INTERVAL="0.5s",
        TXBOX_WORKER_POLL_INTERVAL="0.5s",
        TXBOX_WORKER_TIMEOUT="50s",
        TXBOX_WORKER_LEASE="60s",
    )


def test_a_blocked_handler_turns_healthz_503_while_an_idle_worker_stays_200(
    processes: ProcessGroup, database_url: str, amqp_url: str
) -> None:
    env = _env(database_url, amqp_url)
    worker_port, receiver_port = free_port(), free_port()
    worker = processes.start("worker", ["worker", *APP, "--metrics-port", str(worker_port)], env=env)
    receiver = processes.start("receiver", ["receiver", *APP, "--metrics-port", str(receiver_port)], env=env)
    wait_for(worker_port, "/readyz", 200, worker)
    wait_for(receiver_port, "/readyz", 200, receiver)

    # Idle is not stuck: waiting on NOTIFY, the loop still ticks every poll interval.
    until = time.monotonic() + 2 * STUCK_AFTER
    while time.monotonic() < until:
        assert probe(worker_port, "/healthz")[0] == 200, worker.log_tail()
        assert probe(receiver_port, "/healthz")[0] == 200, receiver.log_tail()
        support.pause(0.2)  # polling pace; the assertion is each answer

    publish(amqp_url, [counter.envelope(1, sleep=40)], routing_key=counter.ROUTING_KEY)
    body = wait_for(worker_port, "/healthz", 503, worker, timeout=30)
    assert body["status"] == "stuck" and body["daemons"]["worker"]["stuck"]
    assert body["daemons"]["worker"]["seconds_since_progress"] > STUCK_AFTER
    assert probe(receiver_port, "/healthz")[0] == 200  # the receiver stored it and goes on
    assert probe(worker_port, "/readyz")[0] == 200  # stuck, not disconnected: restart it, do not just unroute it

    with urllib.request.urlopen(f"http://127.0.0.1:{worker_port}/metrics", timeout=5) as resp:
        scraped = resp.read().decode()
    match = re.search(
        r'^txbox_worker_since_progress_seconds\{service="counter-service",tenant=""\} (\S+)$', scraped, re.M
    )
    assert match and float(match.group(1)) > STUCK_AFTER  # what the alert rule in the README watches

    rows = query(database_url, "SELECT kind, now() - last_progress > interval '2 seconds' FROM txbox.daemon_heartbeats")
    assert sorted(rows) == [("receiver", False), ("worker", True)]
    processes.kill(worker)


def test_readyz_follows_postgres_and_rabbitmq(processes: ProcessGroup) -> None:
    with PrivatePostgres() as pg, PrivateRabbit() as rabbit:
        database_url = pg.create_database("probes")
        migrate.upgrade(database_url)
        env = _env(database_url, rabbit.amqp_url())
        env["TXBOX_STUCK_AFTER"] = "30s"  # outages last longer than the stuck test's bound
        port = free_port()
        daemon = processes.start("run", ["run", *APP, "--metrics-port", str(port)], env=env)
        wait_for(port, "/readyz", 200, daemon)

        pg.stop()
        # Another daemon may report the outage first (the relay's writer, say); the worker
        # learns it from its next heartbeat: wait for that, not for the first 503.
        body = wait_for(port, "/readyz", 503, daemon, until=lambda b: not b["daemons"]["worker"]["postgresql"])
        assert not body["daemons"]["worker"]["postgresql"]
        assert probe(port, "/healthz")[0] == 200  # an outage is not a hang: no restart
        pg.start()
        wait_for(port, "/readyz", 200, daemon)

        rabbit.stop()
        body = wait_for(port, "/readyz", 503, daemon)
        assert not body["daemons"]["receiver"]["rabbitmq"] and body["daemons"]["worker"] == {"postgresql": True}
        assert probe(port, "/healthz")[0] == 200
        rabbit.start()
        wait_for(port, "/readyz", 200, daemon, timeout=90)
        processes.stop_all(timeout=20)
