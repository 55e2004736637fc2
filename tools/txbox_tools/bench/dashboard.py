"""`txbox bench dashboard`: page times of the dashboard over 100,000 dead letters.

Creates a scratch database (dropped afterwards unless ``--keep``), migrates it, COPYs
``--letters`` dead letters spread over 7 days and ~40 failure groups, starts the
dashboard in-process and times each page ``--repeat`` times over HTTP. The raw limit is
the dashboard's trivial ``/healthz`` round trip measured in the same run, so the ratio
says how much of a page's time is our SQL and rendering. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
import urllib.request
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
from psycopg import sql

from framework import dead_letters, migrate, names
from framework.db import conninfo
from txbox_tools import repository
from txbox_tools.bench.result import Result

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TYPES = ("PlaceOrder", "RestockItem", "StockReserved", "StockRejected", "OrderPlaced")


def _unique(r: random.Random) -> str:
    return 'duplicate key value violates unique constraint "orders_pkey"\n' + (
        f"DETAIL:  Key (id)=({r.randint(1, 10**9)}) already exists."
    )


def _schema(r: random.Random) -> str:
    return f"payload.quantity: {r.randint(1001, 5000)} is greater than the maximum of 1000"


def _customer(r: random.Random) -> str:
    return f"'customer-{r.randint(1, 99999)}'"


def _timeout(r: random.Random) -> str:
    return f"handler exceeded {r.randint(5, 60)}s"


def _cancelled(r: random.Random) -> str:
    return f"order {uuid.uuid4()} is cancelled"


def _unroutable(r: random.Random) -> str:
    return "no queue is bound for the routing key"


def _database(r: random.Random) -> str:
    return f"database unavailable for {r.randint(100, 900)}s"


BUGS: tuple[tuple[str, str, str, Callable[[random.Random], str]], ...] = (
    ("KeyError", "max_attempts", "inbox", _customer),
    ("psycopg.errors.UniqueViolation", "max_attempts", "inbox", _unique),
    ("TimeoutError", "poison", "inbox", _timeout),
    ("PermanentError", "permanent_error", "inbox", _cancelled),
    ("schema_invalid", "schema_invalid", "broker", _schema),
    ("unroutable", "unroutable", "outbox", _unroutable),
    ("broker_expired", "retries_exhausted", "broker", _database),
)


def seed(database_url: str, letters: int, schema: str = "txbox", seed_value: int = 1) -> None:
    """COPY ``letters`` realistic dead letters (fingerprints computed as the writers do)."""
    rng = random.Random(seed_value)
    now = datetime.now(UTC)
    columns = ["message_id", "source", "reason", "error", "fingerprint", "message_type", "routing_key", "message",
               "headers", "attempts", "died_at", "replayed_at", "replay_count", "discarded_at"]  # fmt: skip
    with psycopg.connect(conninfo(database_url)) as conn, conn.cursor() as cur:
        copy = sql.SQL("COPY {} ({}) FROM STDIN").format(
            sql.Identifier(schema, names.DEAD_LETTERS), sql.SQL(", ").join(map(sql.Identifier, columns))
        )
        with cur.copy(copy) as out:
            for i in range(letters):
                error_type, reason, source, make = BUGS[i % len(BUGS)]
                message_type = TYPES[(i // len(BUGS)) % len(TYPES)] if i % 3 else TYPES[0]
                error = f"{error_type}: {make(rng)}"
                mid = uuid.uuid4()
                died = now - timedelta(seconds=rng.random() * 7 * 86400)
                state = rng.random()
                envelope = {
                    "payload": {"customer": f"c-{i}", "sku": f"SKU-{i % 500}", "quantity": rng.randint(1, 9)},
                    "message_context": {"example_correlation_id": str(uuid.uuid4())},
                    "message_id": str(mid),
                    "timestamp": died.isoformat(),
                    "message_type": message_type,
                    "aggregate_id": str(i),
                    "aggregate_type": "order",
                    "message_version": "1.0",
                    "auth_token": "eyJhbGciOiJIUzI1NiJ9.bench.token",
                }
                fp = dead_letters.fingerprint(message_type, error_type, error)
                replayed = died + timedelta(minutes=5) if state < 0.1 else None
                discarded = died + timedelta(hours=1) if 0.1 <= state < 0.15 else None
                attempts = json.dumps({"started": 5, "finished": 5})
                route = "order-service.order.place"
                out.write_row(
                    (mid, source, reason, error, fp, message_type, route, json.dumps(envelope), "{}", attempts,
                     died, replayed, 1 if replayed else 0, discarded)
                )  # fmt: skip
        conn.commit()
    # What autovacuum does to a table this size within a minute: statistics and the
    # visibility map (index-only scans).
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(sql.Identifier(schema, names.DEAD_LETTERS)))


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--letters", type=int, default=100_000, help="dead letters to seed (default 100000)")
    parser.add_argument("--repeat", type=int, default=10, help="requests per page")
    parser.add_argument("--admin-url", default=ADMIN_URL, help="PostgreSQL URL allowed to CREATE DATABASE")
    parser.add_argument("--keep", action="store_true", help="keep the scratch database (prints its name)")


def _get(url: str) -> float:
    start = time.perf_counter()
    with urllib.request.urlopen(url, timeout=30) as response:
        response.read()
        if response.status != 200:
            raise RuntimeError(f"{url}: HTTP {response.status}")
    return time.perf_counter() - start


def run(args: argparse.Namespace) -> Result:
    from framework.dashboard.app import Source, create_app
    from framework.dashboard.server import serving

    name = f"txbox_bench_dash_{uuid.uuid4().hex[:8]}"
    admin = conninfo(args.admin_url.replace("postgresql://", "postgresql+psycopg://", 1))
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    url = args.admin_url.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1) + f"/{name}"
    try:
        migrate.upgrade(url)
        started = time.perf_counter()
        seed(url, args.letters)
        seeded = time.perf_counter() - started
        with psycopg.connect(conninfo(url)) as conn:
            row = conn.execute(
                "SELECT fingerprint, max(id) FROM txbox.dead_letters GROUP BY 1 ORDER BY count(*) DESC LIMIT 1"
            ).fetchone()
        assert row is not None
        fingerprint, letter_id = row
        source = Source("order-service", url, schema="txbox", contracts_dir=repository.contracts())
        pages = {
            "overview 1h": "/?window=1h",
            "overview 7d": "/?window=7d",
            "groups": "/groups",
            "list page 1": "/letters",
            "list page 500": "/letters?page=500&status=all",
            "list filtered": "/letters?message_type=RestockItem&reason=max_attempts&since=3d",
            "list fingerprint": f"/letters?fingerprint={fingerprint}",
            "detail": f"/letters/order-service/{letter_id}",
            "api letters": "/api/letters?status=all",
        }
        timings: dict[str, list[float]] = {}
        with serving(create_app([source])) as base:
            for _ in range(3):
                _get(base + "/healthz")
            raw = [_get(base + "/healthz") for _ in range(args.repeat * 3)]
            for label, path in pages.items():
                _get(base + path)  # warm the pool and the planner
                timings[label] = [_get(base + path) for _ in range(args.repeat)]
        total = sum(sum(t) for t in timings.values())
        requests = sum(len(t) for t in timings.values())
        extra: dict[str, Any] = {
            "letters": args.letters,
            "seed_seconds": round(seeded, 1),
            "healthz_ms_median": round(statistics.median(raw) * 1000, 1),
        }
        for label, t in timings.items():
            extra[f"{label} ms median/max"] = f"{statistics.median(t) * 1000:.0f} / {max(t) * 1000:.0f}"
        extra["slowest page median ms"] = round(max(statistics.median(t) for t in timings.values()) * 1000, 1)
        return Result(
            stage="dashboard",
            messages=requests,
            seconds=total,
            raw_limit_rate=len(raw) / sum(raw),
            raw_limit="GET /healthz round trips/s on the same server",
            extra=extra,
        )
    finally:
        if args.keep:
            print(f"kept database {name}")
        else:
            with psycopg.connect(admin, autocommit=True) as conn:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
