"""Helpers of the publisher tests: fill the outbox fast, run relays, read what the broker got."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest

from framework import names
from framework.contracts import Registry
from framework.db import conninfo
from framework.outbox import Outbox
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.settings import Settings
from framework.sql import outbox as outbox_sql
from tests.conftest import ROOT


def insert_rows(settings: Settings, registry: Registry, rows: list[dict[str, Any]]) -> list[str]:
    """Insert outbox rows (kwargs of Outbox.build + ``message_type``) in one transaction, in order."""
    outbox = Outbox(None, registry)  # type: ignore[arg-type]
    params = []
    for spec_kwargs in rows:
        kwargs = dict(spec_kwargs)
        spec = registry.get(kwargs.pop("message_type"))
        params.append(outbox.build(spec, **kwargs).params())
    ids = [str(p["id"]) for p in params]
    with psycopg.connect(conninfo(settings.database_url)) as conn, conn.cursor() as cur:
        # One statement per row, in order: created_at is the order that matters.
        cur.executemany(outbox_sql.insert(settings.schema), params)
    return ids


def orders(n_segments: int, per_segment: int, **extra: Any) -> list[dict[str, Any]]:
    """PlaceOrder rows: segment s, sequence q (in ``quantity``, 1-based), created in order per segment."""
    rows = []
    for q in range(1, per_segment + 1):
        for s in range(n_segments):
            rows.append(
                {
                    "message_type": "PlaceOrder",
                    "aggregate_id": f"o-{s}",
                    "payload": {"customer": f"c-{s}", "sku": "SKU-1", "quantity": q},
                    **extra,
                }
            )
    return rows


def outbox_state(settings: Settings) -> dict[str, int]:
    with psycopg.connect(conninfo(settings.database_url)) as conn:
        row = conn.execute(
            """SELECT count(*), count(processed_at), count(abandoned_at),
                      count(*) FILTER (WHERE processed_at IS NULL AND abandoned_at IS NULL AND locked_until > now())
               FROM txbox.outbox"""
        ).fetchone()
    assert row is not None
    return {"total": row[0], "processed": row[1], "abandoned": row[2], "leased": row[3]}


@dataclass
class Delivered:
    body: dict[str, Any]
    properties: pika.BasicProperties
    routing_key: str
    exchange: str


def drain_queue(amqp_url: str, queue: str, *, idle: float = 2.0) -> list[Delivered]:
    """Every message in ``queue`` (acked), stopping after ``idle`` seconds without one."""
    out: list[Delivered] = []
    conn = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        ch = conn.channel()
        ch.basic_qos(prefetch_count=1000)
        for method, props, body in ch.consume(queue, inactivity_timeout=idle):
            if method is None:
                break
            out.append(Delivered(json.loads(body), props, method.routing_key, method.exchange))
            ch.basic_ack(method.delivery_tag)
        ch.cancel()
    finally:
        conn.close()
    return out


@contextmanager
def running_relay(service: Service, config: RelayConfig | None = None) -> Iterator[Relay]:
    """A Relay in a thread of this process, stopped (and joined) on exit."""
    relay = Relay(service, config or RelayConfig(poll_interval=0.2))  # type: ignore[arg-type]
    thread = threading.Thread(target=relay.run, name="test relay", daemon=True)
    thread.start()
    try:
        yield relay
    finally:
        relay.stop()
        thread.join(30)
        assert not thread.is_alive(), "the relay did not stop"


def publisher_env(settings: Settings, **extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        TXBOX_SERVICE=settings.service,
        TXBOX_DATABASE_URL=settings.database_url,
        TXBOX_AMQP_URL=settings.amqp_url,
        TXBOX_CONTRACTS_DIR=str(settings.contracts_dir),
        TXBOX_QUEUE_TYPE=settings.queue_type,
        PYTHONUNBUFFERED="1",
    )
    env.update(extra)
    return env


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Start `txbox publisher` processes; every one still running is killed at the end."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(settings: Settings, *args: str, **env: str) -> subprocess.Popen[bytes]:
        log = open(tmp_path / f"publisher-{len(procs)}.log", "wb")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [str(Path(sys.executable).parent / "txbox"), "publisher", *args],
            env=publisher_env(settings, **env),
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        )
        procs.append(proc)
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def inbox_queue(settings: Settings) -> str:
    return names.inbox_queue(settings.service)
