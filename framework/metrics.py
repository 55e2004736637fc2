"""Prometheus metrics: every daemon's metrics live in the default registry.

``--metrics-port`` on a daemon serves them at ``http://127.0.0.1:<port>/metrics``.
Metric names start with ``txbox_``; define them in the module of the part they measure.
"""

from __future__ import annotations

from prometheus_client import start_http_server


def serve(port: int | None, addr: str = "127.0.0.1") -> None:
    if port:
        start_http_server(port, addr=addr)
