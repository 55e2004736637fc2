"""`txbox bench worker`: inbox rows → a handler writing one business row → processed.

Scratch database of its own (created and dropped). The raw limit, measured in the same
run on the same rows: plain SQL with no framework — claim 500 pending rows ``FOR UPDATE
SKIP LOCKED``, ``executemany`` the same business rows, mark them processed, commit —
i.e. the database's own claim + write + update rate for this work on this machine now.

Statements per message: PostgreSQL here has no ``pg_stat_statements`` loaded (it needs
``shared_preload_libraries``), so the workers count what they send themselves
(framework/worker/counts.py: claims, batches with their BEGIN and COMMIT, the handlers'
own statements) and report ``statements_per_message``, ``claims`` and ``empty_claims``;
beside it ``transactions_per_message`` is the server's own count, the scratch
database's ``xact_commit + xact_rollback`` over the run (only the workers use it then).

``--async-handler`` then runs the same rows again through the same handler written as
``async def handle`` (its session an ``AsyncSession``; docs/explanation/handle.md, "Async
handlers") and reports its rate beside the sync one's, and their ratio.
"""

from __future__ import annotations

import argparse
import os
import time
import uuid
from typing import Any

import psycopg
from psycopg import sql
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from framework import CommandHandler, Message, Outbox, metrics, names
from framework.db import conninfo
from framework.errors import TxboxError
from framework.receiver import Delivery, Intake
from framework.service import Service
from framework.settings import Settings
from framework.sql.inbox import InboxRow, insert_rows
from framework.worker import Worker, WorkerConfig
from txbox_tools.bench import history, instances
from txbox_tools.bench.cpu import Saturation
from txbox_tools.bench.receiver import Scratch, add_scratch_options, envelopes
from txbox_tools.bench.result import Result

BUSINESS = "CREATE TABLE bench_orders (id uuid PRIMARY KEY, customer text NOT NULL, sku text NOT NULL, quantity int)"


class _Base(DeclarativeBase):
    pass


class BenchOrder(_Base):
    __tablename__ = "bench_orders"

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True)
    customer: Mapped[str]
    sku: Mapped[str]
    quantity: Mapped[int]


class StoreOrder(CommandHandler):
    """The trivial handler of the worker bar: one business row per message, added through the ORM."""

    message_type = "PlaceOrder"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        p = message.payload
        session.add(BenchOrder(id=message.message_id, customer=p["customer"], sku=p["sku"], quantity=p["quantity"]))


class AsyncStoreOrder(CommandHandler):
    """:class:`StoreOrder` as an async handler: what the event loop per run costs."""

    message_type = "PlaceOrder"

    async def handle(self, message: Message, session: AsyncSession, outbox: Outbox) -> None:  # type: ignore[override]
        p = message.payload
        session.add(BenchOrder(id=message.message_id, customer=p["customer"], sku=p["sku"], quantity=p["quantity"]))


def configure(parser: argparse.ArgumentParser) -> None:
    add_scratch_options(parser)
    parser.add_argument("--messages", type=int, default=50_000, help="inbox rows (default 50000)")
    parser.add_argument("--batch-size", type=int, default=500)
    parser.add_argument(
        "--instances", type=int, default=2, help="worker processes sharing the inbox (default 2, one per core)"
    )
    history.add_option(parser)
    parser.add_argument(
        "--async-handler",
        action="store_true",
        help="also run the rows through an async def handler and report its rate against the sync one's",
    )


def worker_instance(settings: Settings, batch_size: int, async_handler: bool = False) -> tuple[Worker, Any]:
    """One bench worker (built in its own process by :func:`instances.timed`)."""
    service = Service(settings=settings)
    service.register(AsyncStoreOrder() if async_handler else StoreOrder())
    worker = Worker(service, WorkerConfig(batch_size=batch_size))
    return worker, metrics.WORKER_PROCESSED.labels(message_type="PlaceOrder", **metrics.labels(service.name))


def fill_inbox(service: Service, count: int) -> None:
    intake = Intake(service.registry, service.name, max_body_bytes=1 << 20)
    bodies = envelopes(count)
    with psycopg.connect(conninfo(service.settings.database_url)) as conn, conn.cursor() as cur:
        for start in range(0, count, 5000):
            rows = []
            for i, body in enumerate(bodies[start : start + 5000]):
                row = intake.admit(Delivery(delivery_tag=i + 1, body=body))
                assert isinstance(row, InboxRow)
                rows.append(row)
            insert_rows(cur, service.settings.schema, rows)
        conn.commit()


def raw_claim_write_update(database_url: str, count: int, batch: int = 500, cpu: Saturation | None = None) -> float:
    """Plain SQL, no framework: messages/s (see the module docstring); ``cpu`` measures it."""
    inbox = sql.Identifier("txbox", names.INBOX)
    claim = sql.SQL(
        "SELECT id, payload FROM {} WHERE processed_at IS NULL AND abandoned_at IS NULL "
        "ORDER BY priority DESC, created_at LIMIT %s FOR UPDATE SKIP LOCKED"
    ).format(inbox)
    mark = sql.SQL(
        "UPDATE {} SET processed_at = clock_timestamp(), finished_attempts = finished_attempts + 1 "
        "WHERE id = ANY(%s::uuid[])"
    ).format(inbox)
    write = "INSERT INTO bench_orders (id, customer, sku, quantity) VALUES (%s, %s, %s, %s)"
    done = 0
    started = time.perf_counter()
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        if cpu is not None:
            cpu.start([os.getpid()])
        while done < count:
            cur.execute(claim, (batch,))
            rows = cur.fetchall()
            if not rows:
                break
            cur.executemany(write, [(i, p["customer"], p["sku"], p["quantity"]) for i, p in rows])
            cur.execute(mark, ([i for i, _ in rows],))
            conn.commit()
            done += len(rows)
        seconds = time.perf_counter() - started
        if cpu is not None:
            cpu.stop()  # its backend still connected
    if done != count:
        raise TxboxError(f"raw pass processed {done} of {count} rows")
    return count / seconds


def run(args: argparse.Namespace) -> Result:
    with Scratch(args, "worker") as scratch:
        scratch.execute(BUSINESS)
        service = Service(settings=scratch.settings)
        service.register(StoreOrder())

        fill_inbox(service, args.messages)
        raw_cpu = Saturation(scratch.database_url)
        raw_rate = raw_claim_write_update(scratch.database_url, args.messages, cpu=raw_cpu)
        scratch.execute("TRUNCATE txbox.inbox, bench_orders")
        fill_inbox(service, args.messages)
        scratch.execute("VACUUM ANALYZE txbox.inbox")

        service.engine.dispose()
        used = Saturation(scratch.database_url)
        counts: dict[str, int] = {}
        transactions = _transactions(scratch.database_url)
        seconds = instances.timed(
            worker_instance,
            (scratch.settings, args.batch_size),
            instances=args.instances,
            target=args.messages,
            cpu=used,
            daemon_counts=counts,
        )
        transactions = _transactions(scratch.database_url) - transactions

        _check(scratch, args.messages)
        extra: dict[str, Any] = {}
        if args.history:
            # The same run again over N finished rows (txbox_tools.bench.history).
            templates = history.sample(scratch.database_url, names.INBOX)  # the rows just processed
            scratch.execute("TRUNCATE txbox.inbox, bench_orders")
            filled = history.prefill(scratch.database_url, names.INBOX, args.history, templates)
            fill_inbox(service, args.messages)
            scratch.execute("VACUUM ANALYZE txbox.inbox")  # as before the run on the empty table
            service.engine.dispose()
            history_seconds = instances.timed(
                worker_instance, (scratch.settings, args.batch_size), instances=args.instances, target=args.messages
            )
            _check(scratch, args.messages)
            extra["history"] = history.summary(
                args.history, args.messages / seconds, args.messages / history_seconds, [filled]
            )
        if args.async_handler:
            scratch.execute("TRUNCATE txbox.inbox, bench_orders")
            fill_inbox(service, args.messages)
            scratch.execute("VACUUM ANALYZE txbox.inbox")
            service.engine.dispose()
            async_seconds = instances.timed(
                worker_instance,
                (scratch.settings, args.batch_size, True),
                instances=args.instances,
                target=args.messages,
            )
            _check(scratch, args.messages)
            sync_rate, async_rate = args.messages / seconds, args.messages / async_seconds
            extra |= {
                "async_handler_rate": round(async_rate, 1),
                "async_to_sync_ratio": round(async_rate / sync_rate, 3),
            }
        return Result(
            stage="worker",
            messages=args.messages,
            seconds=seconds,
            raw_limit_rate=raw_rate,
            raw_limit="plain SQL: claim 500 FOR UPDATE SKIP LOCKED + executemany the business rows + "
            "UPDATE processed + commit, no framework",
            extra={
                "batch_size": args.batch_size,
                "instances": args.instances,
                "handler": "session.add() of one ORM business row",
                **used.per_message(args.messages),
                **statements_per_message(counts, args.messages),
                "transactions_per_message": round(transactions / args.messages, 4),
                **raw_cpu.per_message(args.messages, prefix="raw_"),
                **extra,
            },
        )


def statements_per_message(counts: dict[str, int], messages: int) -> dict[str, Any]:
    """The workers' own counts (framework/worker/counts.py) as the bench's JSON reports them."""
    if not counts:
        return {}
    return {
        "statements_per_message": round(counts.get("statements", 0) / max(messages, 1), 4),
        "claims": counts.get("claims", 0),
        "empty_claims": counts.get("empty_claims", 0),
    }


def _transactions(database_url: str) -> int:
    """Transactions the server counted in this database so far (its statistics, as of now)."""
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
    return int(row[0]) if row else 0


def _check(scratch: Scratch, messages: int) -> None:
    check: Any = scratch.execute(
        "SELECT (SELECT count(*) FROM bench_orders), (SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL "
        f"AND created_at > now() - interval '{history.AGE}')"  # the history's rows are older
    )[0]
    if tuple(check) != (messages, messages):
        raise TxboxError(f"bench check failed: business rows, processed rows = {tuple(check)}")
