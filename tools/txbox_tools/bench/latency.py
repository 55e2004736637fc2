"""`txbox bench latency`: outbox commit → handler commit at a fixed offered load.

The scratch service of ``txbox bench e2e`` (its own database, vhost and daemon
processes) receives ``--rate`` Ping commands per second for ``--seconds``, each written
by its own business transaction, as a web request would. The Ping handler records
``clock_timestamp()`` in a business row, with one INSERT as the raw path's consumer writes
its row (``--handler statement``, the default) or through the session's unit of work
(``--handler orm``); a message's latency is that time minus the
``created_at`` of its outbox row (``clock_timestamp()`` at the INSERT, just before its
commit), both read from the same PostgreSQL clock. The bars are ratios to the raw path
of the same run (:func:`ratios`): CPU at most twice, p50 and p99 at most three times the raw path's.

Raw limit, measured in the same run at the same offered load just before: the same
business transaction, then a plain pika publish with a blocking confirm and a plain pika
consumer committing one row per message — the floor any outbox-free design pays on this
machine. Its rate and latency are reported as ``raw_limit_rate`` / ``raw_p50_ms`` /
``raw_p99_ms``.

CPU, beside time (docs/explanation/daemons.md, "CPU per message"): ``cpu_cores`` is the CPU
seconds per wall second of every process that carries the messages — each daemon, the
PostgreSQL processes serving them, the RabbitMQ node, not the load generator — from the
first message offered to the last one handled; ``cpu_ms_per_message`` the same per
message; ``cpu_cores_by_component`` its parts; ``raw_cpu_cores`` the raw path's at the
same offered rate (its consumer thread, its PostgreSQL backend and helpers, the broker).
Run it at the rates of the bars: ``--rate 100``, ``--rate 500``, ``--rate 2000``.
"""

from __future__ import annotations

import argparse
import math
import socket
import statistics
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import pika
import psycopg

from framework import topology
from framework.db import conninfo
from framework.errors import TxboxError
from framework.service import Service
from txbox_tools.bench import cpu
from txbox_tools.bench.e2e import HANDLER_ENV, HANDLERS, Scratch, add_common_options, handled, wait_ready
from txbox_tools.bench.result import Result
from txbox_tools.processes import ProcessGroup, raise_if_terminated

Sender = Callable[[int], None]
PERCENTILES = "percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP (ORDER BY ms)"


def configure(parser: argparse.ArgumentParser) -> None:
    add_writers_option(parser)
    parser.add_argument("--rate", type=float, default=500.0, help="offered messages/s (default 500)")
    parser.add_argument("--seconds", type=float, default=30.0, help="duration of the offered load (default 30)")
    parser.add_argument("--raw-seconds", type=float, default=10.0, help="duration of the raw measurement")
    parser.add_argument(
        "--runs",
        type=int,
        default=1,
        help="measure this many times, each with its own raw path, and report each figure's median "
        "and the spread of the main ones (default 1)",
    )
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds excluded at the start (default 2)")
    parser.add_argument(
        "--deployment",
        choices=("daemons", "run"),
        default="daemons",
        help="daemons: one process per daemon, --workers workers (default); run: one `txbox run` "
        "(publisher, receiver and one worker on one loop)",
    )
    parser.add_argument(
        "--handler",
        choices=HANDLERS,
        default="statement",
        help="how the handler writes its row: statement, one INSERT as the raw path's consumer writes "
        "its row (default); orm, through the session's unit of work",
    )
    add_common_options(parser)


WRITER_RATE = 100.0  # msg/s one writer offers with room to spare (one commit, one fsync wait each)
MIN_WRITERS = 4


def add_writers_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--writers",
        type=int,
        default=None,
        help=f"concurrent writers sharing the offered load (default: one per {WRITER_RATE:g} msg/s, "
        f"at least {MIN_WRITERS})",
    )


def writers(args: argparse.Namespace) -> int:
    """``--writers``, or enough of them for ``--rate``: each writer waits for its commit's
    fsync, so a fixed few of them cap the offered load, and a high ``--rate`` would
    measure the writers instead of the pipeline (benchmarks/README.md, "Latency")."""
    return int(args.writers or max(MIN_WRITERS, math.ceil(args.rate / WRITER_RATE)))


def run(args: argparse.Namespace) -> Result:
    """One measurement, or with ``--runs N`` the medians of N (:func:`medians`)."""
    if args.runs < 1:
        raise TxboxError(f"--runs must be at least 1, not {args.runs}")
    results = [_measure(args) for _ in range(args.runs)]
    return results[0] if len(results) == 1 else medians(results)


def _measure(args: argparse.Namespace) -> Result:
    args.writers = writers(args)
    with Scratch(args, "latency") as scratch:
        service = scratch.service()
        topology.declare(service.settings, service.registry)
        raw_rate, raw_ms, raw_cpu = _raw(scratch, args)
        log_dir = args.log_dir or Path(scratch.tmp.name) / "logs"
        group = ProcessGroup(log_dir, env={**scratch.env, HANDLER_ENV: args.handler})
        try:
            one_process = args.deployment == "run"
            if one_process:
                args.workers = 1
            publisher_port = _free_port()
            # One `txbox run` serves the worker's counters on the publisher's port.
            ports = [publisher_port] if one_process else [_free_port() for _ in range(args.workers)]
            scratch.start_daemons(
                group,
                args.workers,
                worker_metrics_ports=ports,
                publisher_metrics_port=publisher_port,
                one_process=one_process,
            )
            wait_ready(scratch, group)
            meter = cpu.pipeline(((d.name, d.process.pid) for d in group.daemons), scratch.database_url)
            counted = _worker_counts(ports)
            relayed = _counts(publisher_port, _RELAY_COUNTED)
            meter.start()
            began = time.perf_counter()
            sent, seconds = _offer(service, group, args)
            _wait_handled(scratch, group, sent)
            used = cpu.summary(meter.stop(), time.perf_counter() - began, sent)
            statements = _statements(counted, _worker_counts(ports), sent)
            statements.update(_relay_statements(relayed, _counts(publisher_port, _RELAY_COUNTED), sent))
            ms, worst, breakdown = _latencies(scratch.database_url, args.warmup)
        finally:
            group.stop_all()
            service.engine.dispose()
    p50, p95, p99 = ms
    result = Result(
        stage="latency",
        messages=sent,
        seconds=seconds,
        raw_limit_rate=raw_rate,
        raw_limit=(
            "same offered load: business commit, plain pika publish with a blocking confirm, "
            "plain pika consumer committing one row per message"
        ),
        extra={
            "offered_rate": args.rate,
            "p50_ms": p50,
            "p95_ms": p95,
            "p99_ms": p99,
            "max_ms": worst,
            **breakdown,
            "raw_p50_ms": raw_ms[0],
            "raw_p95_ms": raw_ms[1],
            "raw_p99_ms": raw_ms[2],
            **used,
            **statements,
            **raw_cpu,
            "deployment": args.deployment,
            "handler": args.handler,
            "workers": args.workers,
            "writers": args.writers,
            "queue_type": args.queue_type,
        },
    )
    result.extra.update(ratios(result.extra))
    return result


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The workers' own counts (framework/worker/counts.py), read from their /metrics: this
# PostgreSQL has no pg_stat_statements loaded, and the workers share the scratch database
# with the other daemons, so its transaction counts cannot tell them apart.
_COUNTED = {
    "txbox_worker_statements_total": "statements",
    'txbox_worker_claims_total{found="nothing"': "empty_claims",
    'txbox_worker_claims_total{found="rows"': "claims_with_rows",
}


# The relay's (framework/relay/daemon.py, ``Relay.statements``), by kind.
_RELAY_COUNTED = {
    'txbox_publisher_statements_total{kind="claim"': "claims",
    'txbox_publisher_statements_total{kind="mark"': "marks",
    'txbox_publisher_statements_total{kind="write"': "writes",
    'txbox_publisher_statements_total{kind="gauge"': "gauges",
    'txbox_publisher_claims_total{found="nothing"': "empty_claims",
}


def _worker_counts(ports: list[int]) -> list[dict[str, float]] | None:
    """Each worker's counters now; None when a worker has none (a version without them)."""
    out = []
    for port in ports:
        counts = _counts(port, _COUNTED)
        if counts is None:
            return None
        out.append(counts)
    return out


def _counts(port: int, counted: dict[str, str]) -> dict[str, float] | None:
    """The counters ``counted`` names, read from a daemon's /metrics; None when it has none of
    them (a version without them)."""
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as answer:
                text = answer.read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                return None
            time.sleep(0.2)
    counts: dict[str, float] = dict.fromkeys(counted.values(), 0.0)
    metric = next(iter(counted)).split("{", 1)[0]
    for line in text.splitlines():
        for prefix, name in counted.items():
            if line.startswith(prefix) and not line.startswith("#"):
                counts[name] += float(line.rsplit(" ", 1)[1])
    return counts if metric in text else None


def _relay_statements(before: dict[str, float] | None, after: dict[str, float] | None, sent: int) -> dict[str, Any]:
    """The relay's statements per message, by kind (a claim carries the marks of the one before)."""
    if before is None or after is None:
        return {}
    spent = {name: int(after[name] - before[name]) for name in after}
    total = sum(spent[k] for k in ("claims", "marks", "writes", "gauges"))
    return {"relay_statements_per_message": round(total / max(sent, 1), 3), "relay_counts": spent}


def _statements(
    before: list[dict[str, float]] | None, after: list[dict[str, float]] | None, sent: int
) -> dict[str, Any]:
    """Per worker and in all: statements per message, claims that found rows and nothing."""
    if before is None or after is None:
        return {}
    per_worker = [{k: int(a[k] - b[k]) for k in a} for b, a in zip(before, after, strict=True)]
    total = {k: sum(w[k] for w in per_worker) for k in per_worker[0]} if per_worker else {}
    return {
        "worker_statements_per_message": round(total.get("statements", 0) / max(sent, 1), 3),
        "worker_claims_with_rows": total.get("claims_with_rows", 0),
        "worker_empty_claims": total.get("empty_claims", 0),
        "worker_counts": per_worker,
    }


# The bars are ratios to the raw path of the same run, never absolute figures: this
# machine's speed moves 3-4x from hour to hour (benchmarks/README.md, "Latency").
RAW_FLOOR_MS = 2.0  # a raw latency below this counts as this much: the ratio of two tiny figures says little
BAR_CPU_RATIO = 2.0
BAR_LATENCY_RATIO = 3.0
# The figures whose spread (min and max over the runs) --runs reports beside their medians.
SPREAD = (
    "p50_ms",
    "p99_ms",
    "raw_p50_ms",
    "raw_p99_ms",
    "cpu_cores",
    "raw_cpu_cores",
    "cpu_ratio",
    "p50_ratio",
    "p99_ratio",
)


def ratios(extra: dict[str, Any]) -> dict[str, Any]:
    """One run's ratios to its raw path, and whether they are within the bars: CPU at most
    :data:`BAR_CPU_RATIO` times the raw path's cores, p50 and p99 at most
    :data:`BAR_LATENCY_RATIO` times the raw path's (each at least :data:`RAW_FLOOR_MS`)."""
    cpu_ratio = extra["cpu_cores"] / extra["raw_cpu_cores"] if extra.get("raw_cpu_cores") else math.inf
    p50_ratio = extra["p50_ms"] / max(extra["raw_p50_ms"], RAW_FLOOR_MS)
    p99_ratio = extra["p99_ms"] / max(extra["raw_p99_ms"], RAW_FLOOR_MS)
    return {
        "cpu_ratio": round(cpu_ratio, 2),
        "p50_ratio": round(p50_ratio, 2),
        "p99_ratio": round(p99_ratio, 2),
        "bar_cpu_ratio": BAR_CPU_RATIO,
        "bar_latency_ratio": BAR_LATENCY_RATIO,
        "within_bars": _within(cpu_ratio, p50_ratio, p99_ratio),
    }


def _within(cpu_ratio: float, p50_ratio: float, p99_ratio: float) -> bool:
    return cpu_ratio <= BAR_CPU_RATIO and max(p50_ratio, p99_ratio) <= BAR_LATENCY_RATIO


def _numeric(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _median(values: list[float]) -> float:
    return round(float(statistics.median(values)), 3)


def medians(results: list[Result]) -> Result:
    """Several runs as one result: each numeric figure the median of the runs (the ratios
    too, each taken run by run against that run's raw path; the parts of a figure by
    component each the median of its own), ``spread`` the lowest and
    highest of the main ones (:data:`SPREAD`), ``within_bars`` whether the medians are."""
    runs = [r.as_dict() for r in results]
    first = results[0]
    extra: dict[str, Any] = {}
    for key, value in first.extra.items():
        if _numeric(value):
            extra[key] = _median([r.extra[key] for r in results])
        elif isinstance(value, dict) and all(_numeric(v) for v in value.values()):  # CPU by component, say
            extra[key] = {k: _median([r.extra[key].get(k, 0) for r in results]) for k in value}
        else:
            extra[key] = value
    extra["within_bars"] = _within(extra["cpu_ratio"], extra["p50_ratio"], extra["p99_ratio"])
    extra["runs"] = len(runs)
    extra["spread"] = {key: [min(r[key] for r in runs), max(r[key] for r in runs)] for key in SPREAD}
    return Result(
        stage=first.stage,
        messages=int(statistics.median(r.messages for r in results)),
        seconds=statistics.median(r.seconds for r in results),
        raw_limit_rate=statistics.median(r.raw_limit_rate for r in results),
        raw_limit=first.raw_limit,
        extra=extra,
    )


def paced(total: int, rate: float, writers: int, make_sender: Callable[[], AbstractContextManager[Sender]]) -> float:
    """Send ``total`` messages on a fixed schedule (open loop) from ``writers`` threads.

    Message ``i`` is due at ``start + i / rate`` whatever happened to the others, as
    independent requests to a web front end would be; each thread has its own
    connections (``make_sender``). Returns the seconds the schedule took.
    """
    errors: list[BaseException] = []
    started = time.perf_counter() + 0.2  # every thread ready before the first is due

    def writer(index: int) -> None:
        try:
            with make_sender() as send:
                for i in range(index, total, writers):
                    delay = started + i / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)  # the offered load's schedule, not synchronization
                    send(i)
        except BaseException as exc:  # reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(n,), name=f"writer {n}") for n in range(writers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise TxboxError(f"a writer failed: {errors[0]!r}")
    return time.perf_counter() - started


def _offer(service: Service, group: ProcessGroup, args: argparse.Namespace) -> tuple[int, float]:
    """One business transaction per Ping (the outbox row commits with it).

    Each writer keeps one raw psycopg connection and an INSERT compiled once from the
    outbox table, the row built and validated by ``Outbox.build``: what a lean front end
    does. (A SQLAlchemy Session per request costs so much CPU that the writers, not
    txbox, would cap the offered load: benchmarks/README.md, "Figures (e2e, latency, demo)".)
    """
    from framework.outbox import Outbox
    from framework.sql import outbox as outbox_sql

    spec = service.registry.get("Ping")
    builder = Outbox(None, service.registry)  # type: ignore[arg-type]  # build() never writes
    statement = outbox_sql.insert(service.settings.schema)

    @contextmanager
    def sender() -> Iterator[Sender]:
        with psycopg.connect(conninfo(service.settings.database_url), application_name=cpu.LOAD_APPLICATION) as conn:

            def send(i: int) -> None:
                row = builder.build(spec, aggregate_id=f"p{i}", payload={"n": i, "echo": False})
                conn.execute(statement, row.params())
                conn.commit()

            yield send

    total = int(args.rate * args.seconds)
    seconds = paced(total, args.rate, args.writers, sender)
    if group.dead():
        raise TxboxError(f"{group.dead()[0].name} exited: {group.dead()[0].log_tail()}")
    return total, seconds


def _wait_handled(scratch: Scratch, group: ProcessGroup, expected: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    # The bench's own observer: not counted in the pipeline's CPU.
    with psycopg.connect(
        conninfo(scratch.database_url), autocommit=True, application_name=cpu.LOAD_APPLICATION
    ) as conn:
        while handled(conn) < expected:
            if group.dead():
                raise TxboxError(f"{group.dead()[0].name} exited: {group.dead()[0].log_tail()}")
            if time.monotonic() > deadline:
                raise TxboxError(f"only {handled(conn)} of {expected} handled after {timeout:.0f}s")
            raise_if_terminated()
            time.sleep(0.1)


# Where the time goes, each from the same PostgreSQL clock: the relay (outbox commit →
# broker confirm recorded), the broker and the receiver (outbox commit → inbox row),
# the worker (inbox row → handler's business row).
STAGES = {
    "relay": "processed_at - created_at",
    "to_inbox": "received_at - created_at",
    "worker": "handled_at - received_at",
}


def _latencies(database_url: str, warmup: float) -> tuple[tuple[float, float, float], float, dict[str, float]]:
    """Percentiles of handler commit minus outbox created_at, skipping the first ``warmup``
    seconds; and the p50 and p99 of each stage (:data:`STAGES`)."""
    stages = ", ".join(
        f"percentile_cont(ARRAY[0.5, 0.99]) WITHIN GROUP (ORDER BY extract(epoch FROM {expr}) * 1000)"
        for expr in STAGES.values()
    )
    query = f"""
        WITH l AS (
            SELECT extract(epoch FROM h.handled_at - o.created_at) * 1000 AS ms, o.created_at, o.processed_at,
                   i.created_at AS received_at, h.handled_at
            FROM bench_handled h JOIN txbox.outbox o ON o.id = h.message_id JOIN txbox.inbox i ON i.id = h.message_id
        ), t0 AS (SELECT min(created_at) AS t FROM l)
        SELECT {PERCENTILES}, max(ms), {stages}
        FROM l, t0 WHERE l.created_at >= t0.t + make_interval(secs => %s)
    """
    with psycopg.connect(conninfo(database_url)) as conn:
        row = conn.execute(query, (warmup,)).fetchone()
    if not row or row[0] is None:
        raise TxboxError("no latencies recorded")
    p50, p95, p99 = (round(float(v), 2) for v in row[0])
    breakdown = {}
    for name, values in zip(STAGES, row[2:], strict=True):
        breakdown[f"{name}_p50_ms"], breakdown[f"{name}_p99_ms"] = (round(float(v), 2) for v in values)
    return (p50, p95, p99), round(float(row[1]), 2), breakdown


def _raw(scratch: Scratch, args: argparse.Namespace) -> tuple[float, tuple[float, float, float], dict[str, Any]]:
    """The same offered load without txbox: commit, publish + confirm, consume + commit."""
    queue = f"bench-raw-{uuid.uuid4().hex[:6]}"  # a scratch queue of the scratch vhost, not a txbox one
    dsn = conninfo(scratch.database_url)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE bench_raw (id uuid PRIMARY KEY, sent_at timestamptz, got_at timestamptz)")
    total = max(1, int(args.rate * args.raw_seconds))
    consumer = _RawConsumer(scratch, dsn, queue, total)
    thread = threading.Thread(target=consumer.run, name="raw consumer")
    thread.start()
    consumer.ready.wait(30)
    consumer.meter.start()
    began = time.perf_counter()
    seconds = paced(total, args.rate, args.writers, partial(_raw_sender, scratch.amqp_url, dsn, queue))
    thread.join(120)
    if consumer.errors:
        raise TxboxError(f"raw measurement failed: {consumer.errors[0]!r}")
    with psycopg.connect(dsn) as db:
        row: Any = db.execute(
            f"SELECT {PERCENTILES} FROM (SELECT extract(epoch FROM got_at - sent_at) * 1000 AS ms "
            "FROM bench_raw WHERE got_at IS NOT NULL) l"
        ).fetchone()
    p50, p95, p99 = (round(float(v), 2) for v in row[0])
    if not consumer.ended:
        raise TxboxError("raw measurement: the consumer did not finish")
    return (
        total / seconds,
        (p50, p95, p99),
        cpu.summary(consumer.spent, consumer.ended[0] - began, total, prefix="raw_"),
    )


class _RawConsumer:
    """The raw path's consumer: plain pika, one committed UPDATE per message, then its CPU."""

    def __init__(self, scratch: Scratch, dsn: str, queue: str, total: int) -> None:
        self.amqp_url, self.dsn, self.queue, self.total = scratch.amqp_url, dsn, queue, total
        self.ready = threading.Event()
        self.errors: list[BaseException] = []
        # Read by the consumer itself after its last message, while its connections (and so
        # their server processes) still exist.
        self.meter = cpu.Meter(
            {
                "postgres": partial(cpu.database_servers, scratch.database_url, cpu.RAW_CONSUMER_APPLICATION),
                "rabbitmq": cpu.broker,
            }
        )
        self.spent: dict[str, float] = {}
        self.ended: list[float] = []

    def run(self) -> None:
        try:
            conn = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
            db = psycopg.connect(self.dsn, autocommit=True, application_name=cpu.RAW_CONSUMER_APPLICATION)
            channel = conn.channel()
            channel.queue_declare(self.queue, durable=True)
            channel.basic_qos(prefetch_count=100)
            own = time.thread_time()
            self.ready.set()
            for got, (method, _, body) in enumerate(channel.consume(self.queue, inactivity_timeout=30), start=1):
                if method is None:
                    break
                db.execute("UPDATE bench_raw SET got_at = clock_timestamp() WHERE id = %s", (body.decode(),))
                channel.basic_ack(method.delivery_tag)
                if got >= self.total:
                    break
            self.spent.update(self.meter.stop(), consumer=time.thread_time() - own)
            self.ended.append(time.perf_counter())
            channel.cancel()
            conn.close()
            db.close()
        except BaseException as exc:  # reported by the main thread
            self.errors.append(exc)
            self.ready.set()


@contextmanager
def _raw_sender(amqp_url: str, dsn: str, queue: str) -> Iterator[Sender]:
    """One raw writer's connections: a committed INSERT, then a publish with a blocking confirm."""
    props = pika.BasicProperties(delivery_mode=2, content_type="text/plain")
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    channel = connection.channel()
    channel.confirm_delivery()
    db = psycopg.connect(dsn, autocommit=True, application_name=cpu.LOAD_APPLICATION)

    def send(i: int) -> None:
        message_id = str(uuid.uuid4())
        db.execute("INSERT INTO bench_raw (id, sent_at) VALUES (%s, clock_timestamp())", (message_id,))
        channel.basic_publish("", queue, message_id.encode(), props)

    try:
        yield send
    finally:
        connection.close()
        db.close()
