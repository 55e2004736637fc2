"""daemon_heartbeats: written by the heartbeat thread, read by the dashboard's overview."""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import psycopg

from framework.daemon import POSTGRESQL, RABBITMQ, Daemon
from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import serving
from framework.db import conninfo
from framework.liveness import Heartbeat, LivenessConfig
from framework.service import Service
from framework.settings import Settings
from tests.conftest import CONTRACTS
from tests.integration.dead_letters.test_dashboard import http

CONFIG = LivenessConfig(heartbeat_interval=1.0, stuck_after=30.0)  # type: ignore[arg-type]


class Publisher(Daemon):
    name = "publisher"


def _daemon(settings: Settings) -> Daemon:
    return Publisher(Service(settings=settings))


def _rows(database_url: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(conninfo(database_url)) as conn:
        return conn.execute("SELECT service, kind, host, pid, ready FROM txbox.daemon_heartbeats").fetchall()


def test_a_beat_upserts_the_row_and_sets_postgres_readiness(settings: Settings, database_url: str) -> None:
    daemon = _daemon(settings)
    heartbeat = Heartbeat([daemon], CONFIG)
    heartbeat.beat()
    assert daemon.readiness()[POSTGRESQL]
    assert _rows(database_url) == [("order-service", "publisher", socket.gethostname(), os.getpid(), False)]
    daemon.set_ready(RABBITMQ, True)
    heartbeat.beat()  # an upsert: still one row, now ready
    assert _rows(database_url) == [("order-service", "publisher", socket.gethostname(), os.getpid(), True)]
    heartbeat.close()  # a clean stop takes the row away: stopped is not missing
    assert _rows(database_url) == []


def test_an_unreachable_database_makes_the_daemon_unready(settings: Settings) -> None:
    import dataclasses

    daemon = _daemon(dataclasses.replace(settings, database_url="postgresql+psycopg://postgres@127.0.0.1:1/none"))
    daemon.set_ready(POSTGRESQL, True)
    Heartbeat([daemon], CONFIG).beat()
    assert not daemon.readiness()[POSTGRESQL]


def test_overview_shows_each_daemon_alive_stuck_or_missing(database_url: str) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute(
            """INSERT INTO txbox.daemon_heartbeats
               (service, kind, host, pid, started_at, last_progress, beat_at, beat_interval, stuck_after, ready)
               VALUES ('order-service', 'publisher', 'pod-a', 11, now() - interval '1 hour', now(), now(), 5, 60, true),
                      ('order-service', 'worker', 'pod-b', 12, now() - interval '1 hour',
                       now() - interval '10 minutes', now(), 5, 60, true),
                      ('order-service', 'receiver', 'pod-c', 13, now() - interval '1 hour',
                       now() - interval '5 minutes', now() - interval '5 minutes', 5, 60, false),
                      ('other-service', 'worker', 'pod-d', 14, now(), now(), now(), 5, 60, true)"""
        )
    source = Source("order-service", database_url, schema="txbox", contracts_dir=CONTRACTS)
    token = "t0ken-for-tests-0123456789"
    with serving(create_app([source], DashboardSettings(token=token, view_requires_token=False))) as base:
        status, _, page = http(base + "/")
        assert status == 200
        assert '<tr class="daemon-alive">' in page and "pod-a" in page
        assert '<tr class="daemon-stuck">' in page and "pod-b" in page
        assert '<tr class="daemon-missing">' in page and "pod-c" in page
        assert "pod-d" not in page  # another service's daemon is not this card's
        status, _, body = http(base + "/api/overview", headers={"Authorization": f"Bearer {token}"})
    assert status == 200
    daemons = json.loads(body)["services"][0]["daemons"]
    assert [(d["kind"], d["status"]) for d in daemons] == [
        ("publisher", "alive"),
        ("receiver", "missing"),
        ("worker", "stuck"),
    ]
