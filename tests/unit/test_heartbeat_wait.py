"""The wait columns of a heartbeat row: from Daemon.waiting(), bounded to migration 0010's checks."""

from __future__ import annotations

from typing import Any

from framework import liveness
from framework.daemon import Daemon
from framework.service import Service
from framework.settings import Settings
from framework.sql import heartbeats
from tests.conftest import CONTRACTS


class Waiting(Daemon):
    name = "receiver"
    wait: dict[str, Any] | None = None

    def waiting(self) -> dict[str, Any] | None:
        return self.wait


def _daemon() -> Waiting:
    settings = Settings(
        service="order-service",
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/none",
        amqp_url="amqp://guest:guest@127.0.0.1:1/",
        contracts_dir=CONTRACTS,
    )  # type: ignore[arg-type]
    return Waiting(Service(settings=settings))


def test_no_wait_is_three_nulls() -> None:
    assert liveness._wait(_daemon()) == {"waiting_seconds": None, "waiting_queue": None, "waiting_detail": None}


def test_a_wait_is_its_queue_state_and_detail_and_seconds() -> None:
    daemon = _daemon()
    daemon.wait = {"state": "standby", "detail": "another receiver consumes q", "queue": "q", "seconds": 12.5}
    assert liveness._wait(daemon) == {
        "waiting_seconds": 12.5,
        "waiting_queue": "q",
        "waiting_detail": "standby: another receiver consumes q",
    }


def test_texts_are_cut_to_the_columns_bounds() -> None:
    daemon = _daemon()
    daemon.wait = {"state": "taking over", "detail": "d" * 5000, "queue": "q" * 5000, "seconds": 1.0}
    row = liveness._wait(daemon)
    assert row["waiting_queue"] == "q" * heartbeats.MAX_QUEUE_CHARS
    assert isinstance(row["waiting_detail"], str) and len(row["waiting_detail"]) == heartbeats.MAX_DETAIL_CHARS


def test_the_dashboards_view_nests_the_wait() -> None:
    from datetime import UTC, datetime

    now = datetime.now(UTC)
    beat = heartbeats.Beat("s", "receiver", "h", 1, now, now, now, 0.0, 0.0, 60.0, 5.0, True)
    assert beat.view()["waiting"] is None and not any(k.startswith("waiting_") for k in beat.view())
    waiting = heartbeats.Beat(
        "s", "receiver", "h", 1, now, now, now, 0.0, 0.0, 60.0, 5.0, True, now, "q", "standby: x", 3.25
    )
    assert waiting.view()["waiting"] == {"queue": "q", "detail": "standby: x", "since": now, "seconds": 3.25}
