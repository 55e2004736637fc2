"""How the dashboard is served: uvicorn with limits, for `txbox dashboard`, benchmarks and tests.

Limits (docs/explanation/operations.md, "Secrets"): at most ``max_connections`` concurrent
connections (more get 503), request headers within ``header_timeout`` of connecting or
of the previous response (uvicorn has no such timer: a client trickling headers would
hold a connection forever), headers of at most 16 KiB, idle keep-alive closed after 5 s.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from framework.dashboard.security import SECURITY_HEADERS

MAX_HEADER_BYTES = 16 * 1024


def plain_response(status: int, reason: str, text: str) -> bytes:
    """A whole HTTP/1.1 response, closing, with the security headers every page carries."""
    body = text.encode("utf-8")
    headers = {
        "content-type": "text/plain; charset=utf-8",
        "content-length": str(len(body)),
        "connection": "close",
        "cache-control": "no-store",
        **SECURITY_HEADERS,
    }
    head = f"HTTP/1.1 {status} {reason}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return head.encode("latin-1") + b"\r\n" + body


class HeaderTimeoutProtocol(H11Protocol):
    """h11 with a deadline for a request's headers (armed at connect and after each
    response), a bound on open connections, and the security headers on the answers the
    protocol gives itself (a malformed request's 400, the connection limit's 503), which
    never reach the app's middleware."""

    header_timeout = 10.0  # set per server by :func:`protocol_with`
    max_connections = 64
    _header_timer: asyncio.TimerHandle | None = None
    _waiting_for: Any = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.max_connections:  # this one counts already
            transport.write(plain_response(503, "Service Unavailable", "too many connections: try again later"))
            transport.close()
            return
        self._arm()

    def send_400_response(self, msg: str) -> None:
        self.transport.write(plain_response(400, "Bad Request", msg))
        self.transport.close()

    def _arm(self) -> None:
        self._waiting_for = self.cycle
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        timer = getattr(self, "_header_timer", None)
        if timer is not None:
            timer.cancel()
            self._header_timer = None

    def _headers_late(self) -> None:
        if self.cycle is self._waiting_for and not self.transport.is_closing():
            self.transport.close()  # no complete request in time: a slow or idle client

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not self._waiting_for:
            self._disarm()  # headers complete: the request runs

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete:
            self._disarm()
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_with(header_timeout: float, max_connections: int) -> type[HeaderTimeoutProtocol]:
    return type(
        "DashboardProtocol",
        (HeaderTimeoutProtocol,),
        {"header_timeout": float(header_timeout), "max_connections": int(max_connections)},
    )


def config(
    app: Starlette,
    host: str,
    port: int,
    *,
    max_connections: int = 64,
    header_timeout: float = 10.0,
    **extra: Any,
) -> uvicorn.Config:
    """The one uvicorn configuration of the dashboard (the command and :func:`serving` share it)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=protocol_with(header_timeout, max_connections),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        timeout_keep_alive=5,
        log_level="warning",
        access_log=False,
        server_header=False,
        **extra,
    )


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def serving(
    app: Starlette,
    host: str = "127.0.0.1",
    port: int | None = None,
    *,
    max_connections: int = 64,
    header_timeout: float = 10.0,
) -> Iterator[str]:
    """Yields the base URL once the server accepts connections; stops it on exit."""
    port = port or free_port(host)
    server = uvicorn.Server(config(app, host, port, max_connections=max_connections, header_timeout=header_timeout))
    thread = threading.Thread(target=server.run, name="txbox-dashboard", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError(f"the dashboard did not start on {host}:{port}")
        time.sleep(0.02)
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
