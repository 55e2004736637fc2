"""`txbox collector` as users run it: drains the dead-letter queue, stops cleanly on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pika
import psycopg

from framework import amqp, names, topology
from framework.db import conninfo
from framework.service import Service
from tests import support
from tests.conftest import CONTRACTS, ROOT

TXBOX = Path(sys.executable).parent / "txbox"


def test_collector_process_drains_and_stops_on_sigterm(service: Service, database_url: str, amqp_url: str) -> None:
    env = {
        **os.environ,
        "TXBOX_SERVICE": "order-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_CONTRACTS_DIR": str(CONTRACTS),
    }
    proc = subprocess.Popen([str(TXBOX), "collector"], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    try:
        connection = amqp.connect(amqp_url)
        channel = connection.channel()
        topology.declare(service.settings, service.registry, channel)
        channel.confirm_delivery()
        for i in range(20):  # straight to the dead_letter exchange, as the receiver's final give-up does
            channel.basic_publish(
                names.DEAD_LETTER_EXCHANGE,
                names.dead_letter_routing_key("order-service"),
                f"not json {i}".encode(),
                pika.BasicProperties(headers={names.HEADER_DEAD_REASON: "retries_exhausted"}),
            )
        # One no decoder, parser or column takes as it is: the process stores it and goes on.
        nested: dict[str, object] = {}
        inner = nested
        for _ in range(10_000):
            inner["t"] = {}
            inner = inner["t"]  # type: ignore[assignment]
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(50_000)  # pika encodes recursively: only the publisher needs it
        try:
            channel.basic_publish(
                names.DEAD_LETTER_EXCHANGE,
                names.dead_letter_routing_key("order-service"),
                b'{"payload": "\\u0000", "d": ' + b"[" * 900 + b"]" * 900 + b"}" + b"x" * (1 << 20),
                pika.BasicProperties(type="T\x00", headers={"x-death": "forged", "deep": nested}),
            )
        finally:
            sys.setrecursionlimit(limit)
        connection.close()

        def stored() -> int:
            with psycopg.connect(conninfo(database_url)) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM txbox.dead_letters WHERE reason = 'retries_exhausted'"
                ).fetchone()
                return row[0] if row else 0

        support.wait_until(lambda: stored() == 20, timeout=60, message="20 dead letters stored")

        def hostile() -> int:
            with psycopg.connect(conninfo(database_url)) as conn:
                row = conn.execute(
                    "SELECT count(*) FROM txbox.dead_letters WHERE reason = 'broker_unknown'"
                    " AND length(raw_body) <= 65536 AND (headers->'x-txbox-body'->>'truncated')::boolean"
                ).fetchone()
                return row[0] if row else 0

        support.wait_until(lambda: hostile() == 1, timeout=60, message="the hostile delivery stored, bounded")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            _, err = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert proc.returncode == 0, err
    assert "collecting: from order-service:dead_letter" in err and "stopped: 21 dead letters collected" in err
