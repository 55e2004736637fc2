"""`counter-service`: the test service of the exactly-once and crash tests.

Every ``Count`` command adds one to the row of its message id in ``counters``, in the
worker's transaction: a message applied twice shows as 2, a lost one as a missing row.
A payload with ``"crash": true`` ends the process inside the handler (``os._exit``), the
way a segfault or the OOM killer would: the poison case (docs/explanation/guarantees.md,
"Guarantees and how they are kept"). ``"sleep": s`` blocks the handler in C for ``s``
seconds (a timeout that cannot interrupt it). ``async_service`` is the same service with
the handler written as ``async def handle`` (docs/explanation/handle.md, "Async handlers").

Run: ``txbox worker --app tests.apps.counter:service`` (or ``:async_service``) with ``TXBOX_DATABASE_URL`` and
``TXBOX_AMQP_URL`` set (the contracts folder is this app's own).
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncSession
from sqlalchemy.orm import Session

from framework import CommandHandler, Message, Outbox, Service
from framework.envelope import Message as Envelope
from framework.settings import Settings

CONTRACTS = Path(__file__).resolve().parent / "contracts"
SERVICE = "counter-service"
ROUTING_KEY = "counter-service.counter.count"
CRASH_EXIT_CODE = 3

TABLE = "CREATE TABLE IF NOT EXISTS counters (id uuid PRIMARY KEY, n integer NOT NULL, handled_at timestamptz)"
UPSERT = (
    "INSERT INTO counters (id, n, handled_at) VALUES (:id, 1, clock_timestamp()) "
    "ON CONFLICT (id) DO UPDATE SET n = counters.n + 1"
)


class Count(CommandHandler):
    message_type = "Count"

    def handle(self, message: Message, session: Session, outbox: Outbox) -> None:
        if message.payload.get("crash"):
            os._exit(CRASH_EXIT_CODE)
        if message.payload.get("sleep"):
            # Blocked in C (a lock's timed wait): no Python-level interruption reaches it.
            threading.Event().wait(message.payload["sleep"])
        session.execute(text(UPSERT), {"id": message.message_id})


class AsyncCount(CommandHandler):
    """:class:`Count` as an async handler, on an ``AsyncSession``."""

    message_type = "Count"

    async def handle(self, message: Message, session: AsyncSession, outbox: Outbox) -> None:  # type: ignore[override]
        if message.payload.get("crash"):
            os._exit(CRASH_EXIT_CODE)
        await session.execute(text(UPSERT), {"id": message.message_id})


def build(environ: dict[str, str] | None = None, *, asynchronous: bool = False) -> Service:
    settings = Settings.from_env(environ, service=SERVICE, contracts_dir=CONTRACTS)
    app = Service(settings=settings)
    app.register(AsyncCount() if asynchronous else Count())
    return app


def envelope(n: int, *, crash: bool = False, sleep: float = 0, aggregate_id: str | None = None) -> bytes:
    """A Count envelope as a sender would publish it."""
    payload: dict[str, Any] = {"n": n}
    if crash:
        payload["crash"] = True
    if sleep:
        payload["sleep"] = sleep
    message = Envelope(
        message_id=uuid.uuid4(),
        message_type="Count",
        aggregate_type="counter",
        aggregate_id=aggregate_id if aggregate_id is not None else str(n),
        payload=payload,
    )
    return json.dumps(message.to_dict()).encode()


# Built from TXBOX_* when imported by `txbox ... --app tests.apps.counter:service`; other
# importers (tests) call build() with their own environment.
service = build() if os.environ.get("TXBOX_DATABASE_URL") else None
async_service = build(asynchronous=True) if os.environ.get("TXBOX_DATABASE_URL") else None


# A killed worker's claims come back after the lease: the tests that kill daemons keep it short.
SHORT_LEASE = {"TXBOX_WORKER_LEASE": "4s", "TXBOX_WORKER_TIMEOUT": "2s", "TXBOX_WORKER_POLL_INTERVAL": "0.5s"}


def daemon_env(database_url: str, amqp_url: str, **settings: str) -> dict[str, str]:
    """The environment of this app's daemons (``settings``: more ``TXBOX_*`` values), with
    its business table created and its topology declared."""
    from framework import topology
    from tests.apps.helpers import query

    query(database_url, TABLE)
    values = {
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
        **settings,
    }
    app = build(values)
    topology.declare(app.settings, app.registry)
    return values
