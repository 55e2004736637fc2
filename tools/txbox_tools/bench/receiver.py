"""`txbox bench receiver`: queued deliveries → inbox rows committed and acked.

Scratch database and vhost of its own, created and dropped. The same run measures the
raw limit: plain pika consuming the same queue with prefetch 500 and one
``basic_ack(multiple=True)`` every 100 deliveries, no database — the most any receiver
can take out of this broker on this machine right now.

``--floor`` adds, in the same run, the raw consume with the receiver's admission of
each delivery and no database (``floor_rate``, ``floor_ratio``): what any receiver that
judges deliveries in Python on its consuming thread can reach at most.
"""

from __future__ import annotations

import argparse
import base64
import functools
import json
import os
import tempfile
import threading
import time
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pika
import psycopg
from psycopg import pq, sql

from framework import amqp, ids, metrics, migrate, names, topology
from framework.db import conninfo
from framework.envelope import Message
from framework.errors import TxboxError
from framework.receiver import Delivery, Intake, Receiver, ReceiverConfig
from framework.service import Service
from framework.settings import Settings
from framework.sql.inbox import InboxRow, batch_json
from txbox_tools import repository
from txbox_tools.bench import instances
from txbox_tools.bench.cpu import Saturation
from txbox_tools.bench.result import Result

SERVICE = "order-service"


def add_scratch_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-url", default=os.environ.get("TXBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--amqp-host", default="127.0.0.1:5672", help="RabbitMQ host:port (guest/guest)")
    parser.add_argument("--management-url", default="http://127.0.0.1:15672/api", help="RabbitMQ management API")
    parser.add_argument("--contracts-dir", type=Path, help="(default: the repository's contracts/)")
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")


class Scratch:
    """A database (migrated) and a vhost of the bench's own; dropped on exit."""

    def __init__(self, args: argparse.Namespace, label: str) -> None:
        token = uuid.uuid4().hex[:8]
        self.dbname = f"txbox_bench_{label}_{token}"
        self.vhost = f"txbox-bench-{label}-{token}"
        self.admin_url = args.admin_url
        self.api = args.management_url.rstrip("/")
        parts = urllib.parse.urlsplit(args.admin_url)
        self.database_url = urllib.parse.urlunsplit(("postgresql+psycopg", parts.netloc, f"/{self.dbname}", "", ""))
        self.amqp_url = f"amqp://guest:guest@{args.amqp_host}/{urllib.parse.quote(self.vhost, safe='')}"
        self.settings = Settings(
            service=SERVICE,
            database_url=self.database_url,
            amqp_url=self.amqp_url,
            contracts_dir=args.contracts_dir or repository.contracts(),
            queue_type=args.queue_type,
        )

    def _api(self, method: str, path: str, body: Any = None) -> None:
        request = urllib.request.Request(
            f"{self.api}{path}", data=json.dumps(body).encode() if body is not None else None, method=method
        )
        request.add_header("Authorization", "Basic " + base64.b64encode(b"guest:guest").decode())
        request.add_header("Content-Type", "application/json")
        try:
            with urllib.request.urlopen(request, timeout=30):
                pass
        except OSError as exc:
            raise TxboxError(f"RabbitMQ management API at {self.api} failed ({exc}); is the plugin enabled?") from exc

    def __enter__(self) -> Scratch:
        with psycopg.connect(conninfo(self.admin_url), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
        vhost = urllib.parse.quote(self.vhost, safe="")
        self._api("PUT", f"/vhosts/{vhost}", {})
        self._api("PUT", f"/permissions/{vhost}/guest", {"configure": ".*", "write": ".*", "read": ".*"})
        migrate.upgrade(self.database_url)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._api("DELETE", f"/vhosts/{urllib.parse.quote(self.vhost, safe='')}")
        finally:
            with psycopg.connect(conninfo(self.admin_url), autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))

    def execute(self, statement: Any, params: Any = None) -> list[tuple[Any, ...]]:
        with psycopg.connect(conninfo(self.database_url), autocommit=True) as conn:
            cur = conn.execute(statement, params)
            return cur.fetchall() if cur.description is not None else []


def envelopes(n: int) -> list[bytes]:
    """PlaceOrder envelopes of the usual size, each its own aggregate (own segment), with the
    ids a txbox sender gives them (UUIDv7: docs/explanation/how-it-works.md, "The tables")."""
    out = []
    for i in range(n):
        message = Message(
            message_id=ids.message_id(),
            message_type="PlaceOrder",
            aggregate_type="order",
            aggregate_id=str(i),
            payload={"customer": f"customer-{i % 977}", "sku": f"SKU-{i % 113}", "quantity": 1 + i % 9},
            message_context={"example_correlation_id": str(uuid.uuid4())},
            auth_token="eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiJiZW5jaCJ9.c2lnbmF0dXJl",
        )
        out.append(message.to_json())
    return out


def fill_queue(amqp_url: str, bodies: list[bytes], routing_key: str) -> None:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        for body in bodies:
            props = pika.BasicProperties(
                content_type="application/json", delivery_mode=2, message_id=json.loads(body)["message_id"]
            )
            channel.basic_publish(names.COMMAND_EXCHANGE, routing_key, body, props)
        queue = names.inbox_queue(SERVICE)
        deadline = time.monotonic() + 120
        while channel.queue_declare(queue, passive=True).method.message_count < len(bodies):
            if time.monotonic() > deadline:
                raise TxboxError("the broker did not take every published message within 120 s")
            connection.sleep(0.05)
    finally:
        connection.close()


class PacedPublisher:
    """Offers ``bodies`` to the inbox queue at ``rate`` per second from a thread of the bench
    (``--rate``): the receiver then settles a moderate load, not a backlog."""

    def __init__(self, amqp_url: str, bodies: list[bytes], routing_key: str, rate: float) -> None:
        self._url, self._bodies, self._key, self._rate = amqp_url, bodies, routing_key, rate
        self._thread = threading.Thread(target=self._run, name="bench paced publisher", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join(60)
        if self.error is not None:
            raise TxboxError(f"the paced publisher failed: {self.error!r}")

    def _run(self) -> None:
        try:
            connection = pika.BlockingConnection(pika.URLParameters(self._url))
            try:
                channel = connection.channel()
                started = time.monotonic()
                for n, body in enumerate(self._bodies):
                    pause = started + n / self._rate - time.monotonic()
                    if pause > 0:
                        connection.sleep(pause)
                    props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
                    channel.basic_publish(names.COMMAND_EXCHANGE, self._key, body, props)
            finally:
                connection.close()
        except BaseException as exc:
            self.error = exc


def transactions(admin_url: str, dbname: str) -> int:
    """Transactions committed in ``dbname`` so far (``pg_stat_database``): the backend's count,
    whatever the client sent. Read once the daemons exited, so their last ones are flushed."""
    with psycopg.connect(conninfo(admin_url), autocommit=True) as conn:
        row = conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", (dbname,)).fetchone()
    return int(row[0]) if row else 0


def raw_consume(
    amqp_url: str,
    queue: str,
    n: int,
    prefetch: int = 500,
    ack_every: int = 100,
    cpu: Saturation | None = None,
    each: Callable[[Any, Any, bytes], None] | None = None,
    before_ack: Callable[[], None] | None = None,
) -> float:
    """Plain pika consume + multiple acks, no database: messages/s; ``cpu`` measures it.
    ``each`` (method, properties, body) runs for every delivery, ``before_ack`` before each ack."""
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.basic_qos(prefetch_count=prefetch)
        got = 0
        if cpu is not None:
            cpu.start([os.getpid()])
        started = time.perf_counter()

        def on_message(ch: Any, method: Any, props: Any, body: bytes) -> None:
            nonlocal got
            got += 1
            if each is not None:
                each(method, props, body)
            if got % ack_every == 0 or got == n:
                if before_ack is not None:
                    before_ack()
                ch.basic_ack(method.delivery_tag, multiple=True)

        channel.basic_consume(queue, on_message)
        while got < n:
            connection.process_data_events(time_limit=1)
        seconds = time.perf_counter() - started
        if cpu is not None:
            cpu.stop()
        return n / seconds
    finally:
        connection.close()


def admission_floor(amqp_url: str, queue: str, service: Service, n: int, cpu: Saturation | None = None) -> float:
    """:func:`raw_consume` that also admits every delivery as the receiver does (parsed,
    judged, made a row; framework/receiver/daemon.py builds its intake the same way) and
    renders each hundred rows as the INSERT's parameter, with no database: messages/s; the
    most a receiver that admits in Python can take here (docs/explanation/daemons.md, "CPU per message")."""
    config = ReceiverConfig()
    intake = Intake(service.registry, service.name, max_body_bytes=config.max_body_bytes, selectors=service.selectors)
    trusted = config.trusted(amqp.username(amqp_url))
    rows: list[InboxRow] = []
    admitted = 0

    def admit(method: Any, props: Any, body: bytes) -> None:
        nonlocal admitted
        row = intake.admit(Delivery.from_pika(method, props, body, trusted))
        if not isinstance(row, InboxRow):
            raise TxboxError(f"the bench's own delivery was not admitted: {row}")
        rows.append(row)
        admitted += 1

    def render() -> None:
        batch_json(rows)
        rows.clear()

    rate = raw_consume(amqp_url, queue, n, cpu=cpu, each=admit, before_ack=render)
    if admitted != n:
        raise TxboxError(f"the floor admitted {admitted} of {n} deliveries")
    return rate


def configure(parser: argparse.ArgumentParser) -> None:
    add_scratch_options(parser)
    parser.add_argument("--messages", type=int, default=50_000, help="queued deliveries (default 50000)")
    parser.add_argument("--prefetch", type=int, default=1000)
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--instances",
        type=int,
        default=1,
        help="receiver processes consuming the queue (default 1; more run with TXBOX_RECEIVER_STANDBY=false, "
        "as competing consumers that do not keep per-segment order; see docs/how-to/daemons.md, 'Scaling')",
    )
    parser.add_argument(
        "--rate",
        type=float,
        help="offer the messages at this rate (msg/s) while the receiver runs, instead of a backlog; "
        "with --seconds, --messages is rate x seconds; the report's transactions_per_message says how many "
        "batches a message took",
    )
    parser.add_argument("--seconds", type=float, default=20.0, help="with --rate: how long to offer (default 20)")
    parser.add_argument(
        "--count-statements",
        action="store_true",
        help="trace the receiver's database connections (libpq's trace) and report its statements and round "
        "trips per message; the trace costs CPU, so the run's CPU figures are not comparable",
    )
    parser.add_argument(
        "--floor",
        action="store_true",
        help="also measure the raw consume plus the receiver's admission of each delivery, no database "
        "(floor_rate, floor_ratio: the most a receiver admitting in Python reaches here)",
    )


def receiver_instance(
    settings: Settings, prefetch: int, batch_size: int, standby: bool, trace_dir: str | None = None
) -> tuple[Receiver, Any]:
    """One bench receiver (built in its own process by :func:`instances.timed`); with
    ``trace_dir``, every database connection it opens writes libpq's trace of the protocol
    there (:func:`statements`)."""
    config = ReceiverConfig(prefetch=prefetch, batch_size=batch_size, standby=standby)
    receiver = Receiver(Service(settings=settings), config)
    if trace_dir is not None:
        # The bench reaches into the receiver's slots: what it counts is each message the
        # receiver's own connections send, whatever the code that sends them.
        receiver._home.slot._on_connect = functools.partial(_trace, Path(trace_dir), "db")
        if receiver._turn is not None:
            receiver._turn._slot._on_connect = functools.partial(_trace, Path(trace_dir), "turn")
    return receiver, metrics.RECEIVER_STORED.labels(**metrics.labels(settings.service))


def _trace(directory: Path, kind: str, conn: psycopg.Connection[Any]) -> None:
    trace = open(directory / f"{kind}-{os.getpid()}-{conn.info.backend_pid}.trace", "w")  # noqa: SIM115
    conn.pgconn.trace(trace.fileno())
    conn.pgconn.set_trace_flags(pq.Trace.SUPPRESS_TIMESTAMPS)
    _TRACES.append(trace)  # open as long as the process: libpq writes to its descriptor


_TRACES: list[Any] = []


def statements(trace_dir: Path) -> dict[str, dict[str, int]]:
    """By connection kind (``db``, ``turn``): the statements the client sent (simple
    ``Query`` and extended ``Execute`` messages) and its round trips (each ``ReadyForQuery``
    the server sent ends one), from libpq's traces."""
    counts: dict[str, dict[str, int]] = {}
    for path in sorted(trace_dir.glob("*.trace")):
        kind = path.name.split("-", 1)[0]
        into = counts.setdefault(kind, {"statements": 0, "round_trips": 0})
        with path.open(errors="replace") as lines:
            for line in lines:
                fields = line.split("\t", 3)
                if len(fields) < 3:
                    continue
                if fields[0] == "F" and fields[2] in ("Query", "Execute"):
                    into["statements"] += 1
                elif fields[0] == "B" and fields[2] == "ReadyForQuery":
                    into["round_trips"] += 1
    return counts


def run(args: argparse.Namespace) -> Result:
    with Scratch(args, "receiver") as scratch:
        service = Service(settings=scratch.settings)
        topology.declare(scratch.settings, service.registry)
        spec = service.registry.get("PlaceOrder")
        queue = names.inbox_queue(SERVICE)
        if args.rate:
            args.messages = max(1, round(args.rate * args.seconds))
        bodies = envelopes(args.messages)

        fill_queue(scratch.amqp_url, bodies, spec.routing_key)
        raw_cpu = Saturation(None)
        raw_rate = raw_consume(scratch.amqp_url, queue, args.messages, cpu=raw_cpu)

        floor: dict[str, Any] = {}
        if args.floor:
            fill_queue(scratch.amqp_url, bodies, spec.routing_key)
            floor_cpu = Saturation(None)
            floor_rate = admission_floor(scratch.amqp_url, queue, service, args.messages, cpu=floor_cpu)
            floor = {
                "floor_rate": round(floor_rate, 1),
                "floor_ratio": round(floor_rate / raw_rate, 3),
                "floor": "the raw consume + Intake.admit of each delivery + the INSERT's JSON per 100, no database",
                **floor_cpu.per_message(args.messages, prefix="floor_"),
            }

        tracing = tempfile.TemporaryDirectory(prefix="txbox-bench-trace-") if args.count_statements else None
        trace_dir = tracing.name if tracing is not None else None
        paced = PacedPublisher(scratch.amqp_url, bodies, spec.routing_key, args.rate) if args.rate else None
        if paced is None:
            fill_queue(scratch.amqp_url, bodies, spec.routing_key)
        used = Saturation(scratch.database_url)
        committed = transactions(scratch.admin_url, scratch.dbname)
        seconds = instances.timed(
            receiver_instance,
            (scratch.settings, args.prefetch, args.batch_size, args.instances == 1, trace_dir),
            instances=args.instances,
            target=args.messages,
            cpu=used,
            on_start=paced.start if paced is not None else None,
        )
        if paced is not None:
            paced.join()
        # The receivers exited (timed joins them), so their backends' counts are in.
        committed = transactions(scratch.admin_url, scratch.dbname) - committed
        traced: dict[str, Any] = {}
        if tracing is not None:
            with tracing:
                for kind, counted in statements(Path(tracing.name)).items():
                    for name, value in counted.items():
                        traced[f"{kind}_{name}_per_message"] = round(value / args.messages, 4)

        rows = scratch.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier("txbox", names.INBOX)))[0][0]
        left = _depth(scratch.amqp_url, queue)
        if rows != args.messages or left != 0:
            raise TxboxError(f"bench check failed: {rows} inbox rows, {left} deliveries left in the queue")
        return Result(
            stage="receiver",
            messages=args.messages,
            seconds=seconds,
            raw_limit_rate=raw_rate,
            raw_limit="plain pika consume, prefetch 500, basic_ack(multiple=True) every 100, no database",
            extra={
                "prefetch": args.prefetch,
                "batch_size": args.batch_size,
                "instances": args.instances,
                "queue_type": args.queue_type,
                "body_bytes": len(bodies[0]),
                "offered_rate": args.rate,
                # Every transaction of the scratch database meanwhile: the receivers' batches,
                # their redelivery counts, the turn's checks (one a second) and the meter's look-ups.
                "transactions_per_message": round(committed / args.messages, 4),
                **traced,
                **used.per_message(args.messages),
                **raw_cpu.per_message(args.messages, prefix="raw_"),
                **floor,
            },
        )


def _depth(amqp_url: str, queue: str) -> int:
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        return int(connection.channel().queue_declare(queue, passive=True).method.message_count)
    finally:
        connection.close()
