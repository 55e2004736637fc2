"""A key source the tests serve themselves over loopback HTTP: a JWKS document or Mosaic's
key service, honest or hostile (docs/explanation/receive.md, "Event signing").

``answer`` is what the next request gets and may be changed while the server runs (key
rotation, a hostile turn): ``Answer(body=...)`` or one of the hostile kinds. Every request
is recorded with its path, method, Authorization header and body.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa


def b64url(number: int) -> str:
    raw = number.to_bytes((number.bit_length() + 7) // 8, "big")
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def jwk(key: rsa.RSAPrivateKey | rsa.RSAPublicKey, kid: str, **extra: Any) -> dict[str, Any]:
    """The RSA JWK of ``key`` (RFC 7517/7518), built by hand from its numbers."""
    public = key.public_key() if isinstance(key, rsa.RSAPrivateKey) else key
    numbers = public.public_numbers()
    base = {"kty": "RSA", "kid": kid, "use": "sig", "alg": "RS256", "n": b64url(numbers.n), "e": b64url(numbers.e)}
    return base | extra


def spki_b64(key: rsa.RSAPrivateKey) -> str:
    der = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return base64.b64encode(der).decode()


def key_service_answer(nodes: list[dict[str, Any]]) -> bytes:
    return json.dumps({"data": {"publicKeys": {"nodes": nodes}}}).encode()


@dataclass
class Answer:
    """What the server sends: ``kind`` is ``body`` (status + body), ``huge`` (``size`` bytes
    of JSON-looking text without a length), ``slow`` (headers, then nothing until the
    server stops), ``trickle`` (headers, then a blank now and then, never the end) or
    ``drop`` (the connection closed without an answer)."""

    body: bytes = b"{}"
    status: int = 200
    kind: str = "body"
    size: int = 0


@dataclass
class KeyServer:
    answer: Answer = field(default_factory=Answer)
    requests: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.released = threading.Event()  # set at the end: a slow answer ends
        self._lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                length = min(int(self.headers.get("Content-Length", "0") or 0), 1 << 20)
                with server._lock:
                    server.requests.append(
                        {
                            "method": self.command,
                            "path": self.path,
                            "auth": self.headers.get("Authorization"),
                            "body": self.rfile.read(length) if length else b"",
                        }
                    )
                    answer = server.answer
                if answer.kind == "drop":
                    self.close_connection = True
                    return
                self.send_response(answer.status)
                self.send_header("Content-Type", "application/json")
                if answer.kind == "body":
                    self.send_header("Content-Length", str(len(answer.body)))
                    self.end_headers()
                    self.wfile.write(answer.body)
                    return
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                if answer.kind == "slow":
                    self.wfile.write(b'{"keys": [')
                    self.wfile.flush()
                    server.released.wait(120)
                    return
                if answer.kind == "trickle":
                    # A blank every 0.2 s: each read gets a byte in time, the whole never comes.
                    with contextlib.suppress(OSError):
                        while not server.released.wait(0.2):
                            self.wfile.write(b" ")
                            self.wfile.flush()
                    return
                chunk = b'{"kid": "1", "kty": "RSA"},' * 4096
                sent = 0
                try:
                    self.wfile.write(b'{"keys": [')
                    while sent < answer.size and not server.released.is_set():
                        self.wfile.write(chunk)
                        sent += len(chunk)
                except OSError:
                    pass  # the client stopped reading: what a size cap does

            def do_GET(self) -> None:
                self._serve()

            def do_POST(self) -> None:
                self._serve()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="key server", daemon=True)

    def serve(self, body: bytes | dict[str, Any], status: int = 200) -> None:
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        with self._lock:
            self.answer = Answer(body=raw, status=status)

    def hostile(self, kind: str, size: int = 0) -> None:
        with self._lock:
            self.answer = Answer(kind=kind, size=size)

    def count(self) -> int:
        with self._lock:
            return len(self.requests)

    def __enter__(self) -> KeyServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.released.set()
        self.server.shutdown()
        self.server.server_close()
