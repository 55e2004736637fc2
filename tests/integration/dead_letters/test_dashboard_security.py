"""The dashboard is closed to strangers: each protection over plain HTTP, against a real database."""

from __future__ import annotations

import socket
import urllib.parse
from collections.abc import Iterator
from http.client import HTTPConnection
from typing import Any

import pytest

from framework.dashboard.app import DashboardSettings, Source, create_app
from framework.dashboard.security import SECURITY_HEADERS
from framework.dashboard.server import serving
from tests import support
from tests.conftest import CONTRACTS
from tests.integration.dead_letters import seed
from tests.integration.dead_letters.test_dashboard import TOKEN, _login, _source, cookie_named, http, login_form

BEARER = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def secured(database_url: str) -> Iterator[str]:
    """The dashboard as `txbox dashboard` starts it with TXBOX_DASHBOARD_TOKEN set and nothing else."""
    with serving(create_app([_source(database_url)], DashboardSettings(token=TOKEN))) as url:
        yield url


def _port(base: str) -> int:
    return int(base.rsplit(":", 1)[1])


def raw_request(base: str, method: str, path: str, headers: dict[str, str], body: bytes = b"") -> tuple[int, Any]:
    """A request with exactly these headers (urllib would add its own Host)."""
    conn = HTTPConnection("127.0.0.1", _port(base), timeout=30)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        for k, v in headers.items():
            conn.putheader(k, v)
        conn.endheaders(body or None)
        resp = conn.getresponse()
        resp.read()
        return resp.status, resp.headers
    finally:
        conn.close()


def test_with_a_token_every_page_and_the_api_need_it_by_default(secured: str, conn: Any) -> None:
    lid = seed.abandoned(conn, "inbox", seed.envelope())
    for path in ("/", "/groups", "/letters", f"/letters/order-service/{lid}", f"/letters/order-service/{lid}/replay"):
        status, headers, _ = http(secured + path)
        assert status == 303 and headers["location"].startswith("/login?next="), path
    for path in ("/api/overview", "/api/groups", "/api/letters", f"/api/letters/order-service/{lid}"):
        status, _, body = http(secured + path)
        assert status == 401 and "order-service" not in body, path
        assert http(secured + path, headers={"Authorization": "Bearer " + "x" * len(TOKEN)})[0] == 401
        assert http(secured + path, headers=BEARER)[0] == 200, path
    assert http(secured + "/letters", headers=_login(secured))[0] == 200
    assert http(secured + "/healthz")[0] == 200 and http(secured + "/static/style.css")[0] == 200


@pytest.mark.parametrize("host", ["evil.example", "evil.example:8470", "127.0.0.1.nip.io", "", "[::2]:80"])
def test_a_foreign_host_header_gets_400(secured: str, host: str) -> None:
    """DNS rebinding: a page of evil.example, re-resolved to 127.0.0.1, sends its own name."""
    headers = {"Host": host, **BEARER} if host else BEARER
    status, got = raw_request(secured, "GET", "/api/letters", headers)
    assert status == 400
    if host:  # without any Host, HTTP/1.1 itself (h11) refuses the request before the app
        assert got["x-frame-options"] == "DENY" and "default-src 'none'" in got["content-security-policy"]
    for good in (f"127.0.0.1:{_port(secured)}", f"localhost:{_port(secured)}", f"[::1]:{_port(secured)}"):
        assert raw_request(secured, "GET", "/api/letters", {"Host": good, **BEARER})[0] == 200, good


def test_more_host_names_can_be_allowed(database_url: str) -> None:
    settings = DashboardSettings(token=TOKEN, allowed_hosts="dlq.example.com")
    with serving(create_app([_source(database_url)], settings)) as base:
        assert raw_request(base, "GET", "/api/letters", {"Host": "DLQ.example.com:443", **BEARER})[0] == 200
        assert raw_request(base, "GET", "/api/letters", {"Host": "other.example.com", **BEARER})[0] == 400


def test_login_is_throttled_with_backoff(secured: str) -> None:
    cookie, csrf = login_form(secured)

    def attempt(token: str) -> tuple[int, dict[str, str]]:
        status, headers, _ = http(secured + "/login", data={"token": token, "csrf": csrf, "next": "/"}, headers=cookie)
        return status, headers

    for _ in range(5):
        assert attempt("wrong-token-0123456789")[0] == 401
    status, headers = attempt(TOKEN)  # even the right token waits now
    assert status == 429 and int(headers["retry-after"]) >= 1
    assert "txbox_session=" not in headers.get("set-cookie", "")
    # Once the wait is over, the right token works (polling does not count as failures).
    support.wait_until(lambda: attempt(TOKEN)[0] == 303, timeout=10, interval=0.2, message="the backoff to end")
    for _ in range(5):
        assert attempt("wrong-token-0123456789")[0] == 401  # a success cleared the record
    assert attempt("wrong-token-0123456789")[0] == 429


def test_login_needs_its_csrf_token(secured: str) -> None:
    cookie, csrf = login_form(secured)
    assert http(secured + "/login", data={"token": TOKEN, "next": "/"})[0] == 403  # no cookie, no field
    assert http(secured + "/login", data={"token": TOKEN, "csrf": csrf}, headers=cookie | {"Cookie": ""})[0] == 403
    assert http(secured + "/login", data={"token": TOKEN, "csrf": "forged"}, headers=cookie)[0] == 403
    assert http(secured + "/login", data={"token": TOKEN, "csrf": csrf}, headers=cookie)[0] == 303


def test_sessions_are_random_and_revoked_by_logout(secured: str) -> None:
    first, second = _login(secured), _login(secured)
    assert first != second
    assert http(secured + "/letters", headers=first)[0] == 200
    # Logout needs the session's CSRF token: a cross-site form cannot log anyone out.
    assert http(secured + "/logout", data={"csrf": "forged"}, headers=first)[0] == 403
    assert http(secured + "/letters", headers=first)[0] == 200
    page = http(secured + "/letters", headers=first)[2]
    csrf = page.split('action="/logout"', 1)[1].split('name="csrf" value="', 1)[1].split('"', 1)[0]
    status, headers, _ = http(secured + "/logout", data={"csrf": csrf}, headers=first)
    assert status == 303 and "txbox_session=" in headers["set-cookie"]
    assert http(secured + "/letters", headers=first)[0] == 303  # the old cookie is dead on the server
    assert http(secured + "/letters", headers=second)[0] == 200  # another login is untouched


def test_sessions_expire(database_url: str) -> None:
    settings = DashboardSettings(token=TOKEN, session_ttl=0.5)  # type: ignore[arg-type]
    with serving(create_app([_source(database_url)], settings)) as base:
        cookie = _login(base)
        assert http(base + "/letters", headers=cookie)[0] == 200
        support.wait_until(lambda: http(base + "/letters", headers=cookie)[0] == 303, timeout=10)


def test_cookies_are_secure_when_configured_or_behind_tls(database_url: str, secured: str) -> None:
    cookie, csrf = login_form(secured)
    status, headers, _ = http(secured + "/login", data={"token": TOKEN, "csrf": csrf}, headers=cookie)
    assert status == 303 and "Secure" not in cookie_named(headers, "txbox_session")  # plain HTTP on loopback
    # Behind a TLS-terminating proxy on this host (uvicorn trusts X-Forwarded-Proto from 127.0.0.1).
    tls = {**cookie, "X-Forwarded-Proto": "https"}
    status, headers, _ = http(secured + "/login", data={"token": TOKEN, "csrf": csrf}, headers=tls)
    assert status == 303 and "Secure" in cookie_named(headers, "txbox_session")
    settings = DashboardSettings(token=TOKEN, secure_cookies=True)
    with serving(create_app([_source(database_url)], settings)) as base:
        status, headers, _ = http(base + "/login")
        assert "Secure" in cookie_named(headers, "txbox_login")


def test_bodies_are_limited_before_parsing(secured: str) -> None:
    cookie, csrf = login_form(secured)
    # A 60 MB form announced by Content-Length: refused before a byte of it is read.
    status, got = raw_request(
        secured, "POST", "/login", {"Host": "127.0.0.1", "Content-Length": str(60 * 2**20), **cookie}, b"token=x"
    )
    assert status == 413 and got["x-content-type-options"] == "nosniff"
    # Chunked (no length): counted while read, refused past the limit.
    conn = HTTPConnection("127.0.0.1", _port(secured), timeout=30)
    try:
        filler = urllib.parse.urlencode({"token": TOKEN, "csrf": csrf, "pad": "x" * 70_000}).encode()
        conn.request(
            "POST",
            "/login",
            body=iter([filler[i : i + 8192] for i in range(0, len(filler), 8192)]),
            headers={"Content-Type": "application/x-www-form-urlencoded", **cookie},
            encode_chunked=True,
        )
        assert conn.getresponse().status == 413
    finally:
        conn.close()
    assert http(secured + "/login", data={"token": TOKEN, "csrf": csrf, "pad": "x" * 1000}, headers=cookie)[0] == 303


def test_headers_must_arrive_in_time_and_connections_are_limited(database_url: str) -> None:
    app = create_app([_source(database_url)], DashboardSettings(token=TOKEN))
    with serving(app, max_connections=4, header_timeout=0.5) as base:
        slow = socket.create_connection(("127.0.0.1", _port(base)), timeout=10)
        try:
            slow.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
            assert slow.recv(1024) == b""  # closed by the server at the header timeout, not by our 10 s
        finally:
            slow.close()
        idle = [socket.create_connection(("127.0.0.1", _port(base)), timeout=10) for _ in range(4)]
        try:
            support.wait_until(
                lambda: http(base + "/healthz")[0] == 503, timeout=5, message="the connection limit to answer 503"
            )
            _, headers, _ = http(base + "/healthz")
            for name, value in SECURITY_HEADERS.items():  # the protocol's own answer, not the app's
                assert headers[name] == value, name
        finally:
            for s in idle:
                s.close()
        support.wait_until(lambda: http(base + "/healthz")[0] == 200, timeout=10, message="room again")


def test_error_pages_carry_the_security_headers(secured: str, database_url: str) -> None:
    status, got = raw_request(secured, "GET", "/", {})  # no Host at all: refused by the protocol, not the app
    assert status == 400
    for name, value in SECURITY_HEADERS.items():
        assert got[name] == value, ("no Host", name)
    for path, headers, expected in (
        ("/nope", BEARER, 404),
        ("/api/letters?page=x", BEARER, 400),
        ("/api/letters", {}, 401),
        ("/letters/order-service/999", BEARER, 404),
    ):
        status, got, _ = http(secured + path, headers=headers)
        assert status == expected, path
        for name, value in SECURITY_HEADERS.items():
            assert got[name] == value, (path, name)

    class Broken(Source):
        @property
        def engine(self) -> Any:  # a bug, not a database outage
            raise RuntimeError("secret=hunter2 in a bug's message")

    with serving(create_app([Broken("order-service", database_url, schema="txbox", contracts_dir=CONTRACTS)])) as b:
        status, got, body = http(b + "/letters")
        assert status == 500 and "hunter2" not in body and "Traceback" not in body
        for name, value in SECURITY_HEADERS.items():
            assert got[name] == value, name


def test_no_get_writes_to_the_database(database_url: str, conn: Any) -> None:
    """Every page and API read works on a read-only connection (any write would fail it)."""
    lid = seed.abandoned(conn, "inbox", seed.envelope())
    done = seed.abandoned(conn, "inbox", seed.envelope())
    # A replayed letter whose message got processed since: the old dashboard resolved it on GET.
    conn.execute("UPDATE txbox.dead_letters SET replayed_at = now(), replay_count = 1 WHERE id = %s", (done,))
    conn.execute(
        "UPDATE txbox.inbox SET processed_at = now(), abandoned_at = NULL "
        "WHERE id = (SELECT message_id FROM txbox.dead_letters WHERE id = %s)",
        (done,),
    )
    fp = conn.execute("SELECT fingerprint FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()["fingerprint"]
    read_only = database_url + "?options=" + urllib.parse.quote("-c default_transaction_read_only=on")
    settings = DashboardSettings(token=TOKEN)
    with serving(create_app([_source(read_only)], settings)) as base:
        for path in (
            "/",
            "/groups",
            "/letters?status=all",
            f"/letters/order-service/{lid}",
            f"/letters/order-service/{done}",
            f"/letters/order-service/{lid}/replay",
            f"/groups/order-service/{fp}/discard",
            "/api/overview",
            "/api/groups",
            "/api/letters",
            f"/api/letters/order-service/{lid}",
        ):
            status, _, body = http(base + path, headers=BEARER)
            assert status == 200, (path, body[:500])
        # The replay itself is a POST, and does write: it fails on this connection.
        status, _, body = http(base + f"/api/letters/order-service/{lid}/replay", method="POST", headers=BEARER)
        assert status >= 500
    assert (
        conn.execute("SELECT replay_count FROM txbox.dead_letters WHERE id = %s", (lid,)).fetchone()["replay_count"]
        == 0
    )
