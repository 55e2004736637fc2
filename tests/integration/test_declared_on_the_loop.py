"""The receiver and the relay declare their topology on their own broker connection, on
the loop (docs/explanation/daemons.md, "One loop per process"): a RabbitMQ node that takes
the connection and never answers holds up that daemon's session only, never the loop the
other daemons of `txbox run` share; a topology RabbitMQ refuses ends the daemon with the
fix, instead of a retry that would be refused again."""

from __future__ import annotations

import dataclasses
import select
import socket
import threading
from collections.abc import Callable, Iterator

import pika
import pytest
from pika.adapters.select_connection import IOLoop

from framework import names, topology
from framework.daemon import Daemon
from framework.errors import TopologyMismatch
from framework.receiver import Receiver, ReceiverConfig
from framework.relay import Relay, RelayConfig
from framework.service import Service
from framework.settings import Settings
from tests import support

DEADLINE = 60.0  # seconds: a bound on the test, not a measurement


class SilentNode:
    """A TCP server that accepts connections and never says a word: a RabbitMQ node that
    is up at the socket's level and gone at the protocol's. ``open_now`` counts the
    connections its clients have not closed yet."""

    def __init__(self) -> None:
        self._server = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._server.getsockname()[1])
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent node", daemon=True)
        self._thread.start()

    @property
    def open_now(self) -> int:
        with self._lock:
            return len(self._open)

    def _serve(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                watched = [self._server, *self._open]
            readable, _, _ = select.select(watched, [], [], 0.1)
            for sock in readable:
                if sock is self._server:
                    client, _ = self._server.accept()
                    with self._lock:
                        self._open.add(client)
                elif not _read(sock):
                    with self._lock:
                        self._open.discard(sock)
                    sock.close()

    def drop(self) -> None:
        """Close the connections open now, as a node that finally goes away."""
        with self._lock:
            dropped, self._open = self._open, set()
        for sock in dropped:
            sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        with self._lock:
            for sock in self._open:
                sock.close()
        self._server.close()


def _read(sock: socket.socket) -> bool:
    """Read what the client sent (the AMQP header, never answered); False once it closed."""
    try:
        return bool(sock.recv(4096))
    except OSError:
        return False


@pytest.fixture
def silent_node() -> Iterator[SilentNode]:
    node = SilentNode()
    yield node
    node.close()


def run_until(
    daemon: Daemon, watch: Callable[[], bool], before_stop: Callable[[], None] = lambda: None
) -> BaseException | str | None:
    """Start ``daemon`` on a loop of this thread's and run it until ``watch()`` (called on
    the loop every 50 ms) returns True, then (after ``before_stop()``) stop it; what ended
    it, or "running" if the watch said so first."""
    loop = IOLoop()
    ended: list[BaseException | None] = []
    seen: list[bool] = []

    def finished(exc: BaseException | None) -> None:
        ended.append(exc)
        loop.stop()

    def look() -> None:
        if ended:
            return
        if watch():
            seen.append(True)
            loop.stop()
            return
        loop.call_later(0.05, look)

    loop.call_later(DEADLINE, loop.stop)
    loop.call_later(0.05, look)
    try:
        daemon.start_on(loop, finished)
        if not ended:
            loop.start()
        if not ended:
            before_stop()
            daemon.stop()
            loop.call_later(DEADLINE, loop.stop)
            loop.start()
    finally:
        loop.close()
    if seen:
        return "running"
    return ended[0] if ended else None


def receiver(service: Service) -> Daemon:
    return Receiver(service, ReceiverConfig())


def relay(service: Service) -> Daemon:
    return Relay(service, RelayConfig())


@pytest.mark.parametrize("make", [receiver, relay])
def test_a_node_that_never_answers_leaves_the_loop_free(
    settings: Settings, vhost: str, silent_node: SilentNode, make: Callable[[Service], Daemon]
) -> None:
    """The loop runs its other callbacks while the daemon's connection waits on the
    silent node: a declaration with a blocking connection (pika waits 15 s for a
    handshake) would hold the loop until the connection gave up, and a callback would only
    ever find the node with no connection of the daemon's open."""
    url = f"amqp://guest:guest@127.0.0.1:{silent_node.port}/{support.vhost_path(vhost)}"
    daemon = make(Service(settings=dataclasses.replace(settings, amqp_url=url)))
    # Once seen, the node goes away, so that the stop need not wait out pika's handshake.
    outcome = run_until(daemon, lambda: silent_node.open_now > 0, before_stop=silent_node.drop)
    assert outcome == "running", f"the loop never ran while the daemon waited on the node: {outcome!r}"


@pytest.mark.parametrize("make", [receiver, relay])
def test_a_refused_topology_ends_the_daemon_with_the_fix(
    service: Service, vhost: str, make: Callable[[Service], Daemon]
) -> None:
    """The inbox queue exists as a classic queue and the service asks for a quorum one:
    RabbitMQ refuses the declaration on the daemon's channel, and the daemon ends with a
    TopologyMismatch that names the setting, rather than reconnecting for ever."""
    if service.settings.queue_type != "quorum":
        service = Service(settings=dataclasses.replace(service.settings, queue_type="quorum"))
    queue = names.inbox_queue(service.settings.service)
    [inbox] = [q for q in topology.plan(service.settings, service.registry).queues if q.name == queue]
    connection = pika.BlockingConnection(pika.URLParameters(service.settings.amqp_url))
    try:  # the queue as txbox declares it, but for its type
        connection.channel().queue_declare(
            queue, durable=True, arguments={**inbox.arguments, "x-queue-type": "classic"}
        )
    finally:
        connection.close()
    outcome = run_until(make(service), lambda: False)
    assert isinstance(outcome, TopologyMismatch), outcome
    assert "TXBOX_QUEUE_TYPE=classic" in str(outcome)
    assert support.queue_info(vhost, queue)["type"] == "classic"  # nothing was changed
