"""The order service's HTTP API (examples/orders/api.py) on a real uvicorn, over HTTP."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, select

from examples.orders.models import Order
from framework import tables
from tests.conftest import ROOT

ALEMBIC = ROOT / "examples" / "orders" / "alembic.ini"
ORDER = {"customer": "ada", "sku": "BOOK-1", "quantity": 2}


@pytest.fixture
def database_url(txbox_database: Callable[..., str]) -> str:
    return txbox_database(ALEMBIC)


@pytest.fixture
def api(database_url: str, tmp_path: Path) -> Iterator[str]:
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = (tmp_path / "uvicorn.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "uvicorn", "examples.orders.api:app", "--port", str(port)],
        cwd=ROOT,
        env={**os.environ, "TXBOX_DATABASE_URL": database_url, "TXBOX_API_POOL_SIZE": "2"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while call(url, "GET", "/orders/-", retry_refused=True)[0] != 404:  # polls readiness
            assert server.poll() is None, (tmp_path / "uvicorn.log").read_text()
            assert time.monotonic() < deadline, "uvicorn did not answer within 60 s"
        yield url
    finally:
        server.terminate()
        server.wait(20)
        log.close()


def call(url: str, method: str, path: str, body: Any = None, *, retry_refused: bool = False) -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except urllib.error.URLError:
        if retry_refused:
            return 0, None
        raise


def rows(database_url: str) -> tuple[list[Any], list[Any]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as conn:
            orders = conn.execute(select(Order.__table__)).mappings().all()
            outbox = conn.execute(select(tables.outbox)).mappings().all()
    finally:
        engine.dispose()
    return list(orders), list(outbox)


def test_post_stores_the_order_and_sends_place_order_in_one_transaction(api: str, database_url: str) -> None:
    status, placed = call(api, "POST", "/orders", {"id": "o-1", **ORDER})
    assert status == 201 and placed["id"] == "o-1" and placed["status"] == "placed"

    status, shown = call(api, "GET", "/orders/o-1")
    assert status == 200
    assert (shown["status"], shown["customer"], shown["sku"], shown["quantity"]) == ("placed", "ada", "BOOK-1", 2)

    [order], [message] = rows(database_url)
    assert (message["message_type"], message["aggregate_id"], message["payload"]) == ("PlaceOrder", "o-1", ORDER)
    assert str(message["id"]) == placed["message_id"]
    assert order["correlation_id"] == message["message_context"]["correlation_id"] == placed["correlation_id"]


def test_refused_orders_leave_nothing_behind(api: str, database_url: str) -> None:
    assert call(api, "POST", "/orders", {"id": "o-1", **ORDER})[0] == 201
    # The id is taken: the order's INSERT finds it, the transaction (and its PlaceOrder) rolls back.
    status, answer = call(api, "POST", "/orders", {"id": "o-1", **ORDER})
    assert status == 409 and "exists" in answer["error"]
    # The contract refuses the payload before anything is stored.
    status, answer = call(api, "POST", "/orders", {"id": "o-2", **ORDER, "quantity": 0})
    assert status == 422
    assert call(api, "POST", "/orders", b"{not json")[0] == 400
    assert call(api, "POST", "/orders", b"[1, 2]")[0] == 400
    assert call(api, "POST", "/orders", b" " * 20_000)[0] == 413
    assert call(api, "GET", "/orders/o-2")[0] == 404

    orders, outbox = rows(database_url)
    assert [o["id"] for o in orders] == ["o-1"]
    assert [m["aggregate_id"] for m in outbox] == ["o-1"]


def test_orders_without_an_id_get_one(api: str, database_url: str) -> None:
    status, placed = call(api, "POST", "/orders", ORDER)
    assert status == 201
    assert call(api, "GET", f"/orders/{placed['id']}")[1]["status"] == "placed"
