"""The example saga end to end with the real daemons, started through the `txbox` command.

order-service and inventory-service each get a database of their own (framework +
business migrations) in one test vhost. Orders come from the order service's own outbox
(as its front end would write them) and from a plain pika client publishing the Mosaic
envelope (as another team's service would), once of them twice with the same
``message_id``.
"""

from __future__ import annotations

import functools
import json
import random
import re
import signal
import socket
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from sqlalchemy.orm import Session

from examples import _defaults, demo, migrate
from examples.demo import load_app
from framework import Service
from framework.envelope import format_timestamp
from tests import support
from txbox_tools.processes import ProcessGroup

ORDERS_APP = "examples.orders.app:service"
INVENTORY_APP = "examples.inventory.app:service"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def saga_databases(template_db: str) -> Iterator[dict[str, str]]:
    """Two databases cloned from the migrated template, plus each service's own history."""
    made = {short: support.unique(f"txbox_saga_{short}") for short in ("orders", "inventory")}
    try:
        urls = {}
        for short, name in made.items():
            support.create_database(name, template=template_db)
            urls[short] = support.db_url(name)
            migrate.upgrade(short, urls[short])
        yield urls
    finally:
        for name in made.values():
            support.drop_database(name)


@pytest.fixture
def services(saga_databases: dict[str, str], amqp_url: str) -> Iterator[dict[str, Service]]:
    apps = {
        "orders": load_app(ORDERS_APP, saga_databases["orders"], amqp_url),
        "inventory": load_app(INVENTORY_APP, saga_databases["inventory"], amqp_url),
    }
    yield apps
    for app in apps.values():
        app.engine.dispose()


@pytest.fixture
def group(tmp_path: Path) -> Iterator[ProcessGroup]:
    processes = ProcessGroup(tmp_path / "logs")
    try:
        yield processes
    finally:
        processes.stop_all()


def start(group: ProcessGroup, short: str, app: str, service: Service, *extra: str, run: bool = False) -> int:
    """The service's daemons as processes; returns the receiver's metrics port."""
    env = {"TXBOX_DATABASE_URL": service.settings.database_url, "TXBOX_AMQP_URL": service.settings.amqp_url}
    port = free_port()
    if run:
        group.start(f"{short}-run", ["run", "--app", app, "--metrics-port", str(port)], env)
        return port
    group.start(f"{short}-publisher", ["publisher", "--app", app], env)
    group.start(f"{short}-receiver", ["receiver", "--app", app, "--metrics-port", str(port)], env)
    group.start(f"{short}-worker", ["worker", "--app", app], env)
    return port


def metric(port: int, name: str) -> float:
    """Sum of a Prometheus counter's samples served by a daemon (0 when not yet there)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            text = response.read().decode()
    except OSError:
        return 0.0
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? ([0-9.e+]+)$", text, re.MULTILINE))


def rows(url: str, query: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(url.replace("+psycopg", "")) as conn:
        return conn.execute(query, params).fetchall()


def final_orders(url: str) -> int:
    return int(rows(url, "SELECT count(*) FROM orders WHERE status <> 'placed'")[0][0])


def outbox_drained(url: str) -> bool:
    return rows(url, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NULL") == [(0,)]


def mosaic_envelope(order_id: str, correlation_id: str) -> tuple[str, bytes]:
    """A PlaceOrder exactly as a Mosaic service would publish it (docs/explanation/relay.md, "The envelope")."""
    message_id = str(uuid.uuid4())
    body = {
        "payload": {"customer": "other-team", "sku": "SKU-A", "quantity": 1},
        "message_context": {"correlation_id": correlation_id},
        "message_id": message_id,
        "timestamp": format_timestamp(datetime.now(UTC)),
        "message_type": "PlaceOrder",
        "aggregate_id": order_id,
        "aggregate_type": "order",
        "message_version": "1.0",
        "auth_token": "eyJhbGciOiJub25lIn0.eyJzdWIiOiJ0ZXN0In0.",
    }
    return message_id, json.dumps(body).encode()


def publish_plain(amqp_url: str, message_id: str, body: bytes, times: int = 1) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        props = pika.BasicProperties(
            content_type="application/json", delivery_mode=2, message_id=message_id, type="PlaceOrder"
        )
        for _ in range(times):
            channel.basic_publish("command", "order-service.order.place", body, props, mandatory=True)
    finally:
        connection.close()


def place(orders: Service, order_id: str, sku: str, quantity: int, correlation_id: str) -> None:
    with Session(orders.engine) as session, session.begin():
        orders.outbox(session).send_command(
            "PlaceOrder",
            aggregate_id=order_id,
            payload={"customer": "ada", "sku": sku, "quantity": quantity},
            message_context={"correlation_id": correlation_id},
        )


def restock(inventory: Service, sku: str, quantity: int) -> None:
    with Session(inventory.engine) as session, session.begin():
        inventory.outbox(session).send_command(
            "RestockItem",
            aggregate_id=sku,
            payload={"sku": sku, "quantity": quantity},
            auth_token=_defaults.demo_token("inventory:restock"),
        )


def test_saga_end_to_end(services: dict[str, Service], group: ProcessGroup) -> None:
    orders, inventory = services["orders"], services["inventory"]
    orders_url, inventory_url = orders.settings.database_url, inventory.settings.database_url
    metrics_port = start(group, "orders", ORDERS_APP, orders)
    start(group, "inventory", INVENTORY_APP, inventory, run=True)  # all of it in one `txbox run`

    restock(inventory, "SKU-A", 9)
    support.wait_until(
        lambda: rows(inventory_url, "SELECT available FROM stock WHERE sku = 'SKU-A'") == [(9,)],
        timeout=60,
        message="RestockItem handled by the inventory's daemons",
    )
    place(orders, "o-1", "SKU-A", 4, "corr-1")
    place(orders, "o-2", "SKU-A", 4, "corr-2")
    support.wait_until(lambda: final_orders(orders_url) == 2, timeout=60, message="two orders completed")
    place(orders, "o-3", "SKU-A", 4, "corr-3")  # only 1 left
    place(orders, "o-4", "SKU-NOPE", 1, "corr-4")  # no such product
    support.wait_until(lambda: final_orders(orders_url) == 4, timeout=60, message="two orders cancelled")

    # Another team's service: a plain pika client publishing the envelope, twice.
    message_id, body = mosaic_envelope("o-5", "corr-5")
    publish_plain(orders.settings.amqp_url, message_id, body, times=2)

    support.wait_until(lambda: final_orders(orders_url) == 5, timeout=60, message="all five orders final")
    support.wait_until(
        lambda: metric(metrics_port, "txbox_receiver_duplicates_total") >= 1,
        timeout=30,
        message="the receiver saw the duplicate delivery of o-5",
    )

    got = {
        r[0]: r[1:]
        for r in rows(orders_url, "SELECT id, status, reason, correlation_id, final_transitions FROM orders")
    }
    assert got == {
        "o-1": ("completed", None, "corr-1", 1),
        "o-2": ("completed", None, "corr-2", 1),
        "o-3": ("cancelled", "only 1 left", "corr-3", 1),
        "o-4": ("cancelled", "unknown sku", "corr-4", 1),
        "o-5": ("completed", None, "corr-5", 1),
    }
    # The duplicate was stored once and handled once: one inbox row, one OrderPlaced.
    assert rows(orders_url, "SELECT count(*) FROM txbox.inbox WHERE id = %s", uuid.UUID(message_id)) == [(1,)]
    assert rows(
        orders_url, "SELECT count(*) FROM txbox.outbox WHERE message_type = 'OrderPlaced' AND aggregate_id = 'o-5'"
    ) == [(1,)]
    # The correlation id crossed both services and came back (copied by the worker).
    reservations = dict(rows(inventory_url, "SELECT order_id, correlation_id FROM reservations"))
    assert reservations == {f"o-{n}": f"corr-{n}" for n in range(1, 6)}
    contexts = rows(
        orders_url,
        "SELECT message_type, message_context ->> 'correlation_id' FROM txbox.outbox WHERE aggregate_id = 'o-5' "
        "ORDER BY created_at",
    )
    assert contexts == [("OrderPlaced", "corr-5"), ("OrderCompleted", "corr-5")]
    assert rows(inventory_url, "SELECT available, reserved FROM stock WHERE sku = 'SKU-A'") == [(0, 9)]
    # Nothing was abandoned anywhere, and the final events left both outboxes.
    for url in (orders_url, inventory_url):
        assert rows(url, "SELECT count(*) FROM txbox.dead_letters") == [(0,)]
        support.wait_until(
            functools.partial(outbox_drained, url),
            timeout=30,
            message="every outbox row published",
        )
    assert not group.dead(), [d.log_tail() for d in group.dead()]
    # SIGTERM stops every daemon of `txbox run` cleanly.
    run = next(d for d in group.daemons if d.name == "inventory-run")
    assert group.stop(run) == 0, run.log_tail()
    assert "stopped" in run.log_tail(10)


def test_saga_survives_daemons_killed_mid_flight(services: dict[str, Service], group: ProcessGroup) -> None:
    """kill -9 a worker and a publisher while orders flow: every order still ends exactly once."""
    orders, inventory = services["orders"], services["inventory"]
    orders_url, inventory_url = orders.settings.database_url, inventory.settings.database_url
    start(group, "orders", ORDERS_APP, orders)
    start(group, "inventory", INVENTORY_APP, inventory)
    total, skus = 400, ["SKU-A", "SKU-B"]
    stock = dict.fromkeys(skus, 2_000)  # more than 400 orders of at most 5 can take
    demo.restock(inventory, stock)
    support.wait_until(lambda: demo.stocked(inventory, stock), timeout=60, message="restocked")
    rng = random.Random(1)
    for first in range(0, total, 100):
        demo.place_orders(orders, first, 100, skus, rng)
    support.wait_until(lambda: final_orders(orders_url) >= 20, timeout=60, message="the saga under way")
    env = {"TXBOX_DATABASE_URL": orders_url, "TXBOX_AMQP_URL": orders.settings.amqp_url}
    for name, argv in (
        ("orders-worker", ["worker", "--app", ORDERS_APP]),
        ("inventory-publisher", ["publisher", "--app", INVENTORY_APP]),
    ):
        victim = next(d for d in group.daemons if d.name == name and d.alive)
        group.kill(victim)
        assert victim.process.returncode == -signal.SIGKILL
        if name.startswith("inventory"):
            env = {"TXBOX_DATABASE_URL": inventory_url, "TXBOX_AMQP_URL": inventory.settings.amqp_url}
        group.start(f"{name}-again", argv, env)
    support.wait_until(lambda: final_orders(orders_url) == total, timeout=120, message="every order final")
    summary = demo.summarize(orders_url, inventory_url, total, 1.0, sum(stock.values()))
    failed = [(name, detail) for name, passed, detail in summary.checks if not passed]
    assert not failed, failed
    assert summary.completed == total  # enough stock for all


def test_business_and_framework_histories_coexist(saga_databases: dict[str, str]) -> None:
    """Each example's own Alembic history lives beside the framework's, in one database."""
    from alembic import command

    from framework import migrate as framework_migrate

    url = saga_databases["orders"]
    head = framework_migrate.current(url)
    assert head is not None
    assert migrate.business_revision(url) == "orders_0001"  # public.alembic_version
    assert rows(url, "SELECT version_num FROM txbox.txbox_alembic_version") == [(head,)]

    command.downgrade(migrate.config("orders", url), "base")  # the service's history only
    assert migrate.business_revision(url) is None
    assert rows(url, "SELECT to_regclass('public.orders')") == [(None,)]
    assert framework_migrate.current(url) == head  # the framework's tables are untouched
    assert rows(url, "SELECT count(*) FROM txbox.outbox") == [(0,)]

    migrate.upgrade("orders", url)  # both to head again: idempotent for the framework
    assert migrate.business_revision(url) == "orders_0001"
    assert rows(url, "SELECT to_regclass('public.orders')::text") == [("orders",)]
