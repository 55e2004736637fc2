"""The demo: the order/inventory saga end to end on this machine, with a summary.

What it does, in order (``txbox demo --help`` for the knobs):

1. creates fresh databases ``txbox_demo_orders`` / ``txbox_demo_inventory`` and a fresh
   RabbitMQ vhost ``txbox-demo``, migrates both databases (framework + business
   histories) and declares the topology of both services;
2. starts the daemons of both services as processes through the ``txbox`` command, and
   the order service's HTTP API (``examples/orders/api.py``) on uvicorn;
3. restocks the inventory with RestockItem commands and waits until they are handled;
4. places the orders with ``POST /orders`` (the API stores each order and sends its
   PlaceOrder in one transaction), a few concurrent keep-alive clients, with at most
   ``--window`` orders in flight, showing a live progress bar until every order is
   completed or cancelled;
5. prints a summary (throughput, end-to-end latency, outcomes, exactly-once checks),
   optionally runs ``txbox analyze`` and names the dashboard command;
6. stops every process it started, also on Ctrl-C.

Latency is measured in the order database alone: from the ``created_at`` of the
PlaceOrder outbox row (the business commit that asked for the order) to the commit of
the handler that completed or cancelled it (``orders.finished_at``).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import importlib.util
import json
import logging
import random
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import psycopg
from psycopg import sql
from sqlalchemy.orm import Session

from examples import _defaults, migrate
from framework import Service
from framework.errors import ConfigurationError, TxboxError
from txbox_tools.processes import ProcessGroup, raise_if_terminated, txbox_command, unwind_on_sigterm

ORDERS_APP = "examples.orders.app:service"
INVENTORY_APP = "examples.inventory.app:service"
DAEMONS = ("publisher", "receiver", "worker")
DASHBOARD_PORT = 8470
#: The clone this example lives in (the daemons' cwd, so ``--app examples...`` imports).
REPO = Path(__file__).resolve().parents[1]


class DemoFailed(TxboxError):
    """The demo could not run to the end (the message says what to look at)."""


@dataclass(kw_only=True)
class DemoOptions:
    orders: int = 20_000
    skus: int = 20
    #: Stock per SKU as a share of the expected demand: below 1 some orders get cancelled.
    stock_ratio: float = 0.9
    window: int = 500
    workers: int = 1  # worker processes per service
    rate: float = 0.0  # orders/s offered; 0 = as fast as the window allows
    batch: int = 200
    api_clients: int = 8  # concurrent HTTP connections placing orders
    pg_url: str = "postgresql://postgres@127.0.0.1:5432/postgres"
    amqp_url: str = "amqp://guest:guest@127.0.0.1:5672/"
    rabbitmq_api: str = "http://127.0.0.1:15672/api"
    vhost: str = "txbox-demo"
    orders_db: str = "txbox_demo_orders"
    inventory_db: str = "txbox_demo_inventory"
    single_process: bool = False  # `txbox run` per service instead of one process per daemon
    stall_timeout: float = 90.0
    analyze: bool = True
    dashboard: bool = True
    log_dir: Path = field(default_factory=lambda: REPO / ".demo" / "logs")
    seed: int = 7


@dataclass
class Summary:
    orders: int
    completed: int
    cancelled: int
    unfinished: int
    seconds: float
    messages_handled: int
    messages_relayed: int
    p50_ms: float
    p95_ms: float
    p99_ms: float
    abandoned: dict[str, int]
    checks: list[tuple[str, bool, str]]

    @property
    def ok(self) -> bool:
        return all(passed for _, passed, _ in self.checks)

    def as_dict(self) -> dict[str, Any]:
        return {
            "orders": self.orders,
            "completed": self.completed,
            "cancelled": self.cancelled,
            "unfinished": self.unfinished,
            "seconds": round(self.seconds, 2),
            "orders_per_s": round(self.orders / self.seconds, 1) if self.seconds else 0,
            "messages_handled_per_s": round(self.messages_handled / self.seconds, 1) if self.seconds else 0,
            "p50_ms": self.p50_ms,
            "p95_ms": self.p95_ms,
            "p99_ms": self.p99_ms,
            "abandoned": self.abandoned,
            "checks": {name: passed for name, passed, _ in self.checks},
        }


# --- infrastructure ------------------------------------------------------------------


def database_url(admin_url: str, database: str) -> str:
    parts = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit(("postgresql+psycopg", parts.netloc, f"/{database}", parts.query, ""))


def recreate_database(admin_url: str, database: str) -> None:
    try:
        with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
            conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(database)))
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(database)))
    except psycopg.OperationalError as exc:
        raise DemoFailed(
            f"PostgreSQL is not reachable at {admin_url} ({str(exc).strip()}); run `make demo` (it runs "
            "scripts/setup.sh) or start PostgreSQL"
        ) from None


def _mgmt(api: str, user: str, password: str, method: str, path: str, body: Any = None) -> None:
    request = urllib.request.Request(
        f"{api}{path}", data=json.dumps(body).encode() if body is not None else None, method=method
    )
    request.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=30):
            pass
    except urllib.error.HTTPError as exc:
        if not (exc.code == 404 and method == "DELETE"):
            raise


def recreate_vhost(options: DemoOptions) -> str:
    """A fresh vhost (queues of an earlier run would skew the figures); returns the AMQP URL."""
    parts = urllib.parse.urlsplit(options.amqp_url)
    user, password = parts.username or "guest", parts.password or "guest"
    vhost = urllib.parse.quote(options.vhost, safe="")
    try:
        _mgmt(options.rabbitmq_api, user, password, "DELETE", f"/vhosts/{vhost}")
        _mgmt(options.rabbitmq_api, user, password, "PUT", f"/vhosts/{vhost}", {})
        _mgmt(
            options.rabbitmq_api,
            user,
            password,
            "PUT",
            f"/permissions/{vhost}/{urllib.parse.quote(user)}",
            {"configure": ".*", "write": ".*", "read": ".*"},
        )
    except (OSError, urllib.error.URLError) as exc:
        ctl = shutil.which("rabbitmqctl")
        if ctl is None:
            raise DemoFailed(
                f"cannot create vhost {options.vhost!r}: RabbitMQ management API at {options.rabbitmq_api} "
                f"failed ({exc}); enable it with `rabbitmq-plugins enable rabbitmq_management`"
            ) from None
        subprocess.run([ctl, "delete_vhost", options.vhost], capture_output=True, check=False)
        for args in (["add_vhost", options.vhost], ["set_permissions", "-p", options.vhost, user, ".*", ".*", ".*"]):
            subprocess.run([ctl, *args], capture_output=True, check=True)
    base = urllib.parse.urlunsplit((parts.scheme, parts.netloc, "", "", ""))
    return f"{base}/{vhost}"


def load_app(spec: str, database_url: str, amqp_url: str) -> Service:
    """The example app with the demo's database and vhost (what the daemons get via env)."""
    import importlib

    module, _, attr = spec.partition(":")
    service: Service = getattr(importlib.import_module(module), attr)
    return service.with_settings(database_url=database_url, amqp_url=amqp_url)


# --- driving the saga ------------------------------------------------------------------


def restock(inventory: Service, stock: dict[str, int]) -> None:
    """RestockItem commands sent through the inventory's own outbox, one transaction, with a
    token granting ``inventory:restock`` (the handler requires it)."""
    token = _defaults.demo_token("inventory:restock")
    with Session(inventory.engine) as session, session.begin():
        outbox = inventory.outbox(session)
        for sku, quantity in stock.items():
            payload = {"sku": sku, "quantity": quantity}
            outbox.send_command("RestockItem", aggregate_id=sku, payload=payload, auth_token=token)


def stocked(inventory: Service, stock: dict[str, int]) -> bool:
    with inventory.engine.connect() as conn:
        from sqlalchemy import text

        total = conn.scalar(text("SELECT coalesce(sum(available + reserved), 0) FROM stock"))
    return int(total or 0) >= sum(stock.values())


def place_orders(orders: Service, first: int, count: int, skus: list[str], rng: random.Random) -> None:
    """One business transaction writing ``count`` PlaceOrder commands into the outbox.

    Built with the public ``Outbox.build`` (contract lookup + payload validation) and
    written with the outbox's own INSERT in one transaction, as a busy front end batching
    requests would (JSON columns as text, a NULL ``locked_until`` meaning "due now").
    """
    from framework.sql import outbox as outbox_sql

    with Session(orders.engine) as session, session.begin():
        outbox = orders.outbox(session)
        spec = orders.registry.get("PlaceOrder")
        rows = [
            outbox.build(
                spec,
                aggregate_id=order_id(i),
                payload={"customer": f"customer-{i % 997}", "sku": rng.choice(skus), "quantity": rng.randint(1, 5)},
                message_context={"correlation_id": str(uuid.uuid4())},
            ).params()
            for i in range(first, first + count)
        ]
        session.connection().exec_driver_sql(outbox_sql.insert_pyformat(orders.settings.schema), rows)


class OrdersApi:
    """The order service's HTTP API as the demo's shoppers use it: a few keep-alive connections."""

    def __init__(self, host: str, port: int, clients: int) -> None:
        self.host, self.port = host, port
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(clients, thread_name_prefix="shopper")

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def up(self) -> bool:
        try:
            return self._request("GET", "/orders/-")[0] == 404
        except OSError:
            return False

    def place(self, orders: list[tuple[str, dict[str, Any]]]) -> None:
        """POST every order, concurrently; raises DemoFailed on the first refusal."""
        try:
            for _ in self._pool.map(self._place, orders):
                pass
        except (OSError, http.client.HTTPException) as exc:
            raise DemoFailed(f"the order service's HTTP API at {self.url} failed: {exc!r}") from exc

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _place(self, order: tuple[str, dict[str, Any]]) -> None:
        oid, payload = order
        body = json.dumps({"id": oid, **payload}).encode()
        try:
            status, answer = self._request("POST", "/orders", body)
        except (OSError, http.client.HTTPException):
            # The server closed the kept-alive connection (idle timeout): once more on a
            # new one. A 409 then means the first attempt went through.
            status, answer = self._request("POST", "/orders", body)
            if status == 409:
                return
        if status != 201:
            raise DemoFailed(f"POST /orders for {oid} answered {status}: {answer[:500]!r}")

    def _request(self, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
        conn: http.client.HTTPConnection | None = getattr(self._local, "conn", None)
        if conn is None:
            conn = self._local.conn = http.client.HTTPConnection(self.host, self.port, timeout=60)
        try:
            conn.request(method, path, body, {"Content-Type": "application/json"} if body else {})
            response = conn.getresponse()
            return response.status, response.read()
        except BaseException:
            conn.close()
            self._local.conn = None
            raise


def start_api(group: ProcessGroup, options: DemoOptions, database_url: str) -> OrdersApi:
    """The order service's HTTP API on uvicorn, on a free port, once it answers."""
    with contextlib.closing(socket.socket()) as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    group.start(
        "orders-api",
        ["-m", "uvicorn", "examples.orders.api:app", "--port", str(port), "--log-level", "warning", "--no-access-log"],
        {"TXBOX_DATABASE_URL": database_url},
        program=[sys.executable],
    )
    api = OrdersApi("127.0.0.1", port, options.api_clients)
    wait_for(api.up, 60, "starting the order service's HTTP API", group)
    return api


def order_id(i: int) -> str:
    return f"order-{i:06d}"


def finished_count(conn: psycopg.Connection[Any]) -> int:
    row = conn.execute("SELECT count(*) FROM orders WHERE status <> 'placed'").fetchone()
    return int(row[0]) if row else 0


class Progress:
    """A one-line progress bar (``\\r`` on a terminal, a line every few seconds otherwise)."""

    def __init__(self, total: int, out: TextIO = sys.stdout, width: int = 30) -> None:
        self.total = total
        self.out = out
        self.width = width
        self.tty = out.isatty()
        self.started = time.monotonic()
        self.last_line = 0.0

    def update(self, done: int, sent: int) -> None:
        now = time.monotonic()
        if not self.tty and now - self.last_line < 3.0 and done < self.total:
            return
        self.last_line = now
        elapsed = now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        filled = int(self.width * done / self.total) if self.total else self.width
        eta = f"{(self.total - done) / rate:5.0f}s" if rate > 0 else "    ?"
        line = (
            f"orders [{'#' * filled}{'.' * (self.width - filled)}] {done:>7,}/{self.total:,} final"
            f"  sent {sent:>7,}  {rate:7,.0f}/s  elapsed {elapsed:4.0f}s  eta {eta}"
        )
        self.out.write(("\r" + line) if self.tty else (line + "\n"))
        self.out.flush()

    def close(self) -> None:
        if self.tty:
            self.out.write("\n")
            self.out.flush()


def drive(
    orders: Service,
    api: OrdersApi,
    group: ProcessGroup,
    options: DemoOptions,
    skus: list[str],
    out: TextIO,
) -> float:
    """Offer the orders and wait until every one is final; returns the seconds it took."""
    rng = random.Random(options.seed)
    progress = Progress(options.orders, out)
    sent = done = 0
    started = last_progress_at = time.monotonic()
    last_done = -1
    with psycopg.connect(orders.settings.database_url.replace("+psycopg", ""), autocommit=True) as conn:
        while done < options.orders:
            raise_if_terminated()
            now = time.monotonic()
            allowed = options.orders - sent
            if options.rate > 0:
                allowed = min(allowed, int((now - started) * options.rate) - sent)
            allowed = min(allowed, options.window - (sent - done), options.batch)
            if allowed > 0:
                api.place(
                    [
                        (
                            order_id(i),
                            {
                                "customer": f"customer-{i % 997}",
                                "sku": rng.choice(skus),
                                "quantity": rng.randint(1, 5),
                            },
                        )
                        for i in range(sent, sent + allowed)
                    ]
                )
                sent += allowed
            done = finished_count(conn)
            progress.update(done, sent)
            if done != last_done:
                last_done, last_progress_at = done, now
            elif now - last_progress_at > options.stall_timeout:
                progress.close()
                raise DemoFailed(
                    f"no order finished for {options.stall_timeout:.0f}s ({done:,}/{options.orders:,} final); "
                    f"daemon logs are in {group.log_dir}"
                )
            if group.dead():
                progress.close()
                daemon = group.dead()[0]
                raise DemoFailed(
                    f"daemon {daemon.name} exited with code {daemon.process.returncode}; "
                    f"last lines of {daemon.log_path}:\n{daemon.log_tail()}"
                )
            if allowed <= 0:
                time.sleep(0.05)  # pacing the offered load, not synchronization
    progress.close()
    return time.monotonic() - started


# --- the summary -------------------------------------------------------------------------


def _one(conn: psycopg.Connection[Any], query: str) -> Any:
    row = conn.execute(query).fetchone()
    return row[0] if row else None


def summarize(orders_url: str, inventory_url: str, expected: int, seconds: float, stock_total: int) -> Summary:
    """Every figure and check of the summary, from the business and txbox tables."""
    with (
        psycopg.connect(orders_url.replace("+psycopg", "")) as o,
        psycopg.connect(inventory_url.replace("+psycopg", "")) as i,
    ):
        counts = o.execute(
            "SELECT count(*), count(*) FILTER (WHERE status = 'completed'), "
            "count(*) FILTER (WHERE status = 'cancelled'), count(*) FILTER (WHERE status = 'placed'), "
            "count(*) FILTER (WHERE status <> 'placed' AND final_transitions <> 1) FROM orders"
        ).fetchone()
        assert counts is not None
        total, completed, cancelled, unfinished, not_once = counts
        latency = o.execute(
            "SELECT percentile_cont(ARRAY[0.5, 0.95, 0.99]) WITHIN GROUP ("
            "  ORDER BY extract(epoch FROM ord.finished_at - ob.created_at) * 1000) "
            "FROM orders ord JOIN txbox.outbox ob "
            "  ON ob.message_type = 'PlaceOrder' AND ob.aggregate_id = ord.id "
            "WHERE ord.finished_at IS NOT NULL"
        ).fetchone()
        p50, p95, p99 = (round(float(v), 1) for v in latency[0]) if latency and latency[0] else (0.0, 0.0, 0.0)
        handled = int(_one(o, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL")) + int(
            _one(i, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL")
        )
        relayed = int(_one(o, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NOT NULL")) + int(
            _one(i, "SELECT count(*) FROM txbox.outbox WHERE processed_at IS NOT NULL")
        )
        abandoned: dict[str, int] = {}
        for label, conn in (("orders", o), ("inventory", i)):
            for table in ("inbox", "outbox"):
                abandoned[f"{label} {table}"] = int(
                    _one(conn, f"SELECT count(*) FROM txbox.{table} WHERE abandoned_at IS NOT NULL")
                )
            abandoned[f"{label} dead letters"] = int(_one(conn, "SELECT count(*) FROM txbox.dead_letters"))
        answers: dict[str, str] = dict(
            i.execute("SELECT order_id, status || '|' || coalesce(correlation_id, '') FROM reservations").fetchall()
        )
        mismatched = 0
        for oid, status, correlation in o.execute("SELECT id, status, correlation_id FROM orders").fetchall():
            want = ("reserved" if status == "completed" else "rejected") + "|" + (correlation or "")
            if status != "placed" and answers.get(oid) != want:
                mismatched += 1
        reserved_units = int(_one(i, "SELECT coalesce(sum(reserved), 0) FROM stock"))
        completed_units = int(_one(o, "SELECT coalesce(sum(quantity), 0) FROM orders WHERE status = 'completed'"))
        stock_units = int(_one(i, "SELECT coalesce(sum(available + reserved), 0) FROM stock"))
        handled_types: dict[str, int] = dict(
            o.execute("SELECT message_type, count(*) FROM txbox.inbox GROUP BY message_type").fetchall()
        )
        handled_types.update(i.execute("SELECT message_type, count(*) FROM txbox.inbox GROUP BY message_type"))
    stock_results = handled_types.get("StockReserved", 0) + handled_types.get("StockRejected", 0)
    checks = [
        (
            "every order reached a final state",
            total == expected and unfinished == 0,
            f"{total - unfinished:,}/{expected:,}",
        ),
        ("exactly once: each order moved to its final state once", not_once == 0, f"{not_once} moved more than once"),
        (
            "exactly once: one inbox row per message",
            handled_types.get("PlaceOrder", 0) == expected
            and handled_types.get("OrderPlaced", 0) == expected
            and stock_results == expected,
            ", ".join(f"{k} {v:,}" for k, v in sorted(handled_types.items())),
        ),
        (
            "both services agree, and the correlation id flowed through the saga",
            mismatched == 0 and len(answers) == expected,
            f"{mismatched} orders disagree with their reservation",
        ),
        (
            "stock adds up (nothing reserved twice, nothing lost)",
            reserved_units == completed_units and stock_units == stock_total,
            f"reserved {reserved_units:,} units for {completed_units:,} units of completed orders",
        ),
        ("nothing abandoned", sum(abandoned.values()) == 0, ", ".join(f"{k} {v}" for k, v in abandoned.items() if v)),
    ]
    return Summary(
        orders=total,
        completed=completed,
        cancelled=cancelled,
        unfinished=unfinished,
        seconds=seconds,
        messages_handled=handled,
        messages_relayed=relayed,
        p50_ms=p50,
        p95_ms=p95,
        p99_ms=p99,
        abandoned=abandoned,
        checks=checks,
    )


def render(summary: Summary, options: DemoOptions) -> str:
    d = summary.as_dict()
    offered = f"at most {options.window:,} orders in flight" + (
        f", {options.rate:,.0f} orders/s" if options.rate else ""
    )
    lines = [
        "",
        "── txbox demo: summary " + "─" * 50,
        f"  orders            {summary.orders:,} in {summary.seconds:.1f} s ({offered})",
        f"  throughput        {d['orders_per_s']:,} orders/s = {d['messages_handled_per_s']:,} messages handled/s "
        f"({summary.messages_handled:,} handled, {summary.messages_relayed:,} relayed)",
        f"  latency           p50 {summary.p50_ms:,.0f} ms   p95 {summary.p95_ms:,.0f} ms   "
        f"p99 {summary.p99_ms:,.0f} ms   (PlaceOrder outbox commit → order final)",
        f"  outcome           {summary.completed:,} completed, {summary.cancelled:,} cancelled (stock rejected), "
        f"{sum(summary.abandoned.values())} abandoned, {summary.unfinished} unfinished",
        "",
    ]
    for name, passed, detail in summary.checks:
        mark = "✔" if passed else "✘"
        lines.append(f"  {mark} {name}" + ("" if passed or not detail else f"  — {detail}"))
    lines.append("")
    lines.append("  RESULT: " + ("OK, every order exactly once" if summary.ok else "FAILED (see ✘ above)"))
    return "\n".join(lines)


# --- the whole run -------------------------------------------------------------------------


def available(command: str) -> bool:
    """Whether a `txbox` sub-command has landed in this checkout."""
    from framework.cli import COMMANDS

    return command in COMMANDS and importlib.util.find_spec(COMMANDS[command][0]) is not None


def start_daemons(group: ProcessGroup, options: DemoOptions, urls: dict[str, str], amqp_url: str) -> None:
    for short, app in (("orders", ORDERS_APP), ("inventory", INVENTORY_APP)):
        env = {"TXBOX_DATABASE_URL": urls[short], "TXBOX_AMQP_URL": amqp_url}
        if options.single_process:
            group.start(f"{short}-run", ["run", "--app", app], env)
            continue
        group.start(f"{short}-publisher", ["publisher", "--app", app], env)
        group.start(f"{short}-receiver", ["receiver", "--app", app], env)
        for n in range(1, options.workers + 1):
            group.start(f"{short}-worker" + (f"-{n}" if options.workers > 1 else ""), ["worker", "--app", app], env)
        if available("collector"):
            group.start(f"{short}-collector", ["collector", "--app", app], env)


def wait_for(predicate: Any, timeout: float, what: str, group: ProcessGroup) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        raise_if_terminated()
        if group.dead():
            daemon = group.dead()[0]
            raise DemoFailed(f"daemon {daemon.name} exited while {what}; last lines:\n{daemon.log_tail()}")
        if time.monotonic() > deadline:
            raise DemoFailed(f"timed out after {timeout:.0f}s {what}; daemon logs are in {group.log_dir}")
        time.sleep(0.1)


def run(options: DemoOptions, out: TextIO = sys.stdout) -> Summary:
    missing = [d for d in (*DAEMONS, "run") if not available(d)]
    needed = ["run"] if options.single_process else list(DAEMONS)
    if any(d in missing for d in needed):
        raise ConfigurationError(f"this checkout lacks the txbox command(s) {', '.join(missing)}: cannot run the demo")

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    logging.getLogger("alembic").setLevel(logging.WARNING)  # one line per step is enough here
    unwind_on_sigterm()  # its HTTP clients' threads make lost interrupts frequent
    say(f"txbox demo: {options.orders:,} orders through order-service ⇄ inventory-service")
    urls, amqp_url, orders, inventory = _prepare(options, say)

    if options.log_dir.exists():
        shutil.rmtree(options.log_dir)
    group = ProcessGroup(options.log_dir)
    try:
        start_daemons(group, options, urls, amqp_url)
        say(f"  started {len(group.daemons)} daemon processes (logs: {options.log_dir})")
        api = start_api(group, options, urls["orders"])
        say(f"  order service's HTTP API: {api.url}/orders (uvicorn, examples/orders/api.py)")
        skus = [f"SKU-{n:03d}" for n in range(1, options.skus + 1)]
        per_sku = max(1, round(options.orders * 3 / options.skus * options.stock_ratio))  # mean quantity is 3
        stock = dict.fromkeys(skus, per_sku)
        restock(inventory, stock)
        wait_for(lambda: stocked(inventory, stock), 120, "restocking the inventory", group)
        say(f"  inventory restocked: {len(skus)} SKUs x {per_sku:,} units (about {options.stock_ratio:.0%} of demand)")
        try:
            seconds = drive(orders, api, group, options, skus, out)
        finally:
            api.close()
        summary = summarize(urls["orders"], urls["inventory"], options.orders, seconds, sum(stock.values()))
        say(render(summary, options))
    finally:
        say("  stopping the daemons …")
        group.stop_all()
        orders.engine.dispose()
        inventory.engine.dispose()
    sources = [f"order-service={urls['orders']}", f"inventory-service={urls['inventory']}"]
    source_args = [arg for source in sources for arg in ("--source", source)]
    if options.analyze and available("analyze"):
        _analyze(options, source_args, orders, say)
    if options.dashboard and available("dashboard"):
        show_dashboard(group, source_args, orders, out)
    return summary


def _prepare(options: DemoOptions, say: Callable[[str], None]) -> tuple[dict[str, str], str, Service, Service]:
    """Fresh databases (migrated) and vhost (declared) for both services: their URLs, the
    AMQP URL, and the two services, checked."""
    urls = {
        "orders": database_url(options.pg_url, options.orders_db),
        "inventory": database_url(options.pg_url, options.inventory_db),
    }
    for short, db in (("orders", options.orders_db), ("inventory", options.inventory_db)):
        recreate_database(options.pg_url, db)
        migrate.upgrade(short, urls[short])
    say(f"  databases {options.orders_db}, {options.inventory_db}: created, framework + business migrations applied")
    amqp_url = recreate_vhost(options)
    orders = load_app(ORDERS_APP, urls["orders"], amqp_url)
    inventory = load_app(INVENTORY_APP, urls["inventory"], amqp_url)
    from framework import topology

    for service in (orders, inventory):
        service.check()
        topology.declare(service.settings, service.registry)
    say(f"  RabbitMQ vhost {options.vhost}: exchanges, inbox and dead-letter queues declared")
    return urls, amqp_url, orders, inventory


def _analyze(options: DemoOptions, source_args: list[str], orders: Service, say: Callable[[str], None]) -> None:
    """`txbox analyze` over both services' tables, Spark's output in the log."""
    say("\n  running `txbox analyze` (Spark) over both services' message tables …")
    log_path = options.log_dir / "analyze.log"
    with log_path.open("wb") as log:  # Spark's JVM chatter goes to the log, the report to the screen
        analyze = subprocess.run(
            [*txbox_command(), "analyze", *source_args, "--contracts-dir", str(orders.settings.contracts_dir)],
            cwd=REPO,
            stdin=subprocess.DEVNULL,
            stderr=log,
            check=False,
        )
    outcome = "done" if analyze.returncode == 0 else f"exited with {analyze.returncode}; see {log_path}"
    say(f"  txbox analyze: {outcome}")


def show_dashboard(group: ProcessGroup, source_args: list[str], orders: Service, out: TextIO) -> None:
    """Serve the dashboard until Enter/Ctrl-C when someone is watching; else say how to start it."""
    argv = ["dashboard", *source_args, "--contracts-dir", str(orders.settings.contracts_dir)]
    url = f"http://127.0.0.1:{DASHBOARD_PORT}/"
    if not sys.stdin.isatty():
        print(f"\n  dashboard: .venv/bin/txbox {' '.join(argv)}  then open {url}", file=out, flush=True)
        return
    daemon = group.start("dashboard", [*argv, "--port", str(DASHBOARD_PORT)])
    try:
        print(f"\n  dashboard: {url}  (press Enter or Ctrl-C to stop it)", file=out, flush=True)
        time.sleep(1.0)  # give a crash at start the chance to show; not synchronization
        if not daemon.alive:
            print(f"  the dashboard did not start:\n{daemon.log_tail()}", file=out, flush=True)
            return
        with contextlib.suppress(EOFError, KeyboardInterrupt):
            input()
    finally:
        group.stop(daemon)
