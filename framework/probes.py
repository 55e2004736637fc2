"""One small HTTP server per process: ``/metrics``, ``/healthz`` and ``/readyz``.

``/healthz`` is 200 while every daemon of the process makes progress, 503 once one has
not for longer than the stuck bound (a hung handler, a deadlocked loop: restarting
helps). ``/readyz`` is 200 only while every daemon has its dependencies (PostgreSQL;
RabbitMQ with the topology declared, for the daemons that use it): an outage makes a
pod unready, not restarted (docs/explanation/operations.md, "Probes, logs and liveness"). Both
answer JSON saying which daemon is at fault.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from framework.daemon import Daemon
from framework.errors import ConfigurationError
from framework.redaction import mask_credentials


def health(daemons: Sequence[Daemon], stuck_after: float) -> tuple[bool, dict[str, Any]]:
    """(healthy, body): healthy unless a daemon made no progress for ``stuck_after`` seconds."""
    report: dict[str, Any] = {}
    for daemon in daemons:
        stuck = daemon.stuck_for(stuck_after)
        report[daemon.name] = {"stuck": stuck is not None, "seconds_since_progress": round(daemon.idle_for(), 3)}
    healthy = not any(entry["stuck"] for entry in report.values())
    return healthy, {"status": "ok" if healthy else "stuck", "stuck_after": stuck_after, "daemons": report}


def readiness(daemons: Sequence[Daemon]) -> tuple[bool, dict[str, Any]]:
    """(ready, body); ``waiting`` names the daemons that are ready yet wait (a receiver
    standing by, or taking over from a consumer still counted), and for how long."""
    ready = all(daemon.ready() for daemon in daemons)
    body: dict[str, Any] = {
        "status": "ready" if ready else "not ready",
        "daemons": {d.name: d.readiness() for d in daemons},
    }
    waiting = {d.name: w for d in daemons if (w := d.waiting()) is not None}
    if waiting:
        body["waiting"] = waiting
    return ready, body


class MaskedRegistry(Collector):
    """A registry as ``/metrics`` shows it: every label value through :func:`mask_credentials`.

    Label values come from rows (an outbox or inbox row's ``message_type``, whatever
    wrote it), so one can quote a URL or a DSN; masked here, where the text leaves the
    process, whichever metric carries it (docs/explanation/operations.md, "Secrets"). Two values
    that differ only in a password would show as one series twice: never for a type
    of the contracts, which a URL is not.
    """

    def __init__(self, registry: Collector) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            family.samples = [
                s._replace(labels={k: mask_credentials(v) for k, v in s.labels.items()}) for s in family.samples
            ]
            yield family


_SHOWN = MaskedRegistry(REGISTRY)


class ProbeServer:
    """``ThreadingHTTPServer`` on ``(addr, port)`` in a daemon thread; :meth:`close` stops it."""

    def __init__(self, daemons: Sequence[Daemon], port: int, addr: str, stuck_after: float) -> None:
        self.daemons = list(daemons)
        self.stuck_after = stuck_after
        handler = _handler(self)
        server_class = _V6Server if ":" in addr else ThreadingHTTPServer
        try:
            self._server = server_class((addr, port), handler)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve the metrics and probes on {addr}:{port} ({exc}); choose a free port with "
                "--metrics-port, or an address of this host with --metrics-addr / TXBOX_METRICS_ADDR "
                "(0.0.0.0 in a pod)"
            ) from None
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="txbox probes", daemon=True)

    def start(self) -> ProbeServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def _handler(probes: ProbeServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(_SHOWN))
            elif path == "/healthz":
                self._json(*health(probes.daemons, probes.stuck_after))
            elif path == "/readyz":
                self._json(*readiness(probes.daemons))
            else:
                self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics, /healthz or /readyz\n")

        def _json(self, ok: bool, body: dict[str, Any]) -> None:
            self._send(200 if ok else 503, "application/json", json.dumps(body).encode() + b"\n")

        def _send(self, status: int, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a probe every few seconds would drown the daemon's own log

    return Handler
