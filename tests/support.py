"""Helpers shared by the test suites: real services, per-test databases and vhosts."""

from __future__ import annotations

import base64
import json
import os
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg import sql

T = TypeVar("T")

PG_ADMIN_URL = os.environ.get("TXBOX_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")
AMQP_HOST = os.environ.get("TXBOX_TEST_AMQP_HOST", "127.0.0.1")
AMQP_PORT = int(os.environ.get("TXBOX_TEST_AMQP_PORT", "5672"))
MGMT_URL = os.environ.get("TXBOX_TEST_RABBITMQ_API", "http://127.0.0.1:15672/api")
MGMT_AUTH = ("guest", "guest")


def pause(seconds: float, stop: threading.Event | None = None) -> bool:
    """Let ``seconds`` pass as work does: a handler's own time, a load's pacing, a random
    moment of a fault schedule. Never a way to wait for something to happen: that is
    :func:`wait_until`'s, with its condition and deadline. Ends early once ``stop`` is set
    (returns True then)."""
    return (stop or threading.Event()).wait(seconds)


def wait_until(
    predicate: Callable[[], T], timeout: float = 30.0, interval: float = 0.05, message: str = "condition"
) -> T:
    """Poll ``predicate`` until it returns a truthy value; fail with ``message`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message} (last value: {value!r})")
        pause(interval)


def db_url(name: str, driver: str = "postgresql+psycopg") -> str:
    parts = urllib.parse.urlsplit(PG_ADMIN_URL)
    return urllib.parse.urlunsplit((driver, parts.netloc, f"/{name}", parts.query, ""))


def admin_execute(statement: sql.Composable | str) -> None:
    with psycopg.connect(PG_ADMIN_URL, autocommit=True) as conn:
        conn.execute(statement)  # type: ignore[arg-type]


def create_database(name: str, template: str | None = None) -> None:
    stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template:
        stmt = sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name), sql.Identifier(template))
    admin_execute(stmt)


def drop_database(name: str) -> None:
    admin_execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:10]}"


# --- RabbitMQ management API -------------------------------------------------------


def mgmt(method: str, path: str, body: Any = None) -> Any:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(f"{MGMT_URL}{path}", data=data, method=method)
    token = base64.b64encode(f"{MGMT_AUTH[0]}:{MGMT_AUTH[1]}".encode()).decode()
    req.add_header("Authorization", f"Basic {token}")
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            payload = resp.read()
            return json.loads(payload) if payload else None
    except urllib.error.HTTPError as exc:
        if exc.code == 404 and method in ("GET", "DELETE"):
            return None
        raise


def vhost_path(vhost: str) -> str:
    return urllib.parse.quote(vhost, safe="")


def create_vhost(vhost: str) -> None:
    mgmt("PUT", f"/vhosts/{vhost_path(vhost)}", {})
    mgmt("PUT", f"/permissions/{vhost_path(vhost)}/guest", {"configure": ".*", "write": ".*", "read": ".*"})


def delete_vhost(vhost: str) -> None:
    mgmt("DELETE", f"/vhosts/{vhost_path(vhost)}")


def amqp_url(vhost: str) -> str:
    return f"amqp://guest:guest@{AMQP_HOST}:{AMQP_PORT}/{vhost_path(vhost)}"


def queue_info(vhost: str, queue: str) -> Any:
    return mgmt("GET", f"/queues/{vhost_path(vhost)}/{urllib.parse.quote(queue, safe='')}")


def close_connections(vhost: str) -> int:
    """Force-close every client connection of ``vhost`` from the broker side."""
    closed = 0
    for conn in mgmt("GET", f"/vhosts/{vhost_path(vhost)}/connections") or []:
        mgmt("DELETE", f"/connections/{urllib.parse.quote(conn['name'], safe='')}")
        closed += 1
    return closed
