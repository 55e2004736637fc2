"""A receiver waiting for its turn says so in its heartbeat row, on the dashboard and in /readyz.

Real receivers on the real servers: the wait comes from another receiver consuming the
inbox queue (standby) or from a plain pika consumer holding it (taking over, as the
consumer of a RabbitMQ node lost for good stays counted). The wait ends when the other
consumer goes, and every view of it clears (docs/explanation/operations.md, "Probes, logs and
liveness").
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pika
import psycopg

from framework import migrate, names, topology
from framework.daemon import POSTGRESQL, Daemon
from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import serving
from framework.db import conninfo
from framework.liveness import Heartbeat, LivenessConfig
from framework.probes import ProbeServer
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from tests import support
from tests.apps.helpers import running
from tests.conftest import CONTRACTS
from tests.integration.dead_letters.test_dashboard import http

QUEUE = names.inbox_queue("order-service")
CONFIG = LivenessConfig(heartbeat_interval=1.0, stuck_after=30.0)  # type: ignore[arg-type]
TOKEN = "t0ken-for-tests-0123456789"


def _row(database_url: str) -> tuple[Any, ...] | None:
    """(waiting_queue, waiting_detail, seconds since waiting_since) of the receiver's row, if any."""
    with psycopg.connect(conninfo(database_url)) as conn:
        row = conn.execute(
            "SELECT waiting_queue, waiting_detail, extract(epoch FROM clock_timestamp() - waiting_since)::float8 "
            "FROM txbox.daemon_heartbeats WHERE kind = 'receiver'"
        ).fetchone()
    return None if row is None else tuple(row)


class Views:
    """The receiver's wait as the dashboard (page and JSON API) and its /readyz show it."""

    def __init__(self, dashboard: str, probes: str) -> None:
        self.dashboard = dashboard
        self.probes = probes

    def page(self) -> str:
        status, _, page = http(self.dashboard + "/")
        assert status == 200, page
        return page

    def api(self) -> dict[str, Any] | None:
        status, _, body = http(self.dashboard + "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, body
        daemons = json.loads(body)["services"][0]["daemons"]
        assert [d["kind"] for d in daemons] == ["receiver"]
        waiting: dict[str, Any] | None = daemons[0]["waiting"]
        return waiting

    def readyz(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.probes + "/readyz", timeout=30) as resp:
            assert resp.status == 200, "a receiver waiting for its turn is ready"
            body: dict[str, Any] = json.loads(resp.read())
        return body


@contextmanager
def watched(receiver: Daemon, database_url: str) -> Iterator[Views]:
    """Beat ``receiver``'s row every second and serve its /readyz and a dashboard of its service."""
    heartbeat = Heartbeat([receiver], CONFIG).start()
    probes = ProbeServer([receiver], 0, "127.0.0.1", float(CONFIG.stuck_after)).start()
    source = Source("order-service", database_url, schema="txbox", contracts_dir=CONTRACTS)
    try:
        with serving(create_app([source], DashboardSettings(token=TOKEN, view_requires_token=False))) as base:
            yield Views(base, f"http://127.0.0.1:{probes.port}")
    finally:
        probes.close()
        heartbeat.close()


def _check_the_wait_shows_and_grows(views: Views, database_url: str, state: str) -> None:
    row = support.wait_until(
        lambda: (r := _row(database_url)) is not None and r[0] == QUEUE and r, 30, message="the row carries the wait"
    )
    _, detail, seconds = row
    assert detail.startswith(f"{state}: ") and QUEUE in detail, detail
    # Past several beats: a wait that restarted with every beat would never get there.
    beyond = seconds + 3 * float(CONFIG.heartbeat_interval)
    support.wait_until(lambda: (_row(database_url) or (0, 0, 0))[2] > beyond, 30, message="the row's wait grows")

    page = views.page()
    assert f"waiting for its turn on {QUEUE} for " in page
    assert f'<div class="waiting-detail">{state}: ' in page

    waiting = views.api()
    assert waiting is not None and waiting["queue"] == QUEUE and waiting["detail"].startswith(f"{state}: ")
    beyond = waiting["seconds"] + 3 * float(CONFIG.heartbeat_interval)
    support.wait_until(lambda: (views.api() or {}).get("seconds", 0) > beyond, 30, message="the dashboard's wait grows")

    ready = views.readyz()["waiting"]["receiver"]
    assert (ready["state"], ready["queue"]) == (state, QUEUE)
    support.wait_until(
        lambda: views.readyz()["waiting"]["receiver"]["seconds"] > ready["seconds"], 30, message="/readyz's wait grows"
    )


def _check_the_wait_clears(views: Views, database_url: str, receiver: Receiver) -> None:
    support.wait_until(lambda: receiver.consuming, 60, message="the receiver gets its turn")
    support.wait_until(lambda: _row(database_url) == (None, None, None), 30, message="the row's wait is cleared")
    assert views.api() is None
    assert "waiting for its turn" not in views.page()
    assert "waiting" not in views.readyz()


def test_a_standby_receivers_wait_shows_everywhere_and_clears_when_it_takes_over(
    service: Service, database_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    first, second = Receiver(service, ReceiverConfig()), Receiver(service, ReceiverConfig())
    with running(first):
        support.wait_until(lambda: first.consuming, 30, message="the first receiver consumes")
        with running(second), watched(second, database_url) as views:
            support.wait_until(lambda: second._state == "standby", 30, message="the second receiver stands by")
            _check_the_wait_shows_and_grows(views, database_url, "standby")
            first.stop()
            _check_the_wait_clears(views, database_url, second)


def test_a_receiver_taking_over_from_a_consumer_still_counted_shows_its_wait_until_it_leaves(
    service: Service, database_url: str, amqp_url: str
) -> None:
    topology.declare(service.settings, service.registry)
    with rival_consumer(amqp_url) as leave:
        # A long connect timeout makes the takeover bound (framework.receiver.turns) 72 s:
        # the wait ends when the rival leaves, not by the bound, whatever the machine's speed.
        receiver = Receiver(service, ReceiverConfig(db_connect_timeout=60))
        with running(receiver), watched(receiver, database_url) as views:
            support.wait_until(lambda: receiver._state == "taking over", 30, message="the receiver takes over")
            _check_the_wait_shows_and_grows(views, database_url, "taking over")
            leave()
            _check_the_wait_clears(views, database_url, receiver)


@contextmanager
def rival_consumer(amqp_url: str) -> Iterator[Callable[[], None]]:
    """A plain pika consumer on the inbox queue; calling the value it gives makes it leave."""
    params = pika.URLParameters(amqp_url)
    params.heartbeat = 0  # nobody pumps this connection's events while it holds the queue
    connection = pika.BlockingConnection(params)
    channel = connection.channel()
    channel.basic_consume(QUEUE, lambda *_: None)

    def leave() -> None:
        if connection.is_open:
            connection.close()

    try:
        yield leave
    finally:
        leave()


def test_a_table_before_migration_0010_gets_beats_without_the_wait(service: Service, database_url: str) -> None:
    """New daemons before `txbox migrate`: still ready, still on the dashboard, no wait shown."""
    migrate.downgrade(database_url, revision="0009")
    receiver = Receiver(service, ReceiverConfig())
    receiver._wait_for("standby", f"another receiver consumes {QUEUE}")  # what its loop records
    heartbeat = Heartbeat([receiver], CONFIG)
    heartbeat.beat()
    heartbeat.beat()
    assert receiver.readiness()[POSTGRESQL], "a table without the columns still counts as reachable"
    source = Source("order-service", database_url, schema="txbox", contracts_dir=CONTRACTS)
    with serving(create_app([source], DashboardSettings(token=TOKEN, view_requires_token=False))) as base:
        status, _, body = http(base + "/api/overview", headers={"Authorization": f"Bearer {TOKEN}"})
        assert status == 200, body
        daemons = json.loads(body)["services"][0]["daemons"]
        assert [(d["kind"], d["waiting"]) for d in daemons] == [("receiver", None)]
        status, _, page = http(base + "/")
        assert status == 200 and "waiting for its turn" not in page
    heartbeat.close()
