"""`txbox run`'s supervisor: one stop reaches every daemon; one daemon dying stops the rest."""

from __future__ import annotations

import threading

from framework.cli.run import Supervisor
from framework.daemon import Daemon
from framework.service import Service
from tests.apps.counter import CONTRACTS

SERVICE = Service(
    name="counter-service",
    database_url="postgresql://postgres@127.0.0.1:5432/unused",
    amqp_url="amqp://guest:guest@127.0.0.1:5672/%2F",
    contracts_dir=CONTRACTS,
)


class Looping(Daemon):
    name = "looping"

    def __init__(self, stop_event: threading.Event) -> None:
        super().__init__(SERVICE, stop_event=stop_event)
        self.started = threading.Event()
        self.finished = False

    def run(self) -> None:
        self.started.set()
        while not self.wait(0.01):
            pass
        self.finished = True


class Failing(Looping):
    name = "failing"

    def run(self) -> None:
        self.started.set()
        raise RuntimeError("broker said no")


def shared(*kinds: type[Looping]) -> list[Daemon]:
    """Daemons sharing one stop event, as `txbox run` builds them."""
    event = threading.Event()
    return [kind(event) for kind in kinds]


def test_a_stop_request_reaches_every_daemon() -> None:
    first, second = daemons = shared(Looping, Looping)
    supervisor = Supervisor(daemons)
    supervisor.start()
    assert first.started.wait(5) and second.started.wait(5)
    supervisor.stop()
    supervisor.wait()
    assert supervisor.join(5) == []
    assert first.finished and second.finished
    assert supervisor.failures == []


def test_one_daemon_failing_stops_the_others_and_is_reported() -> None:
    healthy, _ = daemons = shared(Looping, Failing)
    supervisor = Supervisor(daemons)
    supervisor.start()
    supervisor.wait()  # returns because the failing daemon ended
    assert supervisor.join(5) == []
    assert healthy.finished
    assert [(name, str(exc)) for name, exc in supervisor.failures] == [("failing", "broker said no")]


def test_a_daemon_returning_unasked_counts_as_a_failure() -> None:
    class Quitting(Looping):
        name = "quitting"

        def run(self) -> None:
            return

    healthy, _ = daemons = shared(Looping, Quitting)
    supervisor = Supervisor(daemons)
    supervisor.start()
    supervisor.wait()
    assert supervisor.join(5) == []
    assert healthy.finished
    assert [name for name, _ in supervisor.failures] == ["quitting"]
