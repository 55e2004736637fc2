"""`txbox topology` against the real broker: every exchange, queue, argument and binding, beside Mosaic's."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pika
import pytest

from framework import names, topology
from framework.contracts import load_registry
from framework.errors import TopologyMismatch
from framework.settings import Settings
from tests import support
from tests.conftest import CONTRACTS, ROOT

TXBOX = str(Path(sys.executable).parent / "txbox")


def broker_state(vhost: str) -> tuple[dict[str, dict], dict[str, dict], set[tuple[str, str, str]]]:  # type: ignore[type-arg]
    v = support.vhost_path(vhost)
    exchanges = {e["name"]: e for e in support.mgmt("GET", f"/exchanges/{v}") if not e["name"].startswith("amq.")}
    exchanges.pop("", None)
    queues = {q["name"]: q for q in support.mgmt("GET", f"/queues/{v}")}
    bindings = {
        (b["source"], b["destination"], b["routing_key"])
        for b in support.mgmt("GET", f"/bindings/{v}")
        if b["source"] and b["destination_type"] == "queue"
    }
    return exchanges, queues, bindings


def expected_bindings(service: str, queue_type: str) -> set[tuple[str, str, str]]:
    inbox = f"{service}:inbox"
    if service == "order-service":
        own = {
            ("command", inbox, "order-service.order.place"),
            ("event", inbox, "inventory-service.stock.reserved"),
            ("event", inbox, "inventory-service.stock.rejected"),
        }
    else:
        own = {("command", inbox, "inventory-service.stock.restock"), ("event", inbox, "order-service.order.placed")}
    return own | {
        ("retry", inbox, f"{inbox}.#"),
        ("dead_letter", f"{service}:dead_letter", f"{service}.dead_letter"),
        ("delay", "delay:10s", "delay.10s"),
        ("delay", "delay:30s", "delay.30s"),
        ("delay", "delay:10s:at-least-once", "delay.10s.at-least-once"),
        ("delay", "delay:30s:at-least-once", "delay.30s.at-least-once"),
    }


# What Mosaic's message bus (@axinom/mosaic-message-bus 0.33) declares for the same names,
# read from its rascal configuration: shared delay queues with exactly these arguments,
# the inbox queue of a service it sends commands to, and topic exchanges with defaults.
MOSAIC_DELAY_ARGUMENTS = {10: {"x-message-ttl": 10_000, "x-dead-letter-exchange": "retry", "x-queue-type": "quorum"}}
MOSAIC_DELAY_ARGUMENTS[30] = {**MOSAIC_DELAY_ARGUMENTS[10], "x-message-ttl": 30_000}


def declare_as_mosaic(amqp_url: str, *, sends_commands_to: str) -> None:
    """Raw declarations, as a Mosaic service starting on the vhost makes them."""
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        for exchange in ("command", "event", "delay", "retry", "dead_letter"):
            ch.exchange_declare(exchange, exchange_type="topic", durable=True)
        for seconds, arguments in MOSAIC_DELAY_ARGUMENTS.items():
            ch.queue_declare(f"delay:{seconds}s", durable=True, arguments=arguments)
            ch.queue_bind(f"delay:{seconds}s", "delay", routing_key=f"delay.{seconds}s")
        for service in ("mosaic-peer", sends_commands_to):
            ch.queue_declare(
                f"{service}:inbox",
                durable=True,
                arguments={
                    "x-dead-letter-exchange": "dead_letter",
                    "x-dead-letter-routing-key": f"{service}.dead_letter",
                    "x-queue-type": "quorum",
                },
            )
        ch.queue_declare("mosaic-peer:dead_letter", durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        conn.close()


@pytest.mark.parametrize("queue_type", ["quorum", "classic"])
def test_declares_exactly_design_section_5_and_twice_is_a_no_op(
    settings: Settings, vhost: str, queue_type: str
) -> None:
    settings = dataclasses.replace(settings, queue_type=queue_type)  # type: ignore[arg-type]
    registry = load_registry(CONTRACTS)
    topology.declare(settings, registry)
    first = broker_state(vhost)
    topology.declare(settings, registry)  # idempotent
    exchanges, queues, bindings = broker_state(vhost)
    assert (exchanges.keys(), queues.keys(), bindings) == (first[0].keys(), first[1].keys(), first[2])

    assert set(exchanges) == {"command", "event", "delay", "retry", "dead_letter"}
    for e in exchanges.values():
        assert (e["type"], e["durable"], e["auto_delete"]) == ("topic", True, False), e["name"]

    assert set(queues) == {
        "order-service:inbox",
        "order-service:dead_letter",
        "delay:10s",
        "delay:30s",
        "delay:10s:at-least-once",
        "delay:30s:at-least-once",
    }
    for q in queues.values():
        assert q["durable"] and not q["auto_delete"] and not q["exclusive"], q["name"]
    inbox = queues["order-service:inbox"]["arguments"]
    assert inbox == {
        "x-queue-type": queue_type,
        "x-dead-letter-exchange": "dead_letter",
        "x-dead-letter-routing-key": "order-service.dead_letter",
    }
    assert queues["order-service:inbox"]["type"] == queue_type
    assert queues["order-service:dead_letter"]["arguments"] == {"x-queue-type": queue_type}
    for seconds in (10, 30):
        # Mosaic's shared queue, exactly as Mosaic declares it ...
        assert queues[f"delay:{seconds}s"]["arguments"] == MOSAIC_DELAY_ARGUMENTS[seconds]
        # ... and txbox's own, where its delayed retries wait: dead-lettered at least once.
        assert queues[f"delay:{seconds}s:at-least-once"]["arguments"] == {
            "x-queue-type": "quorum",
            "x-message-ttl": seconds * 1000,
            "x-dead-letter-exchange": "retry",
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        }
        assert queues[f"delay:{seconds}s"]["type"] == queues[f"delay:{seconds}s:at-least-once"]["type"] == "quorum"
    assert bindings == expected_bindings("order-service", queue_type)


def test_two_services_share_exchanges_and_delay_queues(settings: Settings, vhost: str) -> None:
    registry = load_registry(CONTRACTS)
    topology.declare(settings, registry)
    topology.declare(dataclasses.replace(settings, service="inventory-service", queue_type="classic"), registry)
    _, queues, bindings = broker_state(vhost)
    assert bindings == expected_bindings("order-service", "quorum") | expected_bindings("inventory-service", "classic")
    assert {q for q in queues if q.startswith("inventory-service")} == {
        "inventory-service:inbox",
        "inventory-service:dead_letter",
    }


def test_declared_topology_routes_as_designed(settings: Settings) -> None:
    """Passive declares plus real routing: a command, a subscribed event, a delayed retry."""
    registry = load_registry(CONTRACTS)
    topology.declare(settings, registry)
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        for exchange in names.EXCHANGES:
            ch.exchange_declare(exchange, passive=True)
        ch.basic_publish("command", "order-service.order.place", b"{}", mandatory=True)
        ch.basic_publish("event", "inventory-service.stock.reserved", b"{}", mandatory=True)
        ch.basic_publish("retry", "order-service:inbox.order-service.order.place", b"{}", mandatory=True)
        ch.basic_publish("dead_letter", "order-service.dead_letter", b"{}", mandatory=True)
        # A delayed retry as the receiver publishes it: into txbox's own delay queue only.
        retry = pika.BasicProperties(headers={"CC": ["order-service:inbox.order-service.order.place"]})
        ch.basic_publish("delay", names.delay_routing_key(10), b"{}", retry, mandatory=True)
        assert ch.queue_declare("order-service:inbox", passive=True).method.message_count == 3
        assert ch.queue_declare("order-service:dead_letter", passive=True).method.message_count == 1
        assert ch.queue_declare("delay:10s:at-least-once", passive=True).method.message_count == 1
        assert ch.queue_declare("delay:10s", passive=True).method.message_count == 0
    finally:
        conn.close()


@pytest.mark.parametrize("mosaic_first", [True, False])
def test_a_mosaic_service_and_txbox_start_in_either_order(settings: Settings, vhost: str, mosaic_first: bool) -> None:
    """Either side second: no 406 PRECONDITION_FAILED, and the shared queues keep Mosaic's arguments."""
    if mosaic_first:
        declare_as_mosaic(settings.amqp_url, sends_commands_to="order-service")
    topology.declare(settings, load_registry(CONTRACTS))
    declare_as_mosaic(settings.amqp_url, sends_commands_to="order-service")  # a Mosaic (re)start after txbox
    done = run_cli(settings)  # and `txbox topology` again, over everything
    assert done.returncode == 0, done.stderr
    _, queues, bindings = broker_state(vhost)
    for seconds in (10, 30):
        assert queues[f"delay:{seconds}s"]["arguments"] == MOSAIC_DELAY_ARGUMENTS[seconds]
    assert expected_bindings("order-service", "quorum") <= bindings


def run_cli(settings: Settings, *args: str, queue_type: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.update(
        TXBOX_SERVICE=settings.service,
        TXBOX_DATABASE_URL=settings.database_url,
        TXBOX_AMQP_URL=settings.amqp_url,
        TXBOX_CONTRACTS_DIR=str(settings.contracts_dir),
        TXBOX_QUEUE_TYPE=queue_type or settings.queue_type,
    )
    return subprocess.run(
        [TXBOX, "topology", *args], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )


def test_cli_declares_and_reports(settings: Settings, vhost: str) -> None:
    done = run_cli(settings)
    assert done.returncode == 0, done.stderr
    assert "order-service:inbox" in done.stdout
    assert broker_state(vhost)[2] == expected_bindings("order-service", "quorum")
    assert run_cli(settings).returncode == 0  # again: no-op


def test_cli_needs_no_database_url(settings: Settings, vhost: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TXBOX_DATABASE_URL"}
    env.update(TXBOX_SERVICE=settings.service, TXBOX_AMQP_URL=settings.amqp_url, TXBOX_CONTRACTS_DIR=str(CONTRACTS))
    done = subprocess.run(
        [TXBOX, "topology"], check=False, env=env, cwd=ROOT, capture_output=True, text=True, timeout=60
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "DATABASE" not in done.stdout + done.stderr
    assert broker_state(vhost)[2] == expected_bindings("order-service", "quorum")


def test_existing_queue_with_other_type_fails_naming_queue_argument_and_fix(settings: Settings, vhost: str) -> None:
    assert run_cli(settings, queue_type="classic").returncode == 0
    done = run_cli(settings, queue_type="quorum")
    assert done.returncode == 2
    err = done.stderr
    assert "Traceback" not in err
    assert "'order-service:inbox'" in err and "x-queue-type" in err
    assert "rabbitmqctl delete_queue" in err and "TXBOX_QUEUE_TYPE=classic" in err
    # The broker still has the original queue, untouched.
    info = support.queue_info(vhost, "order-service:inbox")
    assert info["arguments"]["x-queue-type"] == "classic"


def test_existing_queue_with_other_dead_letter_argument_fails_clearly(settings: Settings) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    conn.channel().queue_declare(
        "order-service:inbox",
        durable=True,
        arguments={"x-queue-type": "quorum", "x-dead-letter-exchange": "elsewhere"},
    )
    conn.close()
    with pytest.raises(TopologyMismatch) as info:
        topology.declare(settings, load_registry(CONTRACTS))
    text = str(info.value)
    assert "'order-service:inbox'" in text and "x-dead-letter-exchange" in text and "delete" in text


def test_a_classic_delay_queue_of_an_older_release_fails_with_the_fix(settings: Settings) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    conn.channel().queue_declare(
        "delay:10s", durable=True, arguments={"x-message-ttl": 10_000, "x-dead-letter-exchange": "retry"}
    )
    conn.close()
    with pytest.raises(TopologyMismatch) as info:
        topology.declare(settings, load_registry(CONTRACTS))
    text = str(info.value)
    assert "'delay:10s'" in text and "rabbitmqctl delete_queue 'delay:10s'" in text
    assert "TXBOX_QUEUE_TYPE" not in text  # the inbox setting does not choose this queue's type


def test_unreachable_broker_is_a_clear_error(settings: Settings) -> None:
    bad = dataclasses.replace(settings, amqp_url="amqp://guest:guest@127.0.0.1:1/" + urllib.parse.quote("x", safe=""))
    done = run_cli(bad)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "RabbitMQ" in done.stderr


def test_a_delay_queue_of_the_previous_release_fails_with_the_fix(settings: Settings) -> None:
    """The first release declared `delay:10s` with at-least-once arguments Mosaic does not give it."""
    conn = pika.BlockingConnection(pika.URLParameters(settings.amqp_url))
    conn.channel().queue_declare(
        "delay:10s",
        durable=True,
        arguments={
            **MOSAIC_DELAY_ARGUMENTS[10],
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        },
    )
    conn.close()
    with pytest.raises(TopologyMismatch) as info:
        topology.declare(settings, load_registry(CONTRACTS))
    text = str(info.value)
    assert "'delay:10s'" in text and "rabbitmqctl delete_queue 'delay:10s'" in text
    assert "shared with Mosaic services" in text and "'delay:10s:at-least-once'" in text
