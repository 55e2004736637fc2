"""The private Spark cluster finds its own master when the ports it picked are taken.

A port picked free can be taken before the master binds it (another run of the suite
beside this one): Spark binds the next port then. Decoys take both ports here: a plain
listener on the master's port and, on the UI port, a web server answering a master's
status page for another master (one with a worker alive). The cluster must read its
master's real ports from the master's own log and judge only a page naming its URL.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tests.spark.cluster import Cluster

pytestmark = [pytest.mark.slow]

OTHER = {"url": "spark://127.0.0.1:1", "aliveworkers": 1, "status": "ALIVE", "workers": []}


class _OtherMaster(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps(OTHER).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def decoys() -> Iterator[tuple[int, int]]:
    """(master port, UI port), both taken by something that is not the cluster's master."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    page = ThreadingHTTPServer(("127.0.0.1", 0), _OtherMaster)
    thread = threading.Thread(target=page.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(listener.getsockname()[1]), int(page.server_address[1])
    finally:
        page.shutdown()
        page.server_close()
        listener.close()
        thread.join()


def test_a_cluster_whose_ports_are_taken_finds_its_own_master(tmp_path: Path, decoys: tuple[int, int]) -> None:
    taken_port, taken_ui = decoys
    cluster = Cluster(tmp_path, workers=1, port=taken_port, ui_port=taken_ui)
    try:
        cluster.start()
        assert (cluster.port, cluster.ui_port) != (taken_port, taken_ui)
        state = cluster.state()
        assert state.get("url") == cluster.master_url and state.get("aliveworkers") == 1, state
    finally:
        cluster.stop()
