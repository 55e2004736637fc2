"""A canary auth_token planted on every path a message can take is found in no output and no table.

Real daemons (`txbox run`: relay, receiver, worker, collector) of the orders example, as
processes. The canary rides on messages that are: accepted (outbox → broker → inbox →
processed, and the event the handler publishes), rejected by the receiver at each stage
(not JSON, not an envelope, unknown type, schema-invalid, wrong content type, binary with
NUL, too large; with the token also in AMQP headers and inside an escaped JSON string),
rejected by the worker (PermanentError), dead-lettered by the broker (collector),
abandoned by the relay (an unroutable command), replayed from the dead letters, archived
(`txbox archive`) and analyzed (`txbox analyze`, Spark local). The canary is also every
password a URL or DSN carries: the daemons' and the Spark job's ``TXBOX_DATABASE_URL``
as ``postgres:<canary>@`` (PostgreSQL trusts, any password passes), the read-only
commands' as ``?password=<canary>``, ``TXBOX_AMQP_URL`` as a list of two URLs of a
RabbitMQ user whose password it is, and commands that fail on a libpq ``password=``
DSN, a URL argument argparse rejects and a DSN ``--source``. Then every table of the
database, every output (`txbox dlq` text and JSON, `txbox check`, the dashboard's pages
and API with and without credentials, the daemons' logs, /metrics, the commands' output)
and every Parquet file is searched for it.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pika
import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row
from sqlalchemy.orm import Session

from framework import names
from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.server import free_port, serving
from framework.db import conninfo
from framework.service import Service
from tests import support
from tests.conftest import CONTRACTS, ROOT

pytestmark = [pytest.mark.slow, pytest.mark.spark, pytest.mark.timeout(900)]

TXBOX = Path(sys.executable).parent / "txbox"
APP = "examples.orders.app:service"
DASHBOARD_TOKEN = "canary-dashboard-token-0123456789"
CANARY = "CaNaRy-" + uuid.uuid4().hex  # unique per run: a hit is this run's leak
MAX_BODY = 4096


def _env(database_url: str, amqp_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "TXBOX_SERVICE": "order-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_CONTRACTS_DIR": str(CONTRACTS),
        "TXBOX_DASHBOARD_TOKEN": DASHBOARD_TOKEN,
        "TXBOX_WORKER_POLL_INTERVAL": "200ms",
        "TXBOX_PUBLISHER_MAX_ATTEMPTS": "2",
        "TXBOX_PUBLISHER_RETRY_BASE": "100ms",
        "TXBOX_COLLECTOR_RESOLVE_INTERVAL": "200ms",
        "TXBOX_RECEIVER_MAX_BODY_BYTES": str(MAX_BODY),
        "TXBOX_ANALYZE_MASTER": "local[2]",
        "TXBOX_ANALYZE_SHUFFLE_PARTITIONS": "2",
        "TXBOX_ANALYZE_DRIVER_MEMORY": "1g",
        "PYTHONUNBUFFERED": "1",
    }


class Outputs:
    """Everything the test saw, by where it came from: searched at the end."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str]] = []

    def add(self, where: str, text: str | bytes) -> str:
        value = text.decode("utf-8", "replace") if isinstance(text, bytes) else text
        self.seen.append((where, value))
        return value

    def leaks(self) -> list[str]:
        return [where for where, text in self.seen if CANARY.lower() in text.lower()]


@pytest.fixture
def daemons(tmp_path: Path) -> Iterator[list[tuple[subprocess.Popen[bytes], Path]]]:
    running: list[tuple[subprocess.Popen[bytes], Path]] = []
    try:
        yield running
    finally:
        for proc, _ in running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, _ in running:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _start(running: list[Any], logs: Path, name: str, args: list[str], env: dict[str, str]) -> None:
    log = logs / f"{name}.log"
    with log.open("wb") as fh:
        proc = subprocess.Popen([str(TXBOX), *args], cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT)
    running.append((proc, log))


def _txbox(
    outputs: Outputs, env: dict[str, str], *args: str, timeout: float = 120, codes: tuple[int, ...] = (0, 1)
) -> str:
    done = subprocess.run(
        [str(TXBOX), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode in codes, f"txbox {' '.join(args)}: {done.returncode}\n{done.stderr[-3000:]}"
    return outputs.add(f"txbox {' '.join(args)}", done.stdout + done.stderr)


def _with_password(database_url: str) -> str:
    """The test database's URL with the canary as the password in its user info."""
    parts = urllib.parse.urlsplit(database_url)
    assert parts.username and not parts.password, database_url
    netloc = f"{parts.username}:{CANARY}@{parts.hostname}:{parts.port or 5432}"
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def _with_query_password(database_url: str) -> str:
    return database_url + ("&" if "?" in database_url else "?") + f"password={CANARY}"


@pytest.fixture
def canary_amqp_url(vhost: str) -> Iterator[str]:
    """Two URLs (a list, as for a cluster) of a RabbitMQ user of the test's vhost whose password is the canary."""
    user = support.unique("txbox-canary")
    support.mgmt("PUT", f"/users/{user}", {"password": CANARY, "tags": ""})
    where = f"/permissions/{support.vhost_path(vhost)}/{user}"
    support.mgmt("PUT", where, {"configure": ".*", "write": ".*", "read": ".*"})
    path = support.vhost_path(vhost)
    try:
        yield ",".join(f"amqp://{user}:{CANARY}@{host}:{support.AMQP_PORT}/{path}" for host in (support.AMQP_HOST,) * 2)
    finally:
        support.mgmt("DELETE", f"/users/{user}")


def _spark_commands(outputs: Outputs, env: dict[str, str], commands: list[list[str]], timeout: float) -> str:
    """``txbox`` commands run one after the other by the CLI's ``main`` in one process and one Spark session."""
    script = textwrap.dedent(
        f"""
        import sys
        from framework.analytics.session import job_session
        from framework.analytics.settings import AnalyzeSettings
        from framework.cli import main
        from framework.settings import load

        with job_session(load(AnalyzeSettings), "txbox-canary"):
            for command in {commands!r}:
                status = main(command)
                sys.stdout.flush()
                if status not in (0, 1):
                    raise SystemExit(f"txbox {{command[0]}}: {{status}}")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert done.returncode == 0, f"txbox {' / '.join(c[0] for c in commands)}: {done.returncode}\n{done.stderr[-3000:]}"
    return outputs.add(" then ".join(f"txbox {' '.join(c)}" for c in commands), done.stdout + done.stderr)


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, str]:
    req = urllib.request.Request(url, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode("utf-8", "replace")


def _envelope(message_type: str, aggregate: tuple[str, str], payload: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {
        "payload": payload,
        "message_context": {"example_correlation_id": str(uuid.uuid4())},
        "message_id": str(uuid.uuid4()),
        "timestamp": datetime.now(UTC).isoformat().replace("+00:00", "Z"),
        "message_type": message_type,
        "aggregate_type": aggregate[0],
        "aggregate_id": aggregate[1],
        "message_version": "1.0",
        "auth_token": CANARY,
        **extra,
    }


def _publish_raw(amqp_url: str, service: Service) -> dict[str, str]:
    """What senders and the broker put on the wire, with plain pika. Returns the message ids by path."""
    from framework import amqp, topology

    order = {"customer": "ada", "sku": "SKU-1", "quantity": 1}
    unknown_order = _envelope("StockReserved", ("stock", "o-404"), {"order_id": "o-404", "sku": "SKU-1", "quantity": 1})
    sent = {"worker_rejects": unknown_order["message_id"]}
    json_props = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    to_inbox: list[tuple[str, bytes, pika.BasicProperties]] = [
        ("inventory-service.stock.reserved", json.dumps(unknown_order).encode(), json_props),
        (
            "order-service.order.place",
            f"auth_token={CANARY}; not json at all {{".encode(),
            pika.BasicProperties(
                content_type="application/json",
                headers={"auth_token": CANARY, "Authorization": f"Bearer {CANARY}", "x-note": f"token={CANARY}"},
            ),
        ),
        (
            "order-service.order.place",
            json.dumps({"auth_token": CANARY, "note": json.dumps({"auth_token": CANARY})}).encode(),
            json_props,
        ),
        ("order-service.order.place", json.dumps(_envelope("Nope", ("order", "o-9"), order)).encode(), json_props),
        (
            "order-service.order.place",
            json.dumps(_envelope("PlaceOrder", ("order", "o-8"), {**order, "customer": ""})).encode(),
            json_props,
        ),
        (
            "order-service.order.place",
            json.dumps(_envelope("PlaceOrder", ("order", "o-7"), order)).encode(),
            pika.BasicProperties(content_type="text/plain"),
        ),
        ("order-service.order.place", b"\x00\xff" + json.dumps({"auth_token": CANARY}).encode(), json_props),
        (
            "order-service.order.place",
            json.dumps(_envelope("PlaceOrder", ("order", "o-6"), {**order, "customer": "x" * MAX_BODY})).encode(),
            json_props,
        ),
    ]
    connection = amqp.connect(amqp_url)
    try:
        channel = connection.channel()
        topology.declare(service.settings, service.registry, channel)
        channel.confirm_delivery()
        for routing_key, body, props in to_inbox:
            exchange = names.EVENT_EXCHANGE if routing_key.startswith("inventory") else names.COMMAND_EXCHANGE
            channel.basic_publish(exchange, routing_key, body, props, mandatory=True)
        broker_dead = _envelope("PlaceOrder", ("order", "o-5"), order)
        channel.basic_publish(
            names.DEAD_LETTER_EXCHANGE,
            names.dead_letter_routing_key("order-service"),
            json.dumps(broker_dead).encode(),
            pika.BasicProperties(
                content_type="application/json",
                headers={names.HEADER_DEAD_REASON: "retries_exhausted", "auth_token": CANARY},
            ),
        )
        sent["broker"] = broker_dead["message_id"]
    finally:
        connection.close()
    return sent


def _send_from_outbox(service: Service, message_type: str, aggregate_id: str, payload: dict[str, Any]) -> str:
    with Session(service.engine) as session, session.begin():
        return str(service.outbox(session).send_command(message_type, aggregate_id=aggregate_id, payload=payload,
                                                        auth_token=CANARY))  # fmt: skip


def _one(conn: psycopg.Connection[Any], query: str, *params: Any) -> Any:
    row = conn.execute(query, params).fetchone()
    return None if row is None else next(iter(row.values()))


def _table_leaks(conn: psycopg.Connection[Any]) -> list[str]:
    """Every table of every schema but the catalogs, whole rows as text; base64 raw bodies decoded."""
    found = []
    tables = conn.execute(
        "SELECT table_schema, table_name FROM information_schema.tables WHERE table_type = 'BASE TABLE' "
        "AND table_schema NOT IN ('pg_catalog', 'information_schema')"
    ).fetchall()
    assert {t["table_name"] for t in tables} >= {"outbox", "inbox", "dead_letters", "redeliveries", "orders"}
    for t in tables:
        hits = _one(
            conn,
            sql.SQL("SELECT count(*) FROM {} r WHERE strpos(lower(r::text), %s) > 0")
            .format(sql.Identifier(t["table_schema"], t["table_name"]))
            .as_string(conn),
            CANARY.lower(),
        )
        if hits:
            found.append(f"table {t['table_schema']}.{t['table_name']}: {hits} row(s)")
    for row in conn.execute("SELECT id, raw_body FROM txbox.dead_letters WHERE raw_encoding = 'base64'"):
        if CANARY.lower().encode() in base64.b64decode(row["raw_body"]).lower():
            found.append(f"dead letter {row['id']}: base64 raw body")
    return found


def _parquet_leaks(*roots: Path) -> tuple[int, list[str]]:
    import pyarrow.parquet as pq

    files = [p for root in roots for p in root.rglob("*.parquet")]
    leaks = [str(p) for p in files if CANARY.lower() in json.dumps(pq.read_table(p).to_pylist(), default=str).lower()]
    return len(files), leaks


def test_the_canary_token_is_in_no_output_and_no_table(
    database_url: str, canary_amqp_url: str, service: Service, daemons: list[Any], tmp_path: Path
) -> None:
    from examples import migrate as example_migrate

    example_migrate.upgrade("orders", database_url)
    env = _env(_with_password(database_url), canary_amqp_url)
    read_env = {**env, "TXBOX_DATABASE_URL": _with_query_password(database_url)}
    outputs = Outputs()
    conn = psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row)
    try:
        metrics_port = free_port()
        _start(daemons, tmp_path, "run", ["run", "--app", APP, "--metrics-port", str(metrics_port)], env)
        support.wait_until(
            lambda: _get_quiet(f"http://127.0.0.1:{metrics_port}/readyz") == 200,
            timeout=90,
            message="txbox run to be ready",
        )
        accepted = _every_path(conn, service, canary_amqp_url, outputs, env, daemons)
        ids = [r["id"] for r in conn.execute("SELECT id FROM txbox.dead_letters ORDER BY id")]
        _the_commands(ids, outputs, env, read_env)
        _the_dashboard(conn, ids, outputs, env, daemons, tmp_path, database_url)
        metrics = outputs.add("/metrics", _get(f"http://127.0.0.1:{metrics_port}/metrics")[1])
        assert "txbox" in metrics

        # Before the archive moves them away: processed and abandoned rows hold no token.
        table_leaks = _table_leaks(conn)
        _archived_and_analyzed(conn, outputs, env, tmp_path, database_url, accepted)
    finally:
        for proc, _ in daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc, log in daemons:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            outputs.add(f"log {log.name}", log.read_bytes())

    # --- the search ---------------------------------------------------------------------
    try:
        table_leaks += _table_leaks(conn)
        # The canary did get everywhere: the search would see it if it were kept.
        assert _one(conn, "SELECT count(*) FROM txbox.dead_letters") >= 10
    finally:
        conn.close()
    files, parquet_leaks = _parquet_leaks(tmp_path / "archive", tmp_path / "report")
    assert files >= 2, "the archive and the report wrote Parquet files"
    assert len(outputs.seen) > 50
    leaks = table_leaks + parquet_leaks + outputs.leaks()
    assert not leaks, "the canary token leaked into:\n" + "\n".join(leaks)


def _every_path(
    conn: psycopg.Connection[Any],
    service: Service,
    canary_amqp_url: str,
    outputs: Outputs,
    env: dict[str, str],
    daemons: list[Any],
) -> str:
    """Every path a message takes, the token in each: accepted, dead-lettered for every reason,
    a letter replayed. The accepted message's id."""
    accepted = _send_from_outbox(service, "PlaceOrder", "o-1", {"customer": "ada", "sku": "SKU-1", "quantity": 1})
    _send_from_outbox(service, "RestockItem", "SKU-1", {"sku": "SKU-1", "quantity": 5})  # unroutable
    sent = _publish_raw(canary_amqp_url, service)
    expected_letters = 10  # 8 from the receiver/worker, 1 broker, 1 relay

    def settled() -> bool:
        letters = _one(conn, "SELECT count(*) FROM txbox.dead_letters")
        pending = _one(
            conn,
            "SELECT (SELECT count(*) FROM txbox.outbox WHERE processed_at IS NULL AND abandoned_at IS NULL)"
            " + (SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL AND abandoned_at IS NULL)",
        )
        return letters >= expected_letters and pending == 0

    support.wait_until(settled, timeout=120, interval=0.2, message="every message to settle:\n" + _logs(daemons))
    assert _one(conn, "SELECT processed_at IS NOT NULL FROM txbox.inbox WHERE id = %s", uuid.UUID(accepted))
    reasons = {r["reason"] for r in conn.execute("SELECT reason FROM txbox.dead_letters")}
    assert {"not_json", "unknown_message_type", "schema_invalid", "wrong_content_type", "too_large"} <= reasons
    assert {"permanent_error", "retries_exhausted", "unroutable"} <= reasons | {"max_attempts"}

    # Replayed: the order the early StockReserved waited for arrives; the letter is replayed.
    _send_from_outbox(service, "PlaceOrder", "o-404", {"customer": "bob", "sku": "SKU-1", "quantity": 1})
    support.wait_until(
        lambda: _one(conn, "SELECT count(*) FROM orders WHERE id = 'o-404'") == 1, timeout=60, message="o-404"
    )
    early = _one(conn, "SELECT id FROM txbox.dead_letters WHERE message_id = %s", uuid.UUID(sent["worker_rejects"]))
    assert "inbox-reset" in _txbox(outputs, env, "dlq", "replay", str(early))
    support.wait_until(
        lambda: _one(conn, "SELECT resolved_at IS NOT NULL FROM txbox.dead_letters WHERE id = %s", early),
        timeout=60,
        message="the replayed letter to be resolved",
    )
    support.wait_until(settled, timeout=60, interval=0.2, message="the replay's follow-ups to settle")
    return accepted


def _the_commands(ids: list[Any], outputs: Outputs, env: dict[str, str], read_env: dict[str, str]) -> None:
    """What the commands print, reading and failing on a URL or DSN that quotes the token."""
    # Two dozen commands that only read: run side by side (each is mostly its interpreter's start).
    commands = [
        ["dlq", *args, "--status", "all"]
        for args in (["list"], ["list", "--json"], ["list", "--groups"], ["list", "--groups", "--json"])
    ]
    commands += [["dlq", "show", str(lid), *json_flag] for lid in ids for json_flag in ([], ["--json"])]
    commands += [["check", "--app", APP], ["inbox", "list"], ["outbox", "list", "--json"]]
    with ThreadPoolExecutor(max_workers=4) as pool:
        shown = dict(
            zip(map(tuple, commands), pool.map(lambda a: _txbox(outputs, read_env, *a), commands), strict=True)
        )
    for lid in ids:
        assert f"{lid}" in shown[("dlq", "show", str(lid))]
    # Failing on a URL or DSN: the error quotes it, masked.
    dsn = f"host=127.0.0.1 user=postgres password={CANARY} dbname=orders"
    failing = [
        ({**env, "TXBOX_DATABASE_URL": dsn}, ["dlq", "list"]),
        (env, ["dlq", "list", "--limit", f"postgresql://postgres:{CANARY}@127.0.0.1/x"]),
        (env, ["dashboard", "--port", str(free_port()), "--source", f"order-service={dsn}"]),
    ]
    for failing_env, args in failing:
        assert "***" in _txbox(outputs, failing_env, *args, codes=(2,)), args


def _the_dashboard(
    conn: psycopg.Connection[Any],
    ids: list[Any],
    outputs: Outputs,
    env: dict[str, str],
    daemons: list[Any],
    tmp_path: Path,
    database_url: str,
) -> None:
    """Every page and API answer of the dashboard, with its token, without, and of one that has none."""
    fingerprints = [r["fingerprint"] for r in conn.execute("SELECT DISTINCT fingerprint FROM txbox.dead_letters")]
    dashboard_port = free_port()
    _start(daemons, tmp_path, "dashboard", ["dashboard", "--app", APP, "--port", str(dashboard_port)], env)
    base = f"http://127.0.0.1:{dashboard_port}"
    support.wait_until(lambda: _get_quiet(base + "/healthz") == 200, timeout=60, message="the dashboard")
    paths = [
        "/",
        "/?window=24h",
        "/groups?status=all",
        "/letters?status=all",
        "/api/overview?window=24h",
        "/api/groups?status=all",
        "/api/letters?status=all",
    ]
    for lid in ids:
        paths += [f"/letters/order-service/{lid}", f"/letters/order-service/{lid}/replay"]
        paths += [f"/api/letters/order-service/{lid}"]
    paths += [f"/groups/order-service/{fp}/discard" for fp in fingerprints]
    bearer = {"Authorization": f"Bearer {DASHBOARD_TOKEN}"}
    for path in paths:
        status, body = _get(base + path, bearer)
        assert status == 200, (path, body[:300])
        outputs.add(f"dashboard {path} (token)", body)
        status, body = _get(base + path)
        assert status in (200, 401), path  # redirects to the login are followed: the login page
        outputs.add(f"dashboard {path} (no credentials)", body)
    # A dashboard without a token shows everything to anyone on the host: masked all the same.
    source = Source("order-service", _with_password(database_url), schema="txbox", contracts_dir=CONTRACTS)
    with serving(create_app([source], DashboardSettings())) as open_base:
        for path in paths:
            status, body = _get(open_base + path)
            assert status == 200, (path, body[:300])
            outputs.add(f"open dashboard {path}", body)
    source.engine.dispose()


def _archived_and_analyzed(
    conn: psycopg.Connection[Any],
    outputs: Outputs,
    env: dict[str, str],
    tmp_path: Path,
    database_url: str,
    accepted: str,
) -> None:
    """`txbox archive` then `txbox analyze`: their Parquet files are searched afterwards."""
    archive, report = tmp_path / "archive", tmp_path / "report"
    # `txbox archive` then `txbox analyze`, as the commands parse and run them, in one process
    # on one Spark session (each JVM start costs tens of seconds on a busy machine).
    commands = [
        ["archive", "--older-than", "0s", "--to", str(archive)],
        [
            "analyze",
            "--source",
            f"order-service={_with_password(database_url)}",
            "--contracts-dir",
            str(CONTRACTS),
            "--history",
            str(archive),
            "--parquet",
            str(report),
        ],
    ]
    _spark_commands(outputs, env, commands, timeout=600)
    # Archived: within the dedup window the row stays as a tombstone, emptied (framework.dedup).
    tombstone = "SELECT count(*) FROM txbox.inbox WHERE id = %s AND archived_at IS NOT NULL AND payload = '{}'"
    assert _one(conn, tombstone, uuid.UUID(accepted)) == 1
    assert _one(conn, "SELECT count(*) FROM txbox.analytics_runs") >= 1


def _get_quiet(url: str) -> int:
    try:
        return _get(url)[0]
    except OSError:
        return 0


def _logs(daemons: list[Any]) -> str:
    return "\n".join(f"--- {log.name}\n{log.read_text(errors='replace')[-3000:]}" for _, log in daemons)
