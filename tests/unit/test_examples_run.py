"""`txbox run`'s supervisor: its daemons share one loop on one thread; one stop reaches
every daemon; one daemon failing, ending unasked, or raising from a callback stops the rest."""

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
    """Ticks on the loop until asked to stop; records the thread its callbacks ran on."""

    name = "looping"

    def __init__(self, stop_event: threading.Event) -> None:
        super().__init__(SERVICE, stop_event=stop_event)
        self.started = threading.Event()
        self.finished = False
        self.threads: set[int] = set()

    def _begin(self) -> None:
        self.started.set()
        self._tick()

    def _tick(self) -> None:
        self.threads.add(threading.get_ident())
        if not self.ended:
            assert self.loop is not None
            self.loop.call_later(0.01, self._tick)

    def _on_stop(self) -> None:
        self.finished = True
        self._end()


class Failing(Looping):
    name = "failing"

    def _begin(self) -> None:
        self.started.set()
        assert self.loop is not None
        self.loop.call_later(0, lambda: self._end(RuntimeError("broker said no")))


class Raising(Looping):
    name = "raising"

    def _begin(self) -> None:
        self.started.set()
        assert self.loop is not None
        self.loop.call_later(0, self._boom)

    def _boom(self) -> None:
        raise RuntimeError("a bug in a callback")


class Deaf(Looping):
    name = "deaf"

    def _on_stop(self) -> None:
        pass  # never ends


def shared(*kinds: type[Looping]) -> list[Looping]:
    """Daemons sharing one stop event, as `txbox run` builds them."""
    event = threading.Event()
    return [kind(event) for kind in kinds]


def running(supervisor: Supervisor, stop_timeout: float = 30.0) -> threading.Thread:
    thread = threading.Thread(target=supervisor.run, args=(stop_timeout,))
    thread.start()
    return thread


def test_a_stop_request_reaches_every_daemon_on_one_thread() -> None:
    first, second = daemons = shared(Looping, Looping)
    supervisor = Supervisor(list(daemons))
    thread = running(supervisor)
    assert first.started.wait(5) and second.started.wait(5)
    supervisor.stop()  # from another thread than the loop's
    thread.join(10)
    assert not thread.is_alive()
    assert first.finished and second.finished
    assert supervisor.failures == [] and supervisor.stuck == []
    assert first.threads == second.threads == {thread.ident}


def test_one_daemon_failing_stops_the_others_and_is_reported() -> None:
    healthy, _ = daemons = shared(Looping, Failing)
    supervisor = Supervisor(list(daemons))
    thread = running(supervisor)
    thread.join(10)
    assert not thread.is_alive()
    assert healthy.finished
    assert [(name, str(exc)) for name, exc in supervisor.failures] == [("failing", "broker said no")]


def test_a_daemon_ending_unasked_counts_as_a_failure() -> None:
    class Quitting(Looping):
        name = "quitting"

        def _begin(self) -> None:
            assert self.loop is not None
            self.loop.call_later(0, self._end)

    healthy, _ = daemons = shared(Looping, Quitting)
    supervisor = Supervisor(list(daemons))
    thread = running(supervisor)
    thread.join(10)
    assert not thread.is_alive()
    assert healthy.finished
    assert [name for name, _ in supervisor.failures] == ["quitting"]


def test_a_callback_that_raises_stops_every_daemon_which_still_drains() -> None:
    healthy, _ = daemons = shared(Looping, Raising)
    supervisor = Supervisor(list(daemons))
    thread = running(supervisor, stop_timeout=2.0)
    thread.join(10)
    assert not thread.is_alive()
    assert healthy.finished  # its stop ran on the loop after the failure
    assert [(name, str(exc)) for name, exc in supervisor.failures] == [("loop", "a bug in a callback")]
    assert supervisor.stuck == []  # the raising one drained too: its stop ran


def test_a_daemon_that_ignores_the_stop_is_left_after_the_stop_timeout() -> None:
    healthy, deaf = daemons = shared(Looping, Deaf)
    supervisor = Supervisor(list(daemons))
    thread = running(supervisor, stop_timeout=0.5)
    assert healthy.started.wait(5) and deaf.started.wait(5)
    supervisor.stop()
    thread.join(10)
    assert not thread.is_alive()
    assert healthy.finished and supervisor.stuck == ["deaf"]
