"""`txbox bench relay`: pre-filled outbox rows → all confirmed in RabbitMQ by the relay.

Works in a scratch database and a scratch vhost that it creates and drops, so it never
touches a service's data. The raw limit is measured in the same run, to the same
exchange, routing key and queue, with the same message size: plain pika, streamed
confirms, no database — the most any relay can do on this machine right now.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import time
import urllib.parse
import urllib.request
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pika
import pika.channel
import pika.frame
import psycopg
from psycopg import sql

from framework import ids, metrics, migrate, names, topology
from framework.contracts import load_registry
from framework.db import conninfo
from framework.envelope import format_timestamp
from framework.errors import TxboxError
from framework.outbox import Outbox
from framework.relay import Relay, RelayConfig
from framework.relay.messages import envelope_body
from framework.service import Service
from framework.settings import Settings
from framework.sql.outbox import Claimed
from txbox_tools import repository
from txbox_tools.bench import history, instances
from txbox_tools.bench.cpu import Saturation
from txbox_tools.bench.result import Result


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--messages", type=int, default=50_000, help="outbox rows to relay (default 50000)")
    parser.add_argument("--admin-url", default="postgresql://postgres@127.0.0.1:5432/postgres", help="PostgreSQL")
    parser.add_argument("--amqp-host", default="127.0.0.1:5672", help="RabbitMQ host:port (guest/guest)")
    parser.add_argument("--management-url", default="http://guest:guest@127.0.0.1:15672/api", help="RabbitMQ API")
    parser.add_argument("--contracts-dir", type=Path, help="(default: the repository's contracts/)")
    parser.add_argument("--batch-size", type=int, default=2000)
    parser.add_argument("--max-in-flight", type=int, default=4000)
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")
    parser.add_argument("--instances", type=int, default=1, help="publisher processes sharing the outbox (default 1)")
    history.add_option(parser)


def relay_instance(settings: Settings, batch_size: int, max_in_flight: int) -> tuple[Relay, Any]:
    """One bench publisher (built in its own process by :func:`instances.timed`)."""
    config = RelayConfig(batch_size=batch_size, max_in_flight=max_in_flight)
    relay = Relay(Service(settings=settings), config, declare_topology=False)
    return relay, metrics.PUBLISHER_PUBLISHED.labels(message_type="PlaceOrder", **metrics.labels(settings.service))


def run(args: argparse.Namespace) -> Result:
    token = uuid.uuid4().hex[:8]
    dbname, vhost = f"txbox_bench_relay_{token}", f"txbox-bench-relay-{token}"
    api = _Management(args.management_url)
    admin = psycopg.connect(conninfo(args.admin_url), autocommit=True)
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(dbname)))
    api.call("PUT", f"/vhosts/{_q(vhost)}", {})
    api.call("PUT", f"/permissions/{_q(vhost)}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
    try:
        database_url = _with_db(args.admin_url, dbname)
        settings = Settings(
            service="order-service",
            database_url=database_url,
            amqp_url=f"amqp://guest:guest@{args.amqp_host}/{_q(vhost)}",
            contracts_dir=args.contracts_dir or repository.contracts(),
            queue_type=args.queue_type,
        )
        registry = load_registry(settings.contracts_dir)
        migrate.upgrade(database_url)
        topology.declare(settings, registry)
        spec = registry.get("PlaceOrder")
        body_size = _fill(database_url, registry, args.messages)
        queue = names.inbox_queue(settings.service)

        raw_cpu = Saturation(None)
        raw_rate = _raw_streamed_confirms(
            settings.amqp_url, names.exchange_for(spec.kind), spec.routing_key, body_size, args.messages, raw_cpu
        )
        _purge(settings.amqp_url, queue)

        used = Saturation(database_url)
        seconds = instances.timed(
            relay_instance,
            (settings, args.batch_size, args.max_in_flight),
            instances=args.instances,
            target=args.messages,
            cpu=used,
        )
        in_queue = _queue_depth(settings.amqp_url, queue)
        extra: dict[str, Any] = {}
        if args.history:
            # The same run again over N finished rows (txbox_tools.bench.history).
            _purge(settings.amqp_url, queue)
            filled = history.prefill(
                database_url, names.OUTBOX, args.history, history.sample(database_url, names.OUTBOX)
            )
            _fill(database_url, registry, args.messages)
            _analyze(database_url)
            history_seconds = instances.timed(
                relay_instance,
                (settings, args.batch_size, args.max_in_flight),
                instances=args.instances,
                target=args.messages,
            )
            extra["history"] = history.summary(
                args.history, args.messages / seconds, args.messages / history_seconds, [filled]
            )
        return Result(
            stage="relay",
            messages=args.messages,
            seconds=seconds,
            raw_limit_rate=raw_rate,
            raw_limit="pika SelectConnection, persistent publish, streamed confirms, no database",
            extra={
                "message_bytes": body_size,
                "queue_type": args.queue_type,
                "instances": args.instances,
                "in_queue": in_queue,
                "scratch": {"database": dbname, "vhost": vhost},
                **used.per_message(args.messages),
                **raw_cpu.per_message(args.messages, prefix="raw_"),
                **extra,
            },
        )
    finally:
        api.call("DELETE", f"/vhosts/{_q(vhost)}")
        admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(dbname)))
        admin.close()


def _fill(database_url: str, registry: Any, n: int) -> int:
    """COPY ``n`` PlaceOrder rows, each its own segment (like n independent orders)."""
    spec = registry.get("PlaceOrder")
    template = Outbox(None, registry).build(  # type: ignore[arg-type]
        spec,
        aggregate_id="0",
        payload={"customer": "bench-customer", "sku": "SKU-1", "quantity": 1},
        message_context={"correlation_id": str(uuid.uuid4())},
    )
    cols = [
        "id",
        "message_type",
        "aggregate_type",
        "aggregate_id",
        "kind",
        "routing_key",
        "payload",
        "message_context",
        "segment",
    ]
    payload = json.dumps(template.payload)
    context = json.dumps(template.message_context)
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        stmt = sql.SQL("COPY txbox.outbox ({}) FROM STDIN").format(sql.SQL(", ").join(map(sql.Identifier, cols)))
        with cur.copy(stmt) as copy:
            for i in range(n):
                aggregate = f"bench-{i}"
                copy.write_row(
                    (
                        ids.message_id(),  # UUIDv7, as the Outbox gives them
                        spec.message_type,
                        spec.aggregate_type,
                        aggregate,
                        spec.kind,
                        spec.routing_key,
                        payload,
                        context,
                        f"{spec.aggregate_type}:{aggregate}",
                    )
                )
    # The size of one envelope as the relay sends it.
    sample = Claimed(
        str(uuid.uuid4()), spec.message_type, spec.aggregate_type, f"bench-{n}", "1.0", spec.kind,
        spec.routing_key, payload, context, None, None, 0, format_timestamp(datetime.now(UTC)), 0, 1, 0,
    )  # fmt: skip
    return len(envelope_body(sample))


def _analyze(database_url: str) -> None:
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute("ANALYZE txbox.outbox")


def _raw_streamed_confirms(
    amqp_url: str, exchange: str, routing_key: str, size: int, n: int, cpu: Saturation | None = None
) -> float:
    """Plain pika: publish ``n`` persistent messages, up to 8,000 unconfirmed, count acks;
    ``cpu`` measures it."""
    body = b"x" * size
    props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    state = {"sent": 0, "acked": 0, "start": 0.0, "end": 0.0}
    window = 8000
    holder: dict[str, Any] = {}

    def pump(channel: pika.channel.Channel) -> None:
        while state["sent"] < n and state["sent"] - state["acked"] < window:
            channel.basic_publish(exchange, routing_key, body, props)
            state["sent"] += 1

    def on_ack(frame: pika.frame.Method) -> None:
        tag = frame.method.delivery_tag
        state["acked"] = tag if frame.method.multiple else max(state["acked"], tag)
        if state["acked"] >= n:
            state["end"] = time.perf_counter()
            if cpu is not None:
                cpu.stop()
            holder["channel"].connection.close()
        else:
            pump(holder["channel"])

    def on_confirm_mode(_: pika.frame.Method) -> None:
        if cpu is not None:
            cpu.start([os.getpid()])
        state["start"] = time.perf_counter()
        pump(holder["channel"])

    def on_channel(ch: pika.channel.Channel) -> None:
        holder["channel"] = ch
        ch.confirm_delivery(ack_nack_callback=on_ack, callback=on_confirm_mode)

    conn = pika.SelectConnection(
        pika.URLParameters(amqp_url),
        on_open_callback=lambda c: c.channel(on_open_callback=on_channel),
        on_close_callback=lambda c, r: c.ioloop.stop(),
    )
    conn.ioloop.start()
    if not state["end"]:
        raise TxboxError("raw publish did not complete (connection closed early)")
    return n / (state["end"] - state["start"])


def _purge(amqp_url: str, queue: str) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        conn.channel().queue_purge(queue)
    finally:
        conn.close()


def _queue_depth(amqp_url: str, queue: str) -> int:
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(conn.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        conn.close()


def _with_db(admin_url: str, dbname: str) -> str:
    parts = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit(("postgresql+psycopg", parts.netloc, f"/{dbname}", parts.query, ""))


def _q(vhost: str) -> str:
    return urllib.parse.quote(vhost, safe="")


class _Management:
    """The few RabbitMQ management API calls the bench needs (scratch vhost)."""

    def __init__(self, url: str) -> None:
        parts = urllib.parse.urlsplit(url)
        host = f"{parts.hostname}:{parts.port}" if parts.port else str(parts.hostname)
        self.base: str = urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))
        user, password = parts.username or "guest", parts.password or "guest"
        self.auth = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    def call(self, method: str, path: str, body: Any = None) -> None:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.base + path, data=data, method=method)
        req.add_header("Authorization", self.auth)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30):
            pass
