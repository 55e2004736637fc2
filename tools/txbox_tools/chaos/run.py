"""`txbox chaos`: the example saga under load while daemons crash and servers restart.

The run, in order:

1. starts a private PostgreSQL (fsync on) and a private RabbitMQ node (or, with
   ``--rabbit-nodes 3``, a cluster of three whose URLs every daemon gets) on free ports, so
   restarting them disturbs nothing else on the machine; creates and migrates both
   services' databases and declares the topology;
2. starts every daemon of both services as its own ``txbox`` process under a
   :class:`~txbox_tools.chaos.supervisor.Supervisor` (restarts whatever dies);
3. restocks the inventory, then a feeder thread writes PlaceOrder commands into the
   order service's outbox at ``--rate`` orders/s, with ids drawn from the seed and
   ``ON CONFLICT DO NOTHING``, so a batch whose commit outcome a database restart hid
   is simply written again — never twice;
4. fires the seeded fault schedule (:mod:`txbox_tools.chaos.faults`) at its progress
   points, sampling the handled-message count every half second;
5. waits for the backlog to drain after the last fault, stops the daemons, and judges
   the data (:mod:`txbox_tools.chaos.verdict`), then runs ``txbox analyze --fail-on-lost``.

With ``--tenants N`` (``--deployment run``) every service keeps each of N tenants in a
database of its own and one `txbox run` per service serves them all; the orders are
shared out between the tenants and each tenant is judged on its own
(:mod:`txbox_tools.chaos.tenants`).

Figures: one line — orders, messages, kills, restarts, lost, duplicated, abandoned,
throughput between faults, recovery time after the last fault, wall time.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import json
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psycopg
from sqlalchemy.orm import Session

from framework import names, topology
from framework.db import conninfo
from framework.service import Service
from framework.sql import outbox as outbox_sql
from txbox_tools import repository
from txbox_tools.chaos import apps, tenants
from txbox_tools.chaos.faults import DAEMON_KINDS, Fault, Kind, describe, in_one_process, plan, replica_name
from txbox_tools.chaos.instances import PrivatePostgres, PrivateRabbit, PrivateRabbitCluster
from txbox_tools.chaos.supervisor import Spec, Supervisor
from txbox_tools.chaos.tenants import Cell
from txbox_tools.chaos.verdict import Verdict, judge
from txbox_tools.errors import ChaosFailed

#: Leases short enough that rows claimed by a killed daemon come back within seconds
#: (correctness does not depend on them; recovery time does).
DAEMON_ENV = {
    "TXBOX_PUBLISHER_LEASE": "10s",
    "TXBOX_PUBLISHER_CONFIRM_TIMEOUT": "5s",
    "TXBOX_WORKER_LEASE": "10s",
    "TXBOX_WORKER_TIMEOUT": "5s",
    "PYTHONUNBUFFERED": "1",
}
SETTLE = 3.0  # seconds after a fault that count as recovery, not as "between faults"


@dataclass(kw_only=True)
class ChaosOptions:
    messages: int = 50_000  # orders placed (each is 3 handled messages: the saga)
    faults: int = 16
    seed: int = 1
    rate: float = 600.0  # orders/s offered
    batch: int = 100
    skus: int = 20
    stock_ratio: float = 0.9
    poison: bool = True
    analyze: bool = True
    min_gap: float = 2.0  # seconds of plain load between two faults at least
    drain_timeout: float = 600.0
    stall_timeout: float = 180.0
    queue_type: str = "quorum"
    workers: int = 1  # worker processes per service (they share the inbox with SKIP LOCKED)
    replicas: int = 1  # processes of every daemon per service; kills pick among them
    rabbit_nodes: int = 1  # 3 or more: a RabbitMQ cluster, and the rabbitmq_node_kill fault
    lose_node: bool = False  # on a cluster: the rabbitmq_node_lost fault ends the schedule
    #: ``daemons``: a process per daemon; ``run``: one `txbox run` per service (and replica),
    #: which every kill of one of its daemons kills whole
    deployment: str = "daemons"
    #: Tenants of every service, a database each, all served by the service's `txbox run`
    #: (``deployment`` ``run``); 0: none, the services' own databases
    tenants: int = 0
    keep_logs: bool = False
    log_dir: Path | None = None


@dataclass
class Event:
    fault: Fault
    started: float
    ended: float
    detail: str = ""


@dataclass
class Report:
    options: ChaosOptions
    verdict: Verdict
    events: list[Event]
    kills: int
    unexpected_exits: dict[str, int]
    pg_restarts: int
    rabbit_restarts: int
    rabbit_node_kills: int
    connection_kills: int
    #: Seconds from the loss of a node for good to the first message stored afterwards by
    #: the service that took longest (None without that fault).
    node_lost_resumed: float | None
    wall_seconds: float
    load_seconds: float
    rate_between_faults: float
    recovery_seconds: float
    analyze_exit: int | None
    log_dir: Path
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.analyze_exit in (None, 0)

    def figures(self) -> dict[str, Any]:
        v = self.verdict
        return {
            "seed": self.options.seed,
            "tenants": self.options.tenants,
            "orders": self.options.messages,
            "messages": v.handled,
            "relayed": v.relayed,
            "kills": self.kills,
            "restarts": self.pg_restarts + self.rabbit_restarts,
            "pg_restarts": self.pg_restarts,
            "rabbitmq_restarts": self.rabbit_restarts,
            "rabbitmq_node_kills": self.rabbit_node_kills,
            "rabbitmq_node_lost_resumed_s": None
            if self.node_lost_resumed is None
            else round(self.node_lost_resumed, 1),
            "connection_kills": self.connection_kills,
            "crashes": sum(self.unexpected_exits.values()),
            "lost": v.lost,
            "duplicated": v.duplicated,
            "abandoned": v.abandoned,
            "rate_between_faults": round(self.rate_between_faults),
            "recovery_s": round(self.recovery_seconds, 1),
            "wall_s": round(self.wall_seconds, 1),
            "analyze": "skipped" if self.analyze_exit is None else self.analyze_exit,
            "ok": self.ok,
        }

    def line(self) -> str:
        f = self.figures()
        resumed = f["rabbitmq_node_lost_resumed_s"]
        return (
            f"chaos seed={f['seed']}: "
            + (f"tenants={f['tenants']} " if f["tenants"] else "")
            + f"orders={f['orders']:,} messages={f['messages']:,} kills={f['kills']} "
            f"restarts={f['restarts']} (pg {f['pg_restarts']}, rabbitmq {f['rabbitmq_restarts']}) "
            f"rabbitmq_node_kills={f['rabbitmq_node_kills']} "
            + ("" if resumed is None else f"node_lost_resumed={resumed}s ")
            + f"connection_kills={f['connection_kills']} crashes={f['crashes']} lost={f['lost']} "
            f"duplicated={f['duplicated']} abandoned={f['abandoned']} "
            f"rate_between_faults={f['rate_between_faults']:,}/s recovery={f['recovery_s']}s "
            f"wall={f['wall_s']}s analyze={f['analyze']} verdict={'OK' if self.ok else 'VIOLATED'}"
        )


# --- feeding -------------------------------------------------------------------------------


def _retrying(action: Callable[[], Any], deadline: float, what: str) -> Any:
    """Run ``action`` until it succeeds: the database may be restarting under us."""
    while True:
        try:
            return action()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise ChaosFailed(f"{what} kept failing: {exc}") from exc
            time.sleep(0.2)  # back-off while the server restarts


class Feeder(threading.Thread):
    """Writes PlaceOrder commands into the order outbox at a steady offered rate.

    Ids and payloads come from the seed, and rows are inserted ``ON CONFLICT (id) DO
    NOTHING``: when a database restart hides whether a batch committed, writing it again
    is harmless — the client-side idempotency a real front end needs too.
    """

    def __init__(self, service: Service, options: ChaosOptions, skus: list[str]) -> None:
        super().__init__(name="chaos-feeder", daemon=True)
        self.service = service
        self.options = options
        self.skus = skus
        self.rng = random.Random(options.seed * 7919 + 1)
        self.sent = 0
        self.finished_at: float | None = None
        self.error: BaseException | None = None
        self.stop_event = threading.Event()
        self._insert = outbox_sql.insert_pyformat(service.settings.schema) + " ON CONFLICT (id) DO NOTHING"

    def build(self, first: int, count: int, *, customer: str | None = None) -> list[dict[str, Any]]:
        spec = self.service.registry.get("PlaceOrder")
        with Session(self.service.engine) as session:
            outbox = self.service.outbox(session)
            return [
                outbox.build(
                    spec,
                    aggregate_id=order_id(n) if customer is None else "order-poison",
                    payload={
                        "customer": customer or f"customer-{n % 997}",
                        "sku": self.rng.choice(self.skus),
                        "quantity": self.rng.randint(1, 5),
                    },
                    message_context={"correlation_id": str(uuid.UUID(int=self.rng.getrandbits(128), version=4))},
                    message_id=uuid.UUID(int=self.rng.getrandbits(128), version=4),
                ).params()
                for n in range(first, first + count)
            ]

    def write(self, rows: list[dict[str, Any]]) -> None:
        def once() -> None:
            # The outbox's own INSERT: its rows' JSON columns are text and a NULL
            # ``locked_until`` means "due now" (framework/sql/outbox.py).
            with self.service.engine.begin() as conn:
                conn.exec_driver_sql(self._insert, rows)

        _retrying(once, time.monotonic() + self.options.stall_timeout, "writing PlaceOrder commands")

    def run(self) -> None:
        try:
            started = time.monotonic()
            total = self.options.messages
            while self.sent < total and not self.stop_event.is_set():
                due = min(total, int((time.monotonic() - started) * self.options.rate) + self.options.batch)
                if due - self.sent < self.options.batch and due < total:
                    self.stop_event.wait(0.02)  # pacing the offered load
                    continue
                count = min(self.options.batch, total - self.sent)
                self.write(self.build(self.sent, count))
                self.sent += count
            self.finished_at = time.monotonic()
        except BaseException as exc:
            self.error = exc


def order_id(n: int) -> str:
    return f"order-{n:07d}"


# --- the run -------------------------------------------------------------------------------


def _available(command: str) -> bool:
    import importlib.util

    from framework.cli import COMMANDS

    return command in COMMANDS and importlib.util.find_spec(COMMANDS[command][0]) is not None


def _count(dsn: str, query: str) -> int | None:
    try:
        with psycopg.connect(dsn, connect_timeout=2) as conn:
            row = conn.execute(query).fetchone()
            return int(row[0]) if row else 0
    except psycopg.Error:
        return None  # the server is restarting: no sample this time


HANDLED = "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL"
PENDING = (
    "SELECT (SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL) "
    "+ (SELECT count(*) FROM txbox.outbox WHERE processed_at IS NULL AND abandoned_at IS NULL)"
)


def run(options: ChaosOptions, out: TextIO = sys.stdout) -> Report:
    def say(text: str) -> None:
        print(text, file=out, flush=True)

    wall_start = time.monotonic()
    daemons, schedule = _planned(options)
    cluster = options.rabbit_nodes > 1
    across = f" across {options.tenants} tenants (a database of each service each)" if options.tenants else ""
    say(f"txbox chaos: {options.messages:,} orders{across}, seed {options.seed}, schedule: {describe(schedule)}")
    log_dir = options.log_dir or Path(tempfile.mkdtemp(prefix="txbox-chaos-logs-"))

    from txbox_tools.processes import ProcessGroup

    broker = PrivateRabbitCluster(options.rabbit_nodes) if cluster else PrivateRabbit()
    with PrivatePostgres() as pg, broker as rabbit:
        say(f"  private PostgreSQL on :{pg.port} (fsync on), {rabbit.description}")
        urls = {short: pg.create_database(f"chaos_{short}") for short in apps.APPS}
        cells = _cells(options, pg, urls, rabbit.amqp_url())
        dsns = {label: dsn for cell in cells for label, dsn in cell.dsns().items()}
        services = [_services(options, cell.urls, rabbit.amqp_url()) for cell in cells]
        registries = tenants.registry_files(log_dir, cells) if options.tenants else {}
        specs = _specs(options, daemons, urls, rabbit.amqp_url(), registries)
        supervisor = Supervisor(ProcessGroup(log_dir), specs)
        feeders: list[Feeder] = []
        try:
            supervisor.start()
            say(f"  {len(specs)} daemon processes under supervision (logs: {log_dir})")
            skus = [f"SKU-{n:03d}" for n in range(1, options.skus + 1)]
            shares = [tenants.share(options.messages, len(cells), n) for n in range(len(cells))]
            stocks = [dict.fromkeys(skus, _per_sku(options, orders)) for orders in shares]
            _restock([own["inventory"] for own in services], stocks, supervisor)
            base_handled = sum(_count(d, HANDLED) or 0 for d in dsns.values())
            expected = 3 * options.messages
            say(
                f"  inventory restocked ({len(skus)} SKUs x {stocks[0][skus[0]]:,}"
                + (" each tenant" if options.tenants else "")
                + f"); placing orders at {options.rate:,.0f}/s"
            )
            feeders = [
                Feeder(own["orders"], _feeder_options(options, n, orders), skus)
                for n, (own, orders) in enumerate(zip(services, shares, strict=True))
            ]
            inboxes = [names.inbox_queue(service.settings.service) for service in services[0].values()]
            events, samples, poison_id, load_end = _drive(
                options,
                schedule,
                feeders,
                supervisor,
                pg,
                rabbit,
                inboxes,
                dsns,
                cells[0].label("orders"),
                base_handled,
                expected,
                say,
            )
            drained_at = load_end
            _write_timeline(log_dir / "timeline.json", samples, events)
            say("  drained; stopping the daemons (SIGTERM)")
        finally:
            for feeder in feeders:
                feeder.stop_event.set()
            supervisor.stop()
            for own in services:
                for service in own.values():
                    service.engine.dispose()

        verdict = _judge(cells, urls, shares, stocks, poison_id, restocks=len(skus))
        analyze_exit, notes = _analysis(options, urls, registries, log_dir, say)
        last_fault_end = max((e.ended for e in events), default=drained_at)
        report = Report(
            options=options,
            verdict=verdict,
            events=events,
            kills=sum(supervisor.tally.kills.values()),
            unexpected_exits=supervisor.tally.unexpected_exits,
            pg_restarts=pg.restarts,
            rabbit_restarts=rabbit.restarts,
            rabbit_node_kills=rabbit.node_kills if isinstance(rabbit, PrivateRabbitCluster) else 0,
            connection_kills=sum(1 for e in events if e.fault.kind in (Kind.PG_TERMINATE, Kind.AMQP_CLOSE)),
            node_lost_resumed=_resumed_after(dsns, events),
            wall_seconds=time.monotonic() - wall_start,
            load_seconds=drained_at - samples[0][0] if samples else 0.0,
            rate_between_faults=_rate_between_faults(samples, events, drained_at, supervisor.tally.exit_times),
            recovery_seconds=max(0.0, drained_at - last_fault_end),
            analyze_exit=analyze_exit,
            log_dir=log_dir,
            notes=notes,
        )
    _tell(report, say)
    if report.ok and not options.keep_logs and options.log_dir is None:
        shutil.rmtree(log_dir, ignore_errors=True)
    elif not report.ok:
        say(f"  daemon logs kept in {log_dir}")
    return report


def _cells(options: ChaosOptions, pg: PrivatePostgres, urls: dict[str, str], amqp_url: str) -> list[Cell]:
    """The run's tenants, each with a database of every service; without tenants, the
    services' own databases (``urls``) as the one cell. With tenants the services' own
    databases are migrated here: they hold the receivers' turns and the letters of
    deliveries naming no tenant."""
    if not options.tenants:
        return [Cell(None, urls)]
    for service in _services(options, urls, amqp_url).values():
        service.engine.dispose()
    return [
        Cell(key, {short: pg.create_database(f"chaos_{short}_{key}") for short in apps.APPS})
        for key in (tenants.key(n) for n in range(options.tenants))
    ]


def _restock(inventories: list[Service], stocks: list[dict[str, int]], supervisor: Supervisor) -> None:
    """Restock each cell's inventory and wait until every one holds its stock."""
    from examples.demo import restock, stocked

    for inventory, stock in zip(inventories, stocks, strict=True):
        restock(inventory, stock)
    for inventory, stock in zip(inventories, stocks, strict=True):
        _wait(functools.partial(stocked, inventory, stock), 180, "restocking the inventory", supervisor)


def _per_sku(options: ChaosOptions, orders: int) -> int:
    """Units of each SKU restocked for ``orders`` orders: ``stock_ratio`` of what they could ask."""
    return max(1, round(orders * 3 / options.skus * options.stock_ratio))


def _feeder_options(options: ChaosOptions, n: int, orders: int) -> ChaosOptions:
    """What the feeder of cell ``n`` offers: its share of the orders and of the rate, ids from a seed of its own."""
    if not options.tenants:
        return options
    share: ChaosOptions = dataclasses.replace(
        options, messages=orders, rate=options.rate / options.tenants, seed=options.seed * 1000 + n
    )
    return share


def _judge(
    cells: list[Cell],
    urls: dict[str, str],
    shares: list[int],
    stocks: list[dict[str, int]],
    poison_id: uuid.UUID | None,
    *,
    restocks: int,
) -> Verdict:
    """The verdict of each cell (the poison message is the first's), and with tenants one
    more check: nothing stored or lettered in the services' own databases."""

    def of(n: int) -> Verdict:
        cell = cells[n]
        dsns = cell.dsns()
        return judge(
            dsns[cell.label("orders")],
            dsns[cell.label("inventory")],
            orders=shares[n],
            restocks=restocks,
            stock_units=sum(stocks[n].values()),
            poison_id=poison_id if n == 0 else None,
        )

    if cells[0].key is None:
        return of(0)
    verdict = Verdict()
    for n, cell in enumerate(cells):
        verdict.absorb(of(n), f"[tenant {cell.key}]")
    stored = "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)"
    stray = {short: _count(conninfo(url), stored) for short, url in urls.items()}
    verdict.add(
        "nothing stored or lettered outside its tenant",
        all(n == 0 for n in stray.values()),
        ", ".join(f"{short}'s own database: {n} inbox rows and letters" for short, n in stray.items()),
    )
    return verdict


def _planned(options: ChaosOptions) -> tuple[list[str], list[Fault]]:
    """The daemon kinds this checkout has, and the seeded schedule of faults over them."""
    daemons = [d for d in (*DAEMON_KINDS, "collector") if _available(d)]
    missing = [d for d in DAEMON_KINDS if d not in daemons]
    if missing:
        raise ChaosFailed(f"this checkout lacks the txbox daemon command(s) {', '.join(missing)}: nothing to test")
    cluster = options.rabbit_nodes > 1
    if cluster and options.queue_type != "quorum":
        raise ChaosFailed("a run on a RabbitMQ cluster needs quorum inbox queues (--queue-type quorum)")
    schedule = plan(
        options.seed,
        options.faults,
        poison=options.poison,
        daemons=tuple(daemons),
        cluster=cluster,
        replicas=options.replicas,
        lose_node=options.lose_node,
    )
    if options.tenants and options.deployment != "run":
        raise ChaosFailed("tenants are served by `txbox run`: add --deployment run to --tenants")
    if options.deployment == "run":
        schedule = in_one_process(schedule)
    return daemons, schedule


def _services(options: ChaosOptions, urls: dict[str, str], amqp_url: str) -> dict[str, Service]:
    """The two example services on the private servers: migrated, checked, their topology declared."""
    services: dict[str, Service] = {}
    for short, (_, example) in apps.APPS.items():
        apps.prepare(example, urls[short])
        base = apps.orders if short == "orders" else apps.inventory
        services[short] = apps.with_urls(base, urls[short], amqp_url)
        services[short].settings = _with_queue_type(services[short], options.queue_type)
        services[short].check()
        topology.declare(services[short].settings, services[short].registry)
    return services


def _specs(
    options: ChaosOptions, daemons: list[str], urls: dict[str, str], amqp_url: str, registries: dict[str, Path]
) -> dict[str, Spec]:
    """Every daemon process to supervise, by name: each kind per service, in its replicas
    (or, ``--deployment run``, one `txbox run` per service and replica, serving the
    tenants of the service's registry file when there are ``registries``)."""
    specs: dict[str, Spec] = {}
    for short, (app, _) in apps.APPS.items():
        env = {
            **DAEMON_ENV,
            "TXBOX_DATABASE_URL": urls[short],
            "TXBOX_AMQP_URL": amqp_url,
            "TXBOX_QUEUE_TYPE": options.queue_type,
            **({"TXBOX_TENANTS_FILE": str(registries[short])} if registries else {}),
        }
        if options.deployment == "run":
            for n in range(1, options.replicas + 1):
                specs[replica_name(f"{short}-run", n)] = Spec(["run", "--app", app], env)
            continue
        for daemon in daemons:
            copies = max(options.replicas, options.workers if daemon == "worker" else 1)
            for n in range(1, copies + 1):
                specs[replica_name(f"{short}-{daemon}", n)] = Spec([daemon, "--app", app], env)
    return specs


def _analysis(
    options: ChaosOptions,
    urls: dict[str, str],
    registries: dict[str, Path],
    log_dir: Path,
    say: Callable[[str], None],
) -> tuple[int | None, list[str]]:
    """``txbox analyze --fail-on-lost`` over the run when asked: its exit code, and notes."""
    if not options.analyze:
        return None, []
    if not _available("analyze"):
        return None, ["txbox analyze has not landed in this checkout: reconciliation skipped"]
    say("  txbox analyze --fail-on-lost …")
    return _analyze(urls, registries, log_dir), []


def _tell(report: Report, say: Callable[[str], None]) -> None:
    """The run's faults, checks, reconciliation and notes, a line each."""
    for event in report.events:
        say(f"  fault {event.fault}: {event.detail} ({event.ended - event.started:.1f}s)")
    for check in report.verdict.checks:
        say(
            f"  {'✔' if check.ok else '✘'} {check.name}"
            + ("" if check.ok or not check.detail else f" — {check.detail}")
        )
    for line in analyze_summary(report.log_dir) if report.analyze_exit is not None else []:
        say(f"  | {line}")
    for note in report.notes:
        say(f"  note: {note}")


def _with_queue_type(service: Service, queue_type: str) -> Any:
    return dataclasses.replace(service.settings, queue_type=queue_type)  # type: ignore[arg-type]


def _wait(predicate: Callable[[], Any], timeout: float, what: str, supervisor: Supervisor) -> None:
    deadline = time.monotonic() + timeout
    while not _safe(predicate):
        supervisor.raise_if_broken()
        if time.monotonic() > deadline:
            raise ChaosFailed(f"timed out after {timeout:.0f}s {what}")
        time.sleep(0.2)


def _safe(predicate: Callable[[], Any]) -> Any:
    try:
        return predicate()
    except Exception:
        return False


def _drive(
    options: ChaosOptions,
    schedule: list[Fault],
    feeders: list[Feeder],
    supervisor: Supervisor,
    pg: PrivatePostgres,
    rabbit: PrivateRabbit | PrivateRabbitCluster,
    inboxes: list[str],
    dsns: dict[str, str],
    poisoned: str,
    base_handled: int,
    expected: int,
    say: Callable[[str], None],
) -> tuple[list[Event], list[tuple[float, int]], uuid.UUID | None, float]:
    """Feed, fire the faults at their progress points, wait for the drain. The poison
    message goes through the first feeder, into the orders database ``dsns[poisoned]``."""
    pending = list(schedule)
    events: list[Event] = []
    samples: list[tuple[float, int]] = []
    poison_id: uuid.UUID | None = None
    for feeder in feeders:
        feeder.start()
    last_progress_at = time.monotonic()
    last_handled = -1
    last_fault_end = 0.0
    last_report = 0.0
    while True:
        now = time.monotonic()
        supervisor.raise_if_broken()
        failed = next((f.error for f in feeders if f.error is not None), None)
        if failed is not None:
            raise ChaosFailed(f"the feeder failed: {failed}") from failed
        sent = sum(f.sent for f in feeders)
        fed_at = None if any(f.finished_at is None for f in feeders) else max(f.finished_at or 0.0 for f in feeders)
        counts = [_count(d, HANDLED) for d in dsns.values()]
        if all(c is not None for c in counts):
            handled = sum(c or 0 for c in counts) - base_handled
            samples.append((now, handled))
            if handled != last_handled:
                last_handled, last_progress_at = handled, now
        progress = max(0, last_handled) / expected
        if now - last_report > 10:
            last_report = now
            say(f"    {progress:6.1%} handled, {sent:,} orders placed, {len(events)} faults so far")
        if pending and progress >= pending[0].at_progress and now - last_fault_end >= options.min_gap:
            fault = pending.pop(0)
            started = time.monotonic()
            detail, fault_poison = _inject(fault, supervisor, pg, rabbit, inboxes, feeders[0])
            poison_id = poison_id or fault_poison
            last_fault_end = time.monotonic()
            events.append(Event(fault, started, last_fault_end, detail))
            say(f"    fault {fault}: {detail}")
            continue
        if not pending and fed_at is not None:
            quiet_since = max(last_fault_end, fed_at)
            if now - quiet_since > options.drain_timeout:
                raise ChaosFailed(
                    f"the backlog did not drain within {options.drain_timeout:.0f}s after the last fault "
                    f"({progress:.1%} handled); logs in {supervisor.group.log_dir}"
                )
        if (
            not pending
            and fed_at is not None
            and last_handled >= expected
            and all(_count(d, PENDING) == 0 for d in dsns.values())
            and _poison_settled(dsns[poisoned], poison_id)
        ):
            return events, samples, poison_id, time.monotonic()
        if now - last_progress_at > options.stall_timeout:
            raise ChaosFailed(
                f"no message handled for {options.stall_timeout:.0f}s at {progress:.1%} "
                f"({len(pending)} faults not yet fired); {_where_they_sit(dsns, rabbit)}; "
                f"logs in {supervisor.group.log_dir}"
            )
        time.sleep(0.5)  # sampling period of the progress timeline


WHERE_ROWS = """
SELECT (SELECT count(*) FROM txbox.outbox WHERE processed_at IS NULL AND abandoned_at IS NULL),
       (SELECT count(*) FROM txbox.outbox WHERE abandoned_at IS NOT NULL),
       (SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL),
       (SELECT count(*) FROM txbox.inbox WHERE abandoned_at IS NOT NULL),
       (SELECT count(*) FROM txbox.dead_letters)
"""


def _where_they_sit(dsns: dict[str, str], rabbit: PrivateRabbit | PrivateRabbitCluster) -> str:
    """Where unhandled messages are when a run stalls: tables per service, then queues."""
    parts = []
    published: dict[uuid.UUID, tuple[str, Any]] = {}
    received: set[uuid.UUID] = set()
    for short, dsn in dsns.items():
        try:
            with psycopg.connect(dsn, connect_timeout=5) as conn:
                row = conn.execute(WHERE_ROWS).fetchone()
                published.update(
                    (r[0], (r[1], r[2]))
                    for r in conn.execute(
                        "SELECT id, message_type, processed_at FROM txbox.outbox WHERE processed_at IS NOT NULL"
                    )
                )
                received.update(r[0] for r in conn.execute("SELECT id FROM txbox.inbox"))
        except psycopg.Error as exc:
            parts.append(f"{short}: database unreadable ({type(exc).__name__})")
            continue
        assert row is not None
        parts.append(
            f"{short}: outbox {row[0]} unpublished/{row[1]} abandoned, "
            f"inbox {row[2]} unhandled/{row[3]} abandoned, {row[4]} dead letters"
        )
    missing: dict[str, list[Any]] = collections.defaultdict(list)
    for mid, (kind, at) in published.items():
        if mid not in received:
            missing[kind].append(at)
    if missing:
        # Events nobody subscribes to are among them by design (e.g. OrderCompleted).
        parts.append(
            "published but in no inbox: "
            + ", ".join(
                f"{kind} {len(ats)} ({min(ats):%H:%M:%S.%f} … {max(ats):%H:%M:%S.%f})"
                for kind, ats in sorted(missing.items())
            )
        )
    try:
        queues = rabbit.api("GET", "/queues") or []
        busy = [
            f"{q['name']} {q.get('messages_ready', 0)}+{q.get('messages_unacknowledged', 0)}"
            for q in queues
            if q.get("messages_ready") or q.get("messages_unacknowledged")
        ]
        parts.append("queues (ready+unacked): " + (", ".join(busy) or "empty"))
    except Exception as exc:  # a diagnosis must not hide the stall itself
        parts.append(f"queues unreadable ({exc})")
    return "; ".join(parts)


def _poison_settled(dsn: str, poison_id: uuid.UUID | None) -> bool:
    if poison_id is None:
        return True
    return _count(dsn, f"SELECT count(*) FROM txbox.inbox WHERE id = '{poison_id}' AND abandoned_at IS NOT NULL") == 1


def _inject(
    fault: Fault,
    supervisor: Supervisor,
    pg: PrivatePostgres,
    rabbit: PrivateRabbit | PrivateRabbitCluster,
    inboxes: list[str],
    feeder: Feeder,
) -> tuple[str, uuid.UUID | None]:
    """Make ``fault`` happen: what was done, and the poison message's id for that fault."""
    if fault.kind in _BROKER_FAULTS:
        return _inject_broker(fault, rabbit, inboxes), None
    if fault.kind is Kind.KILL:
        supervisor.kill(fault.target, fault.down_seconds)
        return f"kill -9, restart after {fault.down_seconds:.1f}s", None
    if fault.kind is Kind.POSTGRES_RESTART:
        pg.restart(mode="immediate")
        return "PostgreSQL immediate shutdown (crash) and WAL recovery", None
    if fault.kind is Kind.PG_TERMINATE:
        return f"pg_terminate_backend on {pg.terminate_backends()} connections", None
    if fault.kind is Kind.POISON:
        rows = feeder.build(0, 1, customer=apps.POISON_CUSTOMER)
        feeder.write(rows)
        return f"poison PlaceOrder {rows[0]['id']} written", uuid.UUID(str(rows[0]["id"]))
    raise AssertionError(fault.kind)


_BROKER_FAULTS = (Kind.RABBITMQ_RESTART, Kind.RABBITMQ_NODE_KILL, Kind.RABBITMQ_NODE_LOST, Kind.AMQP_CLOSE)


def _inject_broker(fault: Fault, rabbit: PrivateRabbit | PrivateRabbitCluster, inboxes: list[str]) -> str:
    """A fault of the broker (:data:`_BROKER_FAULTS`): what was done."""
    if fault.kind is Kind.AMQP_CLOSE:
        return f"management API closed {rabbit.close_connections()} connections"
    if fault.kind is Kind.RABBITMQ_RESTART:
        return _restart_rabbit(rabbit)
    if not isinstance(rabbit, PrivateRabbitCluster):
        raise ChaosFailed(f"the {fault.kind.value} fault needs a RabbitMQ cluster (--rabbit-nodes 3)")
    if fault.kind is Kind.RABBITMQ_NODE_LOST:
        node = rabbit.lose_leader(inboxes)
        return f"kill -9 of {node.node} (leading the inbox queues), never started again"
    node = rabbit.kill_leader(inboxes)
    # The daemons fail over to the other nodes meanwhile: the load goes on.
    time.sleep(fault.down_seconds)
    rabbit.bring_back(node)
    return f"kill -9 of {node.node} (leading the inbox queues), back after {fault.down_seconds:.1f}s"


def _restart_rabbit(rabbit: PrivateRabbit | PrivateRabbitCluster) -> str:
    rabbit.restart()
    if isinstance(rabbit, PrivateRabbitCluster):
        nodes, what = rabbit.nodes, "RabbitMQ nodes stopped and started one after the other"
    else:
        nodes, what = [rabbit], "RabbitMQ node stopped and started"
    failures = [failure for node in nodes for failure in node.boot_failures]
    for node in nodes:
        node.boot_failures.clear()
    if failures:  # PrivateRabbit.restart started a node a second time
        what += f"; a node died while booting and was started again: {failures[0]}"
    return what


def _resumed_after(dsns: dict[str, str], events: list[Event]) -> float | None:
    """Seconds from the loss of a node for good to the first inbox row stored after it, for
    the service that took longest (docs/explanation/operations.md, "A RabbitMQ cluster")."""
    lost = next((e for e in events if e.fault.kind is Kind.RABBITMQ_NODE_LOST), None)
    if lost is None:
        return None
    killed_at = time.time() - (time.monotonic() - lost.started)  # the wall clock PostgreSQL stamps by
    resumed = []
    for dsn in dsns.values():
        with psycopg.connect(dsn, connect_timeout=5) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM min(received_at))::float8 FROM txbox.inbox"
                " WHERE received_at > to_timestamp(%s)",
                (killed_at,),
            ).fetchone()
        if row and row[0] is not None:
            resumed.append(float(row[0]) - killed_at)
    return max(resumed) if resumed else None


def _write_timeline(path: Path, samples: list[tuple[float, int]], events: list[Event]) -> None:
    """The handled count every half second and each fault's window, in seconds from the
    first sample: where a run lost its rate (kept with the logs)."""
    t0 = samples[0][0] if samples else 0.0
    timeline = {
        "samples": [[round(t - t0, 2), handled] for t, handled in samples],
        "faults": [
            {"fault": str(e.fault), "started": round(e.started - t0, 2), "ended": round(e.ended - t0, 2)}
            for e in events
        ],
    }
    path.write_text(json.dumps(timeline) + "\n")


def _rate_between_faults(
    samples: list[tuple[float, int]], events: list[Event], end: float, crashes: Sequence[float] = ()
) -> float:
    """Handled messages/s over the sampled intervals that touch no fault nor its recovery.

    A fault's recovery lasts at least :data:`SETTLE` seconds and until the handled count
    moves again (daemons restarting, reconnecting, leases of a killed daemon running
    out); a standstill that follows no fault counts against the rate. The poison
    message's fault is the crashes it causes, not its writing: each daemon ``crashes``
    (times it was seen dead without a planned kill) has the recovery a ``kill -9`` has.
    """
    windows = [(e.started, _recovered_at(samples, e.ended)) for e in events if e.fault.kind is not Kind.POISON]
    windows += [(t, _recovered_at(samples, t)) for t in crashes]
    if samples:  # stop where the last message was handled: idle waiting is not throughput
        top = samples[-1][1]
        end = min(end, next(t for t, h in samples if h >= top))
    seconds = 0.0
    handled = 0
    for (t0, h0), (t1, h1) in itertools.pairwise(samples):
        if t1 > end or h0 < 0:
            break
        if any(t0 < w_end and t1 > w_start for w_start, w_end in windows):
            continue
        seconds += t1 - t0
        handled += h1 - h0
    return handled / seconds if seconds > 0 else 0.0


def _recovered_at(samples: list[tuple[float, int]], fault_ended: float) -> float:
    """The end of a fault's recovery: SETTLE after it, or the first progress after that."""
    settled = fault_ended + SETTLE
    for (t0, h0), (_t1, h1) in itertools.pairwise(samples):
        if t0 >= settled and h1 > h0:
            return t0
    return settled


def _analyze(urls: dict[str, str], registries: dict[str, Path], log_dir: Path) -> int:
    """`txbox analyze --fail-on-lost` over both services (each tenant a source, with tenants)."""
    from txbox_tools.processes import txbox_command

    if registries:
        sources = ["--sources-file", str(tenants.analyze_config(log_dir, registries))]
    else:
        sources = [arg for short, url in urls.items() for arg in ("--source", f"{tenants.SERVICES[short]}={url}")]
    args = [*txbox_command(), "analyze", *sources, "--grace", "1s", "--fail-on-lost"]
    log_path = log_dir / "analyze.log"
    with log_path.open("ab") as log:
        return subprocess.run(args, stdout=log, stderr=subprocess.STDOUT, check=False, cwd=repository.root()).returncode


def analyze_summary(log_dir: Path) -> list[str]:
    """The reconciliation lines of `txbox analyze` (its report, without Spark's chatter)."""
    try:
        lines = (log_dir / "analyze.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    start = next((i for i, line in enumerate(lines) if line.startswith("txbox analyze run")), None)
    return [] if start is None else [line for line in lines[start:] if line.startswith(("txbox", "  "))][:20]


def report_json(report: Report) -> str:
    return json.dumps(report.figures())
