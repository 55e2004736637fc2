"""A person fixes an out-of-order failure from the dashboard, in real headless Chromium.

StockReserved for order o-1 arrives before PlaceOrder o-1: the worker (a real `txbox
worker` process) abandons it (PermanentError: unknown order) into the dead letters.
PlaceOrder o-1 then arrives and is processed. In the dashboard (a real `txbox
dashboard` process, TXBOX_DASHBOARD_TOKEN set: viewing needs it) the person is sent to
the login, mistypes the token, logs in, opens the overview, filters the list down to
the StockReserved letter, opens it (no auth_token anywhere), replays it, and sees it
resolved (by a real `txbox collector`) once the worker has processed it; the order is
completed exactly once; logging out closes the dashboard again. Screenshots of every
page land in artifacts/screenshots/.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from framework.dashboard.server import free_port
from framework.db import conninfo
from tests import support
from tests.conftest import CONTRACTS, ROOT

pytestmark = [pytest.mark.browser, pytest.mark.slow]

SHOTS = ROOT / "artifacts" / "screenshots"
TOKEN = "browser-test-token-5f1c2a"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
APP = "examples.orders.app:service"
TXBOX = Path(sys.executable).parent / "txbox"  # the installed command, as users run it


def _env(database_url: str, amqp_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "TXBOX_SERVICE": "order-service",
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_CONTRACTS_DIR": str(CONTRACTS),
        "TXBOX_DASHBOARD_TOKEN": TOKEN,
        "TXBOX_WORKER_POLL_INTERVAL": "200ms",
        "TXBOX_COLLECTOR_RESOLVE_INTERVAL": "200ms",
        "PYTHONUNBUFFERED": "1",
    }


class Processes:
    """Daemons started through the `txbox` command; all stopped (SIGTERM, then kill) at the end."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.running: list[subprocess.Popen[bytes]] = []

    def start(self, name: str, args: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        log = (self.logs / f"{name}.log").open("wb")
        proc = subprocess.Popen([str(TXBOX), *args], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        self.running.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.running:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.running:
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def output(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.logs.glob("*.log")))


@pytest.fixture
def processes(tmp_path: Path) -> Iterator[Processes]:
    procs = Processes(tmp_path)
    try:
        yield procs
    finally:
        procs.stop()


def _inbox(
    conn: psycopg.Connection[Any],
    message_type: str,
    routing_key: str,
    aggregate: tuple[str, str],
    payload: dict[str, Any],
) -> uuid.UUID:
    """Store a delivery as the receiver does (the broker leg is tested elsewhere)."""
    mid = uuid.uuid4()
    kind = "command" if message_type == "PlaceOrder" else "event"
    conn.execute(
        """INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
               message_context, metadata, segment, message_timestamp, queue)
           VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, 'order-service:inbox')""",
        (
            mid, message_type, aggregate[0], aggregate[1], kind, routing_key, json.dumps(payload),
            json.dumps({"example_correlation_id": str(uuid.uuid4())}),
            json.dumps({"auth_token": "eyJhbGciOiJIUzI1NiJ9.c2VjcmV0LXVzZXI.c2lnbmF0dXJl"}),
            f"{aggregate[0]}:{aggregate[1]}", datetime.now(UTC),
        ),
    )  # fmt: skip
    return mid


def test_replay_a_dead_letter_from_the_browser(
    database_url: str, amqp_url: str, processes: Processes, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    from examples import migrate as example_migrate

    example_migrate.upgrade("orders", database_url)
    env = _env(database_url, amqp_url)
    conn = psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row)
    SHOTS.mkdir(parents=True, exist_ok=True)
    try:
        lid = _a_dead_letter(conn, processes, env)
        base = _serve_dashboard(processes, env)
        with sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
            try:
                page = browser.new_page(viewport={"width": 1400, "height": 900})
                page.set_default_timeout(20_000)
                _log_in_and_find(page, base, lid)
                _replay(page, base, lid)
            finally:
                browser.close()

        order = conn.execute("SELECT status, final_transitions FROM orders WHERE id = 'o-1'").fetchone()
        assert order == {"status": "completed", "final_transitions": 1}
        # Replaying again (API) is refused: the effect is never applied twice.
        req = urllib.request.Request(
            f"{base}/api/letters/order-service/{lid}/replay",
            method="POST",
            headers={"Authorization": f"Bearer {TOKEN}"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            assert json.loads(r.read())["outcomes"][0]["detail"] == "already resolved"
        assert (
            conn.execute("SELECT final_transitions FROM orders WHERE id = 'o-1'").fetchone()["final_transitions"] == 1
        )
    finally:
        conn.close()


def test_a_tenants_letters_in_the_browser(database_url: str, processes: Processes, tmp_path: Path) -> None:
    """With a tenant registry (two schemas of the test database), the tenants page links to
    each tenant's letters; the page names the tenant, shows its letter only, and its
    links keep the tenant (docs/how-to/tenants.md, "The dashboard per tenant")."""
    from playwright.sync_api import expect, sync_playwright

    from tests.integration.dead_letters import seed

    conn = psycopg.connect(conninfo(database_url), autocommit=True, row_factory=dict_row)
    try:
        _, registry = seed.two_tenants(conn, database_url, tmp_path)
    finally:
        conn.close()
    env = {**_env(database_url, "amqp://unused"), "TXBOX_TENANTS_FILE": str(registry)}
    env.pop("TXBOX_DASHBOARD_TOKEN")  # read-only on loopback: no login needed to look
    base = _serve_dashboard(processes, env)
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.set_default_timeout(20_000)
            page.goto(base + "/")
            expect(page.locator("h1")).to_have_text("Tenants")
            page.screenshot(path=SHOTS / "tenants-1-list.png", full_page=True)
            page.click("tr[data-tenant=globex] >> text=globex")
            expect(page.locator("p.count")).to_have_text("1 open dead letter")
            expect(page.locator("header [data-tenant=globex]")).to_have_text("tenant globex")
            expect(page.locator("table.letters")).to_contain_text("ValueError: globex")
            expect(page.locator("table.letters")).not_to_contain_text("KeyError")
            page.screenshot(path=SHOTS / "tenants-2-letters.png", full_page=True)
            page.click("table.letters >> text=ValueError: globex")
            assert "tenant=globex" in page.url
            expect(page.locator("pre.error-text")).to_contain_text("ValueError: globex")
            page.click("nav >> text=Failure groups")
            assert "tenant=globex" in page.url
            expect(page.locator("table.groups")).to_contain_text("ValueError: globex")
        finally:
            browser.close()


def _a_dead_letter(conn: psycopg.Connection[Any], processes: Processes, env: dict[str, str]) -> int:
    """The worker abandons StockReserved for an order it does not know yet, then the order
    comes: the letter's id, whose replay now succeeds."""
    processes.start("worker", ["worker", "--app", APP], env)
    processes.start("collector", ["collector", "--app", APP], env)
    reserved = {"order_id": "o-1", "sku": "SKU-1", "quantity": 1}
    early = _inbox(conn, "StockReserved", "inventory-service.stock.reserved", ("stock", "o-1"), reserved)
    letter = support.wait_until(
        lambda: conn.execute("SELECT id FROM txbox.dead_letters WHERE message_id = %s", (early,)).fetchone(),
        timeout=60,
        message="the worker to abandon StockReserved for an unknown order:\n" + processes.output(),
    )
    _inbox(
        conn,
        "PlaceOrder",
        "order-service.order.place",
        ("order", "o-1"),
        {"customer": "ada", "sku": "SKU-1", "quantity": 1},
    )
    support.wait_until(
        lambda: conn.execute("SELECT status FROM orders WHERE id = 'o-1'").fetchone(),
        timeout=60,
        message="PlaceOrder o-1 processed",
    )
    lid: int = letter["id"]
    return lid


def _serve_dashboard(processes: Processes, env: dict[str, str]) -> str:
    """`txbox dashboard` as a process, once it answers: its address."""
    port = free_port()
    processes.start("dashboard", ["dashboard", "--app", APP, "--port", str(port)], env)
    base = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    support.wait_until(healthy, timeout=60, message="the dashboard to answer:\n" + processes.output())
    return base


def _log_in_and_find(page: Any, base: str, lid: int) -> None:
    """Log in (a wrong token first), then from the overview to the letter through its group
    and the filtered list; the letter's page shows no credential."""
    from playwright.sync_api import expect

    page.goto(base + "/")
    expect(page.locator("h1")).to_have_text("Log in")  # viewing needs the token
    assert "/login?next=" in page.url
    page.fill("input[name=token]", "not-the-token-0123456789")
    page.click("button:has-text('Log in')")
    expect(page.locator("p.error")).to_have_text("wrong token")
    page.fill("input[name=token]", TOKEN)
    page.click("button:has-text('Log in')")
    expect(page.locator("h2", has_text="order-service")).to_be_visible()
    expect(page.locator(".stat.bad .n")).to_have_text("1")
    assert page.locator("svg.chart").count() == 2
    page.screenshot(path=SHOTS / "1-overview.png", full_page=True)

    page.click("text=Failure groups")
    expect(page.locator("table.groups")).to_contain_text("StockReserved for unknown order o-1")
    page.screenshot(path=SHOTS / "2-groups.png", full_page=True)

    page.click("nav >> text=Dead letters")
    page.select_option("select[name=message_type]", "StockReserved")
    page.click("button:has-text('Filter')")
    expect(page.locator("p.count")).to_have_text("1 open dead letter")
    assert "message_type=StockReserved" in page.url
    page.screenshot(path=SHOTS / "3-list-filtered.png", full_page=True)

    page.click(f"table.letters >> text={lid}")
    expect(page.locator("h1")).to_contain_text(f"Dead letter {lid}")
    expect(page.locator("pre.error-text")).to_contain_text("unknown order o-1")
    body = page.content()
    assert "c2VjcmV0LXVzZXI" not in body and "auth_token" not in body
    page.screenshot(path=SHOTS / "4-detail-open.png", full_page=True)


def _replay(page: Any, base: str, lid: int) -> None:
    """From the letter's page: confirm the replay, see it resolved, log out."""
    from playwright.sync_api import expect

    page.click("text=Replay…")
    expect(page.locator(".preview")).to_contain_text("StockReserved")
    expect(page.locator("h1")).to_contain_text(f"Replay dead letter {lid}?")
    page.screenshot(path=SHOTS / "5-confirm-replay.png", full_page=True)

    page.click("button:has-text('Confirm replay')")
    expect(page.locator("p.flash")).to_contain_text("inbox-reset")

    def resolved() -> bool:
        page.reload()
        return bool(page.locator("h1 .status").inner_text() == "resolved")

    support.wait_until(resolved, timeout=60, interval=0.5, message="the replayed letter to be resolved")
    page.screenshot(path=SHOTS / "6-detail-resolved.png", full_page=True)
    expect(page.locator("text=Replay…")).to_have_count(0)
    expect(page.locator("table.history")).to_contain_text("inbox-reset")

    page.goto(base + "/")
    expect(page.locator(".stat.bad")).to_have_count(0)
    page.screenshot(path=SHOTS / "7-overview-after.png", full_page=True)

    page.click("button:has-text('log out')")
    expect(page.locator("h1")).to_have_text("Log in")
    page.goto(base + f"/letters/order-service/{lid}")
    expect(page.locator("h1")).to_have_text("Log in")  # the session is gone
