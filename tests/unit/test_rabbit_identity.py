"""A private RabbitMQ node is ready only when the node answering on its ports is itself.

Decoys hold both ports the node was given before it starts (another run of the suite
beside this one): a plain listener on the AMQP port and, on the management port, a web
server answering ``/api/overview`` for another node. Our node cannot bind its port; the
decoys answer at once, so a readiness check of "something answers" would take them for it.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from txbox_tools.chaos.instances import PrivateRabbit
from txbox_tools.errors import InstanceError


class _OtherNode(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"node": "rabbit@elsewhere", "rabbitmq_version": "3.10.0"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_a_node_whose_ports_answer_for_another_node_is_not_taken_for_ready(tmp_path: Path) -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    api = ThreadingHTTPServer(("127.0.0.1", 0), _OtherNode)
    thread = threading.Thread(target=api.serve_forever, daemon=True)
    thread.start()
    port, management_port = int(listener.getsockname()[1]), int(api.server_address[1])
    node = PrivateRabbit(port=port, management_port=management_port, base_dir=tmp_path / "rabbit")
    try:
        with pytest.raises(InstanceError):
            node.start(timeout=60)  # ours cannot bind its port: it exits, or never answers as itself
    finally:
        api.shutdown()
        api.server_close()
        listener.close()
        thread.join()
        node.kill()  # after the decoys: it waits for the node's port to close


def test_a_fresh_node_whose_chosen_port_was_taken_meanwhile_chooses_again(tmp_path: Path) -> None:
    """Between choosing a free port and binding it, another process took it (eaddrinuse)."""
    node = PrivateRabbit(base_dir=tmp_path / "rabbit", small=True)
    taken = node.port
    thief = socket.socket()
    thief.bind(("127.0.0.1", taken))
    thief.listen()
    try:
        node.start(timeout=120)
        assert node.port != taken and node.node == f"txbox-chaos-{node.port}@localhost"
        assert node.boot_failures and "exited" in node.boot_failures[0]
    finally:
        thief.close()
        node.kill()
