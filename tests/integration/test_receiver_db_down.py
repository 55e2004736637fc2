"""PostgreSQL down: deliveries go round the delay/retry chain, nothing is lost.

The chain: docs/explanation/relay.md, "The topology". The database is a private cluster
this test owns (initdb + pg_ctl on a free port, run as the ``postgres`` user), so it can
be stopped and started again without disturbing anyone else. The retry schedule is
shortened to 1 s delays; the receiver declares the ``delay:1s`` queue itself, shaped
like the standard ``delay:10s``/``delay:30s``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pika
import psycopg
import pytest

from framework import metrics, migrate, names, topology
from framework.receiver import Receiver, ReceiverConfig
from framework.service import Service
from framework.settings import Settings
from tests import support
from tests.apps.helpers import encode, place_order, publish, queue_depth, running
from txbox_tools.chaos.instances import PrivateRabbit

BIN = Path("/usr/lib/postgresql/15/bin")
CONTRACTS = Path(__file__).resolve().parents[2] / "contracts"


@dataclass
class Cluster:
    data: Path
    socket_dir: Path
    port: int

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/orders"

    def _ctl(self, *args: str) -> None:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(BIN / "pg_ctl"), "-D", str(self.data), *args],
            check=True,
            capture_output=True,
            timeout=60,
        )

    def start(self) -> None:
        options = f"-p {self.port} -k {self.socket_dir} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "-l", str(self.data.parent / "log"), "-w", "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "-w", "stop")

    def running(self) -> bool:
        return (self.data / "postmaster.pid").exists()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def pg_cluster() -> Iterator[Cluster]:
    """One private cluster for the module (initdb is the slow part); each test gets a fresh database."""
    if os.geteuid() != 0 or not (BIN / "initdb").exists():
        pytest.fail("this test runs initdb as the postgres user: needs root and PostgreSQL 15 binaries in " + str(BIN))
    root = Path(tempfile.mkdtemp(prefix="txbox-pg-"))
    shutil.chown(root, "postgres")
    cluster = Cluster(root / "data", root, _free_port())
    subprocess.run(
        ["runuser", "-u", "postgres", "--", str(BIN / "initdb"), "-D", str(cluster.data), "-A", "trust",
         "-U", "postgres", "--no-sync"],
        check=True, capture_output=True, timeout=120,
    )  # fmt: skip
    cluster.start()
    try:
        yield cluster
    finally:
        subprocess.run(
            ["runuser", "-u", "postgres", "--", str(BIN / "pg_ctl"), "-D", str(cluster.data), "-m", "immediate",
             "stop"],
            check=False, capture_output=True, timeout=60,
        )  # fmt: skip
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def cluster(pg_cluster: Cluster) -> Cluster:
    """The module's cluster running (a failed test may have left it stopped), with a new `orders` database."""
    if not pg_cluster.running():
        pg_cluster.start()
    admin = f"host=127.0.0.1 port={pg_cluster.port} user=postgres dbname=postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS orders WITH (FORCE)")
        conn.execute("CREATE DATABASE orders")
    migrate.upgrade(pg_cluster.url)
    return pg_cluster


@pytest.fixture
def service(cluster: Cluster, amqp_url: str) -> Service:
    settings = Settings(
        service="order-service",
        database_url=cluster.url,
        amqp_url=amqp_url,
        contracts_dir=CONTRACTS,
        queue_type=os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),  # type: ignore[arg-type]
    )
    service = Service(settings=settings)
    topology.declare(service.settings, service.registry)
    return service


def stored(cluster: Cluster) -> dict[str, dict[str, object]]:
    with psycopg.connect(f"host=127.0.0.1 port={cluster.port} user=postgres dbname=orders") as conn:
        return {str(i): m for i, m in conn.execute("SELECT id, metadata FROM txbox.inbox").fetchall()}


def delayed() -> float:
    return metrics.RECEIVER_DELAYED.labels(**metrics.labels("order-service"))._value.get()


def test_deliveries_wait_in_the_delay_chain_until_the_database_is_back(cluster: Cluster, service: Service,
                                                                       amqp_url: str) -> None:  # fmt: skip
    config = ReceiverConfig(retry_schedule="1s*4", batch_size=50, prefetch=100, db_connect_timeout=2)
    before = place_order()
    during = [place_order(aggregate_id=str(i)) for i in range(20)]
    with running(Receiver(service, config)):
        publish(amqp_url, [encode(before)])
        support.wait_until(lambda: before["message_id"] in stored(cluster), 20, message="the first message")
        cluster.stop()
        start = delayed()
        publish(amqp_url, [encode(m) for m in during])
        # Every delivery goes round the chain at least twice while the database is down.
        support.wait_until(lambda: delayed() - start >= 2 * len(during), 30, message="retries through delay:1s")
        cluster.start()
        expected = {m["message_id"] for m in (before, *during)}
        support.wait_until(lambda: set(stored(cluster)) == expected, 30, message="every message stored")
    inbox = stored(cluster)
    for message in during:
        headers = inbox[message["message_id"]]["properties"]["headers"]  # type: ignore[index]
        assert headers[names.HEADER_ATTEMPT] >= 2, "stored after a lap of the delay chain"
    assert queue_depth(amqp_url, names.inbox_queue("order-service")) == 0
    assert queue_depth(amqp_url, names.dead_letter_queue("order-service")) == 0


def test_when_the_chain_runs_out_the_delivery_is_dead_lettered_with_a_confirm(cluster: Cluster, service: Service,
                                                                              amqp_url: str) -> None:  # fmt: skip
    config = ReceiverConfig(retry_schedule="1s*2", db_connect_timeout=2)
    messages = [place_order(aggregate_id=str(i)) for i in range(3)]
    cluster.stop()
    dead_queue = names.dead_letter_queue("order-service")
    with running(Receiver(service, config)):
        publish(amqp_url, [encode(m) for m in messages])
        support.wait_until(lambda: queue_depth(amqp_url, dead_queue) == 3, 40, message="the dead_letter queue")
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        got = {}
        for _ in range(3):
            method, props, body = channel.basic_get(dead_queue, auto_ack=True)
            assert method is not None
            got[props.message_id or body] = (props.headers, body)
    finally:
        connection.close()
    bodies = {body for _, body in got.values()}
    assert bodies == {encode(m) for m in messages}, "the original bodies, untouched"
    for headers, _ in got.values():
        # Two scheduled retries, then the final one (attempt 4), then a confirmed copy to
        # the dead_letter exchange (not a reject: broker dead-lettering is at most once).
        assert headers[names.HEADER_ATTEMPT] == 4 and headers[names.HEADER_FINAL_ATTEMPT] is True
        assert headers[names.HEADER_DEAD_REASON] == "retries_exhausted"
        assert "(attempt 4)" in headers[names.HEADER_DEAD_ERROR]
        assert all(death["reason"] == "expired" for death in headers["x-death"]), "only the delay hops"
    assert queue_depth(amqp_url, names.inbox_queue("order-service")) == 0


@pytest.fixture
def private_rabbit() -> Iterator[PrivateRabbit]:
    """A node of this test's own: with the fix undone, the test kills the node's dead-letter workers."""
    with PrivateRabbit(management=False) as node:
        yield node


def test_a_senders_malformed_death_headers_do_not_stop_the_delay_chain(
    cluster: Cluster, private_rabbit: PrivateRabbit
) -> None:
    """RabbitMQ 3.10 crashes dead-lettering a message whose ``x-death`` holds a non-table.

    The delay queue dead-letters every parked copy when its TTL runs out. A copy carrying
    the sender's malformed ``x-death`` crashed the queue's dead-letter worker until its
    supervisor gave up: every retry parked behind it (of every service on the node) stayed
    in the delay queue for good. The copies now leave a stranger's death headers behind.
    """
    amqp_url = private_rabbit.amqp_url()
    service = Service(
        settings=Settings(service="order-service", database_url=cluster.url, amqp_url=amqp_url, contracts_dir=CONTRACTS)
    )
    topology.declare(service.settings, service.registry)
    config = ReceiverConfig(retry_schedule="1s*4", db_connect_timeout=2)
    forged = place_order(aggregate_id="forged")
    others = [place_order(aggregate_id=str(i)) for i in range(5)]
    headers = {"x-death": ["not a table"], "x-first-death-reason": 5, "x-first-death-queue": {"a": 1}}
    props = [pika.BasicProperties(content_type="application/json", headers=headers)] + [None] * len(others)
    cluster.stop()
    with running(Receiver(service, config)):
        start = delayed()
        publish(amqp_url, [encode(m) for m in (forged, *others)], properties=props)  # type: ignore[arg-type]
        # Twice round the chain: the first lap's copies have expired out of the delay queue.
        support.wait_until(lambda: delayed() - start >= 2 * 6, 40, message="two laps of the delay chain")
        cluster.start()
        expected = {m["message_id"] for m in (forged, *others)}
        support.wait_until(lambda: set(stored(cluster)) == expected, 30, message="every message stored")
    kept = stored(cluster)[forged["message_id"]]["properties"]["headers"]  # type: ignore[index]
    assert {death["queue"] for death in kept["x-death"]} == {names.delay_queue(1)}, "only our chain's deaths"
