"""/metrics, /healthz and /readyz of one process, over HTTP, with daemons that do not run."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from framework.daemon import POSTGRESQL, RABBITMQ, Daemon
from framework.errors import ConfigurationError
from framework.liveness import LivenessConfig
from framework.probes import ProbeServer
from framework.service import Service
from framework.settings import Settings
from tests.conftest import CONTRACTS


class Idle(Daemon):
    name = "publisher"


class PostgresOnly(Daemon):
    name = "worker"
    needs = (POSTGRESQL,)


def _daemon(cls: type[Daemon]) -> Daemon:
    settings = Settings(
        service="order-service",
        database_url="postgresql+psycopg://postgres@127.0.0.1:1/none",
        amqp_url="amqp://guest:guest@127.0.0.1:1/",
        contracts_dir=CONTRACTS,
    )  # type: ignore[arg-type]
    return cls(Service(settings=settings))


def get(url: str) -> tuple[int, dict[str, Any] | str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            status, body, kind = resp.status, resp.read().decode(), resp.headers["Content-Type"]
    except urllib.error.HTTPError as exc:
        status, body, kind = exc.code, exc.read().decode(), exc.headers["Content-Type"]
    return status, json.loads(body) if kind == "application/json" else body


@pytest.fixture
def daemons() -> list[Daemon]:
    return [_daemon(Idle), _daemon(PostgresOnly)]


@pytest.fixture
def base(daemons: list[Daemon]) -> Iterator[str]:
    server = ProbeServer(daemons, 0, "127.0.0.1", stuck_after=5.0).start()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        server.close()


def test_healthz_turns_503_naming_the_daemon_without_progress(base: str, daemons: list[Daemon]) -> None:
    assert get(base + "/healthz")[0] == 200
    daemons[1].last_progress -= 6  # as if its loop had not turned for 6 s
    status, body = get(base + "/healthz")
    assert status == 503 and isinstance(body, dict)
    assert body["daemons"]["worker"]["stuck"] and not body["daemons"]["publisher"]["stuck"]
    daemons[1].progress()
    assert get(base + "/healthz")[0] == 200


def test_readyz_needs_every_dependency_of_every_daemon(base: str, daemons: list[Daemon]) -> None:
    publisher, worker = daemons
    status, body = get(base + "/readyz")
    assert status == 503 and body == {
        "status": "not ready",
        "daemons": {"publisher": {"postgresql": False, "rabbitmq": False}, "worker": {"postgresql": False}},
    }
    for daemon in daemons:
        daemon.set_ready(POSTGRESQL, True)
    worker.set_ready(RABBITMQ, True)  # not one of the worker's needs: ignored
    assert get(base + "/readyz")[0] == 503
    publisher.set_ready(RABBITMQ, True)
    assert get(base + "/readyz")[0] == 200
    publisher.set_ready(RABBITMQ, False)
    assert get(base + "/readyz")[0] == 503


def test_metrics_and_unknown_paths(base: str) -> None:
    import framework.metrics  # noqa: F401 - registers the series

    status, body = get(base + "/metrics")
    assert status == 200 and "txbox_publisher_oldest_due_age_seconds" in str(body)
    assert get(base + "/nope")[0] == 404


def test_a_taken_port_fails_at_start_naming_the_fix(daemons: list[Daemon]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(ConfigurationError, match="--metrics-port"):
            ProbeServer(daemons, taken.getsockname()[1], "127.0.0.1", 5.0)


def test_liveness_config_rejects_a_bound_shorter_than_the_heartbeat() -> None:
    with pytest.raises(ConfigurationError, match="TXBOX_STUCK_AFTER"):
        LivenessConfig.from_env(stuck_after="2s", heartbeat_interval="5s")
    assert LivenessConfig.from_env().metrics_addr == "127.0.0.1"
