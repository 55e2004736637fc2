"""`txbox bench e2e`: sustained messages/s through every daemon, each its own process.

One scratch service ``bench-e2e`` (scratch database, scratch vhost, contracts written to
a temporary folder) whose daemons run as ``txbox publisher`` / ``receiver`` / ``worker``
processes on this machine. The driver writes ``Ping`` commands into the service's outbox
in business transactions (at most ``--window`` unhandled at once); the Ping handler
writes a business row and publishes a ``Pong`` event the service subscribes to itself,
whose handler writes another row. So every Ping crosses the whole pipeline twice:

    outbox → publisher → broker → receiver → inbox → worker (→ outbox → … → worker)

``messages`` counts handled messages (two per Ping), over the time from the first
write to the last handler commit.

Raw limit, measured in the same run on the same queue with the same message size and
before the daemons start: the slower of plain pika publishing with streamed confirms
and plain pika consuming (prefetch 1,000, ``multiple=True`` acks), no database — the
most any broker-based pipeline can move on this machine right now.

CPU, beside the rate: ``cpu_us_per_message`` is what each daemon (with its children),
the PostgreSQL processes serving them (not the driver's) and the RabbitMQ node spent per
handled message while the pipeline was driven, and their ``total`` (the meter of
``txbox bench latency``, tools/txbox_tools/bench/cpu.py). The broker and the server's
helper processes are measured whole, so these figures hold on a quiet machine only.

``--tracing`` runs ``--pairs`` pairs of an untraced and a traced run, interleaved in
A B B A order: on this kind of machine one run's rate moves by a tenth from the run
before, so a single pair decides nothing, and a traced run that always came second
would alone pay for whatever a run leaves to the next. ``tracing_ratio`` is the median of the
pairs' ratios (``tracing_ratios`` each one), ``untraced_rate`` the untraced runs' median
rate, and the result itself the traced run of median rate. ``untraced_cpu_us_per_message``
is the untraced runs' median by part, and ``tracing_cpu_us_per_message`` what each part
spent more traced (medians): where tracing's cost goes. ``--signing`` does the same for
event signing (an RSA-2048 key; the Pongs are signed by the publisher and verified by the
receiver): ``signing_ratio``, ``unsigned_rate``, ``signing_cpu_us_per_message``.

The scratch app is this module's ``app`` attribute (``--app txbox_tools.bench.e2e:app``),
built on first access from the ``TXBOX_*`` environment the bench gives its daemons.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any, NamedTuple

import pika
import psycopg
from psycopg import sql
from sqlalchemy import DateTime, Text, func, insert
from sqlalchemy.engine import make_url
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from framework import CommandHandler, EventHandler, Message, Outbox, Service, migrate, names, topology
from framework.db import conninfo, create_engine
from framework.errors import TxboxError
from framework.settings import Settings
from framework.sql import outbox as outbox_sql
from txbox_tools.bench import cpu, history
from txbox_tools.bench.result import Result
from txbox_tools.processes import ProcessGroup, raise_if_terminated

SERVICE = "bench-e2e"
CONTRACT = """\
asyncapi: 2.0.0
x-service-id: bench-e2e
info:
  title: Bench Service
  version: '1.0.0'
x-subscribes:
  - bench-e2e.ping.ponged
channels:
  'ping.send':
    bindings:
      amqp:
        queue:
          name: inbox
    publish:
      message:
        $ref: '#/components/messages/ping'
  'ping.ponged':
    subscribe:
      message:
        $ref: '#/components/messages/ponged'
components:
  messages:
    ping:
      tags:
        - name: aggregate-type:ping
      contentType: application/json
      payload:
        $ref: 'ping.json'
    ponged:
      tags:
        - name: aggregate-type:ping
      contentType: application/json
      payload:
        $ref: 'ping.json'
"""
SCHEMA = """\
{"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "additionalProperties": false,
 "required": ["n"], "properties": {"n": {"type": "integer"}, "echo": {"type": "boolean"},
 "pad": {"type": "string"}}}
"""


class _Base(DeclarativeBase):
    pass


class Handled(_Base):
    """The business row of both handlers. Added through the ORM by default, as the worker
    bench does: the worker flushes a batch's rows together (one multi-row INSERT), where
    a handler's own ``session.execute(INSERT ...)`` pays a round trip per message (the
    ``statement`` way of :data:`HANDLER_ENV`). ``handled_at`` is the server's
    ``clock_timestamp()`` at that INSERT, just before the batch commits (what ``txbox bench
    latency`` reads as the handler's commit time)."""

    __tablename__ = "bench_handled"

    message_id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    message_type: Mapped[str] = mapped_column(Text)
    handled_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.clock_timestamp())


# How the handlers write their business row: "orm" (the default, above) or "statement",
# one INSERT executed at once, as the raw path's consumer writes its row (``txbox bench
# latency --handler``; benchmarks/one-thread.md, "The handler's row").
HANDLER_ENV = "TXBOX_BENCH_HANDLER"
HANDLERS = ("orm", "statement")
_INSERT_HANDLED = insert(Handled)


def _added(session: Session, message: Message) -> None:
    session.add(Handled(message_id=message.message_id, message_type=message.message_type))


def _inserted(session: Session, message: Message) -> None:
    session.execute(_INSERT_HANDLED, {"message_id": message.message_id, "message_type": message.message_type})


# Read once: the daemons get the setting in their environment at start.
_record = _inserted if os.environ.get(HANDLER_ENV) == "statement" else _added


class Ping(CommandHandler):
    """One business row; with ``echo``, one more message through the whole pipeline."""

    message_type = "Ping"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        _record(session, message)
        if message.payload.get("echo"):
            outbox.publish_event("Ponged", aggregate_id=message.aggregate_id, payload={"n": message.payload["n"]})


class Ponged(EventHandler):
    message_type = "Ponged"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        _record(session, message)


def build_app() -> Service:
    service = Service.from_env(service=SERVICE)
    service.register(Ping())
    service.register(Ponged())
    return service


_APP: Service | None = None


def __getattr__(name: str) -> Any:
    """``app`` is built lazily so importing this module (for ``--help``) needs no settings."""
    global _APP
    if name == "app":
        if _APP is None:
            _APP = build_app()
        return _APP
    raise AttributeError(name)


# --- the scratch environment ------------------------------------------------------------


class Scratch:
    """A database, a vhost and a contracts folder of their own; removed afterwards."""

    def __init__(self, args: argparse.Namespace, label: str) -> None:
        from txbox_tools.bench.relay import _Management, _q, _with_db

        token = uuid.uuid4().hex[:8]
        self.dbname, self.vhost = f"txbox_bench_{label}_{token}", f"txbox-bench-{label}-{token}"
        self.admin_url = args.admin_url
        self.api = _Management(args.management_url)
        self.database_url = _with_db(args.admin_url, self.dbname)
        self.amqp_url = f"amqp://guest:guest@{args.amqp_host}/{_q(self.vhost)}"
        self._q = _q
        self.tmp = tempfile.TemporaryDirectory(prefix="txbox-bench-")
        self.contracts = Path(self.tmp.name)
        (self.contracts / "bench-e2e.yml").write_text(CONTRACT)
        (self.contracts / "ping.json").write_text(SCHEMA)
        self.queue_type = args.queue_type

    def __enter__(self) -> Scratch:
        with psycopg.connect(conninfo(self.admin_url), autocommit=True) as admin:
            admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(self.dbname)))
        self.api.call("PUT", f"/vhosts/{self._q(self.vhost)}", {})
        self.api.call(
            "PUT", f"/permissions/{self._q(self.vhost)}/guest", {"configure": ".*", "write": ".*", "read": ".*"}
        )
        migrate.upgrade(self.database_url)
        engine = create_engine(self.database_url)
        _Base.metadata.create_all(engine)
        engine.dispose()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.api.call("DELETE", f"/vhosts/{self._q(self.vhost)}")
        finally:
            with psycopg.connect(conninfo(self.admin_url), autocommit=True) as admin:
                admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(self.dbname)))
            self.tmp.cleanup()

    @property
    def env(self) -> dict[str, str]:
        return {
            "TXBOX_SERVICE": SERVICE,
            "TXBOX_DATABASE_URL": self.database_url,
            "TXBOX_AMQP_URL": self.amqp_url,
            "TXBOX_CONTRACTS_DIR": str(self.contracts),
            "TXBOX_QUEUE_TYPE": self.queue_type,
        }

    def service(self) -> Service:
        """The load generator's view of the service (its connections named
        :data:`cpu.LOAD_APPLICATION`, so no CPU meter counts them)."""
        url = make_url(self.database_url).update_query_dict({"application_name": cpu.LOAD_APPLICATION})
        service = Service(
            settings=Settings(
                service=SERVICE,
                database_url=url.render_as_string(hide_password=False),
                amqp_url=self.amqp_url,
                contracts_dir=self.contracts,
                queue_type=self.queue_type,
            )
        )
        service.register(Ping())
        service.register(Ponged())
        return service

    def start_daemons(
        self,
        group: ProcessGroup,
        workers: int = 1,
        worker_metrics_ports: list[int] | None = None,
        publisher_metrics_port: int | None = None,
        *,
        one_process: bool = False,
    ) -> None:
        """The publisher, the receiver and ``workers`` workers; ``worker_metrics_ports``: one
        ``--metrics-port`` per worker, and ``publisher_metrics_port`` the publisher's, for the
        benches that read their counters. ``one_process``: one `txbox run` instead, holding
        the three and one worker, its metrics on ``publisher_metrics_port``."""
        app = ["--app", "txbox_tools.bench.e2e:app"]
        port = ["--metrics-port", str(publisher_metrics_port)] if publisher_metrics_port else []
        if one_process:
            # Like the separate daemons: a publisher, a receiver and one worker; no collector.
            group.start("run", ["run", *app, *port, "--without", "collector"])
            return
        group.start("publisher", ["publisher", *app, *port])
        group.start("receiver", ["receiver", *app])
        for n in range(workers):
            port = ["--metrics-port", str(worker_metrics_ports[n])] if worker_metrics_ports else []
            group.start(f"worker-{n + 1}", ["worker", *app, *port])


def add_common_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--admin-url", default=os.environ.get("TXBOX_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
    )
    parser.add_argument("--amqp-host", default="127.0.0.1:5672", help="RabbitMQ host:port (guest/guest)")
    parser.add_argument("--management-url", default="http://guest:guest@127.0.0.1:15672/api", help="RabbitMQ API")
    parser.add_argument("--queue-type", choices=("quorum", "classic"), default="quorum")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--log-dir", type=Path, default=None, help="keep the daemons' logs here")


def write_pings(service: Service, first: int, count: int, *, echo: bool, pad: str = "") -> None:
    """``count`` Ping commands in one business transaction (built and validated by the Outbox)."""
    with Session(service.engine) as session, session.begin():
        outbox = service.outbox(session)
        spec = service.registry.get("Ping")
        payload: dict[str, Any] = {"echo": echo}
        if pad:
            payload["pad"] = pad
        rows = [
            outbox.build(spec, aggregate_id=f"p{i}", payload={"n": i, **payload}).params()
            for i in range(first, first + count)
        ]
        # The outbox's own INSERT: JSON columns as text, a NULL locked_until meaning "due now".
        session.connection().exec_driver_sql(outbox_sql.insert_pyformat(service.settings.schema), rows)


def handled(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM bench_handled").fetchone()
    return int(row[0]) if row else 0


def wait_ready(scratch: Scratch, group: ProcessGroup, timeout: float = 60.0) -> None:
    """Until the receiver consumes the inbox queue (daemons declared the topology)."""
    queue = names.inbox_queue(SERVICE)
    deadline = time.monotonic() + timeout
    while True:
        dead = group.dead()
        if dead:
            raise TxboxError(f"{dead[0].name} exited: {dead[0].log_tail()}")
        try:
            conn = pika.BlockingConnection(pika.URLParameters(scratch.amqp_url))
            try:
                consumers = conn.channel().queue_declare(queue, passive=True).method.consumer_count
            finally:
                if conn.is_open:
                    conn.close()
            if consumers:
                return
        except pika.exceptions.AMQPError:
            pass
        if time.monotonic() > deadline:
            raise TxboxError(f"the daemons did not come up within {timeout:.0f}s; logs: {group.log_dir}")
        raise_if_terminated()
        time.sleep(0.2)


def raw_pipe(amqp_url: str, queue: str, size: int, n: int) -> tuple[float, float]:
    """(publish, consume) msg/s of plain pika on ``queue``: streamed confirms, batched acks."""
    from txbox_tools.bench.relay import _raw_streamed_confirms

    publish = _raw_streamed_confirms(amqp_url, "", queue, size, n)  # default exchange → the queue
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = conn.channel()
        channel.basic_qos(prefetch_count=1000)
        got = 0
        started = time.perf_counter()
        for method, _, _ in channel.consume(queue, inactivity_timeout=10):
            if method is None:
                break
            got += 1
            if got % 500 == 0 or got == n:
                channel.basic_ack(method.delivery_tag, multiple=True)
            if got >= n:
                break
        seconds = time.perf_counter() - started
        channel.cancel()
    finally:
        conn.close()
    if got < n:
        raise TxboxError(f"raw consume got {got} of {n} messages")
    return publish, n / seconds


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--pings", type=int, default=15_000, help="Ping commands written; 2 messages each")
    parser.add_argument("--window", type=int, default=3_000, help="unhandled Pings at most (default 3000)")
    parser.add_argument("--batch", type=int, default=500, help="Pings per business transaction (default 500)")
    parser.add_argument("--raw-messages", type=int, default=30_000, help="messages of the raw measurement")
    parser.add_argument(
        "--tracing",
        action="store_true",
        help="run without and with spans recorded (SDK, batch processor, discarding exporter), --pairs "
        "times each, interleaved; tracing_ratio is the median of the pairs' traced over untraced rates",
    )
    parser.add_argument(
        "--signing",
        action="store_true",
        help="run without and with event signing (an RSA-2048 key; the receiver verifies the service's own "
        "events), --pairs times each, interleaved; signing_ratio: the median of the pairs' signed over unsigned rates",
    )
    parser.add_argument(
        "--pairs", type=int, default=2, help="with --tracing or --signing: pairs of runs, in A B B A order (default 2)"
    )
    history.add_option(parser)
    add_common_options(parser)


class _Measured(NamedTuple):
    seconds: float
    total: int
    raw_publish: float
    raw_consume: float
    body_size: int
    cpu: dict[str, float]  # CPU seconds of each part of the pipeline while it was driven (cpu.pipeline)
    signed: int = 0  # inbox rows that came with a signature (the Pongs of a --signing run)

    def cpu_us_per_message(self) -> dict[str, float]:
        """Each part's CPU microseconds per message, and their ``total``."""
        parts = {name: seconds * 1e6 / max(self.total, 1) for name, seconds in self.cpu.items()}
        parts["total"] = sum(parts.values())
        return {name: round(value, 1) for name, value in parts.items()}

    @property
    def rate(self) -> float:
        return self.total / self.seconds if self.seconds > 0 else 0.0


def run(args: argparse.Namespace) -> Result:
    extra: dict[str, Any] = {}
    # The untraced run's own rows, which the history repeats (txbox_tools.bench.history).
    templates: dict[str, list[dict[str, Any]]] | None = {} if args.history else None
    if args.tracing and args.signing:
        raise TxboxError("--tracing and --signing each measure one cost against plain runs: give one of them")
    if args.tracing or args.signing:
        # What the variant runs add, and the names of its figures: tracing_ratio and
        # untraced_rate, or signing_ratio and unsigned_rate.
        variant, plain_name = ("tracing", "untraced") if args.tracing else ("signing", "unsigned")
        exporter = "none"
        if args.tracing:
            from opentelemetry import trace

            from txbox_tools.bench import tracing

            # The business spans of _drive; an untraced run starts none, so this provider only
            # records in the traced ones.
            trace.set_tracer_provider(tracing.driver_provider())
            exporter = tracing.EXPORTER
        runs: dict[bool, list[_Measured]] = {False: [], True: []}
        for pair in range(args.pairs):
            for on in (False, True) if pair % 2 == 0 else (True, False):
                runs[on].append(
                    _measure(
                        args,
                        traced=on and args.tracing,
                        signed=on and args.signing,
                        exporter=exporter if on else "none",
                        templates=None if on or runs[False] else templates,
                    )
                )
        ratios = [t.rate / p.rate for p, t in zip(runs[False], runs[True], strict=True)]
        plain, measured = _median_run(runs[False]), _median_run(runs[True])
        plain_cpu, variant_cpu = _median_cpu(runs[False]), _median_cpu(runs[True])
        extra = {
            "pairs": args.pairs,
            f"{plain_name}_rate": round(statistics.median(m.rate for m in runs[False]), 1),
            f"{variant}_ratio": round(statistics.median(ratios), 3),
            f"{variant}_ratios": [round(r, 3) for r in ratios],
            f"{plain_name}_cpu_us_per_message": plain_cpu,
            # Where the variant's cost goes: what each part spends more per message with it.
            f"{variant}_cpu_us_per_message": {
                name: round(variant_cpu[name] - plain_cpu[name], 1) for name in variant_cpu
            },
            "cpu_us_per_message": variant_cpu,
        }
        if args.signing:
            # Proof that the signed runs signed: their Pongs reached the inbox with a signature.
            extra["signed_events"] = [m.signed for m in runs[True]]
    else:
        measured = plain = _measure(args, traced=False, templates=templates)
        extra["cpu_us_per_message"] = measured.cpu_us_per_message()
    if templates:
        # The same run again, on a service whose outbox and inbox hold N finished rows each.
        filled: list[dict[str, Any]] = []
        past = _measure(args, traced=False, prefill=(args.history, templates), filled=filled)
        extra["history"] = history.summary(args.history, plain.rate, past.rate, filled)
    seconds, total, raw_publish, raw_consume, body_size = measured[:5]
    raw = min(raw_publish, raw_consume)
    return Result(
        stage="e2e",
        messages=total,
        seconds=seconds,
        raw_limit_rate=raw,
        raw_limit=(
            "slower of plain pika publish with streamed confirms and plain pika consume "
            "(prefetch 1000, multiple acks), same queue and size, no database"
        ),
        extra={
            "raw_publish_rate": round(raw_publish, 1),
            "raw_consume_rate": round(raw_consume, 1),
            "pings": args.pings,
            "message_bytes": body_size,
            "workers": args.workers,
            "queue_type": args.queue_type,
            "bar_rate": 3000,
            **extra,
        },
    )


def _median_run(runs: list[_Measured]) -> _Measured:
    """The run of median rate (the slower of the middle two of an even number)."""
    return sorted(runs, key=lambda m: m.rate)[(len(runs) - 1) // 2]


def _median_cpu(runs: list[_Measured]) -> dict[str, float]:
    """Each part's median CPU microseconds per message over ``runs``, and their ``total``."""
    each = [m.cpu_us_per_message() for m in runs]
    parts = {name: statistics.median(e[name] for e in each) for name in each[0] if name != "total"}
    parts["total"] = sum(parts.values())
    return {name: round(value, 1) for name, value in parts.items()}


def _measure(
    args: argparse.Namespace,
    *,
    traced: bool,
    signed: bool = False,
    exporter: str = "none",
    templates: dict[str, list[dict[str, Any]]] | None = None,
    prefill: tuple[int, dict[str, list[dict[str, Any]]]] | None = None,
    filled: list[dict[str, Any]] | None = None,
) -> _Measured:
    """One run on a scratch service of its own; ``exporter`` is the daemons' OTEL_TRACES_EXPORTER;
    ``signed``: the publisher signs every event and the receiver verifies them (:func:`signing_env`).
    ``templates`` receives a sample of the finished rows of each table at the end;
    ``prefill`` (N, such samples) puts N finished rows repeating them in each table first
    (what was filled goes to ``filled``)."""
    with Scratch(args, "e2e") as scratch:
        service = scratch.service()
        topology.declare(service.settings, service.registry)
        if prefill is not None:
            rows, samples = prefill
            for table, sample in samples.items():
                done = history.prefill(scratch.database_url, table, rows, sample)
                if filled is not None:
                    filled.append(done)
        body_size = _envelope_size(service)
        raw_publish, raw_consume = raw_pipe(scratch.amqp_url, names.inbox_queue(SERVICE), body_size, args.raw_messages)
        log_dir = args.log_dir or Path(scratch.tmp.name) / "logs"
        env = {**scratch.env, "OTEL_TRACES_EXPORTER": exporter}
        if signed:
            env.update(signing_env(Path(scratch.tmp.name)))
        group = ProcessGroup(log_dir, env=env)
        try:
            scratch.start_daemons(group, args.workers)
            wait_ready(scratch, group)
            meter = cpu.pipeline(((d.name, d.process.pid) for d in group.daemons), scratch.database_url)
            meter.start()
            seconds, total = _drive(service, scratch, group, args, traced=traced)
            spent = meter.stop()
            signed_rows = _signed_rows(scratch.database_url) if signed else 0
            if templates is not None:
                for table in (names.OUTBOX, names.INBOX):
                    templates[table] = history.sample(scratch.database_url, table)
        finally:
            group.stop_all()
            service.engine.dispose()
    return _Measured(seconds, total, raw_publish, raw_consume, body_size, spent, signed_rows)


def _signed_rows(database_url: str) -> int:
    from framework.signing import SIGNATURE_HEADER

    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        row = conn.execute(
            "SELECT count(*) FROM txbox.inbox WHERE metadata->'properties'->'headers' ? %s", (SIGNATURE_HEADER,)
        ).fetchone()
    return int(row[0]) if row else 0


def signing_env(folder: Path) -> dict[str, str]:
    """Daemons' settings that sign the service's events with a new RSA-2048 key (version 1)
    and verify them in its receiver, the producer being the service itself."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    from framework.signing import public_key_text

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    (folder / "signing-key.pem").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    (folder / "producers").mkdir(exist_ok=True)
    (folder / "producers" / f"{SERVICE}.1.pem").write_text(public_key_text(key))
    return {
        "TXBOX_SIGNING_KEY_FILE": str(folder / "signing-key.pem"),
        "TXBOX_SIGNING_KEY_VERSION": "1",
        "TXBOX_SIGNING_PUBLIC_KEYS": str(folder / "producers"),
    }


def _business_span() -> contextlib.AbstractContextManager[Any]:
    from opentelemetry import trace

    return trace.get_tracer("txbox.bench").start_as_current_span("write pings")


def _envelope_size(service: Service) -> int:
    spec = service.registry.get("Ping")
    outbox = Outbox(None, service.registry)  # type: ignore[arg-type]
    row = outbox.build(spec, aggregate_id="p1000000", payload={"n": 1_000_000, "echo": True})
    message = Message(
        message_id=row.id,
        message_type=row.message_type,
        aggregate_type=row.aggregate_type,
        aggregate_id=row.aggregate_id,
        payload=row.payload,
    )
    return len(message.to_json())


def _drive(
    service: Service, scratch: Scratch, group: ProcessGroup, args: argparse.Namespace, *, traced: bool = False
) -> tuple[float, int]:
    expected = 2 * args.pings
    written = done = 0
    stalled_since = time.monotonic()
    last = -1
    # The load generator's URL (Scratch.service): the meter leaves this connection out.
    with psycopg.connect(conninfo(service.settings.database_url), autocommit=True) as conn:
        started = time.perf_counter()
        while done < expected:
            allowed = min(args.pings - written, args.batch, args.window - (written - done // 2))
            if allowed > 0:
                # Traced: each business transaction in a span, the parent of its Pings.
                with _business_span() if traced else contextlib.nullcontext():
                    write_pings(service, written, allowed, echo=True)
                written += allowed
            done = handled(conn)
            if done != last:
                last, stalled_since = done, time.monotonic()
            elif time.monotonic() - stalled_since > 60:
                raise TxboxError(f"no progress for 60 s at {done} of {expected} messages; logs: {group.log_dir}")
            dead = group.dead()
            if dead:
                raise TxboxError(f"{dead[0].name} exited: {dead[0].log_tail()}")
            raise_if_terminated()
            if allowed <= 0:
                time.sleep(0.01)  # pacing the writer while the window is full
        seconds = time.perf_counter() - started
    return seconds, done
