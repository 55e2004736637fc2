"""Who may see and change what, and the protections every request passes through.

One shared secret, ``TXBOX_DASHBOARD_TOKEN`` (at least :data:`MIN_TOKEN_LENGTH`
characters). API clients send it as ``Authorization: Bearer <token>``; people paste it
once into the login form and get a server-side session: a random id in an HttpOnly,
SameSite=Strict cookie (``Secure`` when configured or served over TLS) that expires
after ``TXBOX_DASHBOARD_SESSION_TTL`` and is revoked by logging out. Each session has its
own random CSRF token, checked on every state-changing form POST, logout included; the
login form carries a double-submit CSRF token (cookie + field) of its own. Failed logins
are throttled per client with exponential backoff. Without a configured token, replay
and discard are refused (403): a dashboard nobody secured must not change data.

:class:`Shield` is the outermost ASGI layer: it refuses a Host header that is not on the
allow-list (DNS rebinding: a page of ``evil.example`` resolving to 127.0.0.1 would
otherwise read the API as same-origin), refuses bodies over the size limit before
anything parses them, and puts the security headers on every response, error pages
included. See docs/explanation/operations.md, "Secrets".
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from framework.backoff import backoff_seconds

COOKIE = "txbox_session"
LOGIN_COOKIE = "txbox_login"
MIN_TOKEN_LENGTH = 16
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")

SECURITY_HEADERS = {
    "content-security-policy": (
        "default-src 'none'; style-src 'self'; img-src 'self' data:; form-action 'self'; "
        "frame-ancestors 'none'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "x-frame-options": "DENY",
    "cross-origin-resource-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}


@dataclass
class Session:
    csrf: str
    expires: float


class Sessions:
    """Server-side sessions: random ids, an expiry, revocation; at most ``limit`` kept (oldest dropped)."""

    def __init__(self, ttl: float, *, limit: int = 10_000, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl = ttl
        self.limit = limit
        self.clock = clock
        self._by_id: OrderedDict[str, Session] = OrderedDict()
        self._lock = threading.Lock()

    def create(self) -> str:
        sid = secrets.token_urlsafe(32)
        with self._lock:
            self._by_id[sid] = Session(csrf=secrets.token_urlsafe(32), expires=self.clock() + self.ttl)
            while len(self._by_id) > self.limit:
                self._by_id.popitem(last=False)
        return sid

    def get(self, sid: str) -> Session | None:
        if not sid:
            return None
        with self._lock:
            found = self._by_id.get(sid)
            if found is not None and found.expires <= self.clock():
                del self._by_id[sid]
                return None
            return found

    def revoke(self, sid: str) -> None:
        with self._lock:
            self._by_id.pop(sid, None)


@dataclass
class _Failures:
    count: int = 0
    blocked_until: float = 0.0


class LoginThrottle:
    """Failed logins per client: ``free`` tries, then each failure doubles the wait (capped).

    A success clears the client's record. Clients are kept in a bounded LRU, so a flood of
    addresses cannot grow memory without limit.
    """

    def __init__(
        self,
        *,
        free: int = 5,
        base: float = 1.0,
        cap: float = 900.0,
        limit: int = 10_000,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.free, self.base, self.cap, self.limit, self.clock = free, base, cap, limit, clock
        self._clients: OrderedDict[str, _Failures] = OrderedDict()
        self._lock = threading.Lock()

    def retry_after(self, client: str) -> float:
        """Seconds the client must wait before its next try (0: it may try now)."""
        with self._lock:
            found = self._clients.get(client)
            return max(0.0, found.blocked_until - self.clock()) if found else 0.0

    def failed(self, client: str) -> float:
        """Record a failure; returns the wait it imposes."""
        with self._lock:
            found = self._clients.pop(client, None) or _Failures()
            found.count += 1
            wait = 0.0
            if found.count >= self.free:
                wait = backoff_seconds(found.count - self.free + 1, base=self.base, cap=self.cap, jitter=0)
            found.blocked_until = self.clock() + wait
            self._clients[client] = found
            while len(self._clients) > self.limit:
                self._clients.popitem(last=False)
            return wait

    def succeeded(self, client: str) -> None:
        with self._lock:
            self._clients.pop(client, None)


@dataclass
class Auth:
    token: str | None
    view_requires_token: bool = False
    session_ttl: float = 8 * 3600.0
    secure_cookies: bool = False
    sessions: Sessions = field(init=False)
    throttle: LoginThrottle = field(default_factory=LoginThrottle)

    def __post_init__(self) -> None:
        self.sessions = Sessions(self.session_ttl)

    @property
    def enabled(self) -> bool:
        return bool(self.token)

    def check_token(self, given: str) -> bool:
        return self.enabled and hmac.compare_digest(given.encode(), (self.token or "").encode())

    def bearer(self, request: Request) -> bool:
        header = request.headers.get("authorization", "")
        scheme, _, value = header.partition(" ")
        return scheme.lower() == "bearer" and self.check_token(value.strip())

    def session(self, request: Request) -> Session | None:
        return self.sessions.get(request.cookies.get(COOKIE, "")) if self.enabled else None

    def authenticated(self, request: Request) -> bool:
        return self.enabled and (self.bearer(request) or self.session(request) is not None)

    def may_view(self, request: Request) -> bool:
        return not self.view_requires_token or self.authenticated(request)

    def csrf_token(self, request: Request) -> str:
        """The value forms embed; empty when not logged in (the form will be refused anyway)."""
        found = self.session(request)
        return found.csrf if found else ""

    def csrf_ok(self, request: Request, submitted: str) -> bool:
        if self.bearer(request):
            return True  # a header a cross-site form cannot set
        expected = self.csrf_token(request)
        return bool(expected) and hmac.compare_digest(submitted.encode(), expected.encode())

    def cookie_options(self, request: Request) -> dict[str, Any]:
        """HttpOnly, SameSite=Strict, and Secure when configured or the request came over TLS."""
        secure = self.secure_cookies or request.url.scheme == "https"
        return {"httponly": True, "samesite": "strict", "secure": secure, "path": "/"}


def client_of(request: Request) -> str:
    return request.client.host if request.client else "?"


def host_of(header: str) -> str:
    """The host part of a Host header, lower case: ``[::1]:8470`` → ``::1``, ``a.b:80`` → ``a.b``."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1 : header.find("]")] if "]" in header else ""
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


class Shield:
    """Host allow-list, body size limit, security headers: before anything else runs."""

    def __init__(self, app: ASGIApp, *, allowed_hosts: Iterable[str], max_body_bytes: int) -> None:
        self.app = app
        self.allowed = frozenset(h.strip().lower().strip("[]") for h in allowed_hosts if h.strip())
        self.any_host = "*" in self.allowed
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        send_secured = _secured(send)
        refusal = self._refusal(scope)
        if refusal is not None:
            await _plain(send_secured, *refusal)
            return
        body: bytes | None = b""
        if scope.get("method") not in ("GET", "HEAD"):
            body = await self._body(receive, send_secured)
            if body is None:
                return
        delivered = False

        async def replay() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send_secured)

    def _refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, text) for a request refused by its headers alone: an unknown Host, a body
        declared too large; None to go on."""
        host = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k == b"host"), "")
        if not self.any_host and host_of(host) not in self.allowed:
            return 400, "unknown Host header: add the name to TXBOX_DASHBOARD_ALLOWED_HOSTS"
        length = next((v for k, v in scope.get("headers", []) if k == b"content-length"), None)
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return 413, f"request body over {self.max_body_bytes} bytes"
        return None

    async def _body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole request body, read (bounded) before the app parses anything: a chunked
        body has no length. None when the client left, or the body passed the limit (then
        answered 413 through ``send``)."""
        body = b""
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_body_bytes:
                await _plain(send, 413, f"request body over {self.max_body_bytes} bytes")
                return None
        return body


def _secured(send: Send) -> Send:
    """``send`` with the security headers (and ``no-store`` unless the app chose caching)
    on every response."""

    async def send_secured(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.decode().lower() not in SECURITY_HEADERS]
            headers += [(k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items()]
            if not any(k.lower() == b"cache-control" for k, _ in headers):
                headers.append((b"cache-control", b"no-store"))
            message = {**message, "headers": headers}
        await send(message)

    return send_secured


async def _plain(send: Send, status: int, text: str) -> None:
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"text/plain; charset=utf-8"), (b"content-length", str(len(text)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": text.encode()})
