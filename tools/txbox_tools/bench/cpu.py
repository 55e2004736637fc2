"""CPU seconds per wall second of the processes that carry a pipeline's messages.

`txbox bench latency` reports, beside time, what moderate load costs in CPU: the daemons
(each with its child processes), the PostgreSQL processes that serve them (their backends
and the server's WAL writer, checkpointer and background writer, which write for them) and
the RabbitMQ node. The load generator — its own Python and its PostgreSQL backends, told
apart by :data:`LOAD_APPLICATION` — is not counted: a web front end pays it with or
without txbox. The broker and the server's background processes are measured whole, so
the figures mean something only on a machine that runs nothing else (docs/explanation/daemons.md,
"CPU per message").

A process that exits between the two readings loses what it spent since the first one;
the daemons and their connections live through a run, so nothing of theirs is lost.

The saturation benches (worker, relay, receiver) read :class:`Saturation`: CPU per
message of the working processes and the scratch database's backends only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import psutil
import psycopg

from framework.db import conninfo

# application_name of the load generator's database connections (not counted).
LOAD_APPLICATION = "txbox-bench-load"
# application_name of the raw path's consumer connection (counted for the raw path).
RAW_CONSUMER_APPLICATION = "txbox-bench-raw-consumer"
# PostgreSQL processes that work for every backend (pg_stat_activity.backend_type).
SERVER_HELPERS = ("walwriter", "checkpointer", "background writer")
BROKER_PROCESS = "beam.smp"


def _seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


@dataclass
class Meter:
    """CPU spent per component between :meth:`start` and :meth:`stop`.

    ``components`` maps a name to a function that lists that component's processes
    *now*; it is called at both readings, so a process that appears mid-run (a worker's
    second connection, say) is counted from its start.
    """

    components: dict[str, Callable[[], list[psutil.Process]]]
    _first: dict[int, float] = field(default_factory=dict)

    def start(self) -> None:
        for processes in self._listed():
            for process in processes:
                try:
                    self._first[process.pid] = _seconds(process)
                except psutil.Error:
                    continue

    def stop(self) -> dict[str, float]:
        spent: dict[str, float] = {}
        for name, processes in zip(self.components, self._listed(), strict=True):
            total = 0.0
            for process in processes:
                try:
                    total += _seconds(process) - self._first.get(process.pid, 0.0)
                except psutil.Error:
                    continue  # exited since: what it spent after the first reading is lost
            spent[name] = total
        return spent

    def _listed(self) -> Iterator[list[psutil.Process]]:
        for lister in self.components.values():
            yield _unique(lister())


def _unique(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    seen: dict[int, psutil.Process] = {}
    for process in processes:
        seen.setdefault(process.pid, process)
    return list(seen.values())


def with_children(pid: int) -> list[psutil.Process]:
    try:
        process = psutil.Process(pid)
        return [process, *process.children(recursive=True)]
    except psutil.Error:
        return []


def database_servers(
    database_url: str, *applications: str, exclude: str = LOAD_APPLICATION, helpers: Sequence[str] = SERVER_HELPERS
) -> list[psutil.Process]:
    """Backends of ``database_url``'s database (all but ``exclude``'s, or only ``applications``'
    when given) and the server's ``helpers`` processes."""
    query = (
        "SELECT pid FROM pg_stat_activity WHERE backend_type = ANY(%s) OR (datname = current_database() "
        "AND pid <> pg_backend_pid() AND application_name <> %s "
        "AND (cardinality(%s::text[]) = 0 OR application_name = ANY(%s)))"
    )
    with psycopg.connect(conninfo(database_url), autocommit=True) as conn:
        pids = [r[0] for r in conn.execute(query, (list(helpers), exclude, list(applications), list(applications)))]
    found = []
    for pid in pids:
        try:
            found.append(psutil.Process(pid))
        except psutil.Error:
            continue
    return found


def broker() -> list[psutil.Process]:
    """The RabbitMQ node's Erlang VM(s) on this machine."""
    return [p for p in psutil.process_iter(["name"]) if p.info["name"] == BROKER_PROCESS]


def pipeline(daemons: Iterable[tuple[str, int]], database_url: str) -> Meter:
    """The meter of a running pipeline: each daemon (name, pid) with its children, the
    PostgreSQL processes serving them (not the load generator's) and the broker."""
    components: dict[str, Callable[[], list[psutil.Process]]] = {
        name: partial(with_children, pid) for name, pid in daemons
    }
    components["postgres"] = partial(database_servers, database_url)
    components["rabbitmq"] = broker
    return Meter(components)


def summary(spent: dict[str, float], wall_seconds: float, messages: int, prefix: str = "") -> dict[str, Any]:
    """``cpu_cores``, ``cpu_ms_per_message`` and the cores of each component."""
    total = sum(spent.values())
    wall = max(wall_seconds, 1e-9)
    return {
        f"{prefix}cpu_cores": round(total / wall, 3),
        f"{prefix}cpu_ms_per_message": round(total * 1000 / max(messages, 1), 3),
        f"{prefix}cpu_cores_by_component": {name: round(value / wall, 3) for name, value in spent.items()},
    }


@dataclass
class Saturation:
    """CPU per message of one path of a saturation bench (`txbox bench worker`, `relay`,
    `receiver`): the processes doing the work (with their children) and the backends of
    the scratch database serving them; ``database_url`` None: a path with no database.

    Only the bench's own database's backends count, not the server's helper processes
    nor the broker: those serve everything on the machine, and other work there would
    be counted as the bench's (docs/explanation/daemons.md, "CPU per message"). A backend must
    still be connected at :meth:`stop` for its CPU to count: stop before closing.
    """

    database_url: str | None
    spent: dict[str, float] = field(default_factory=dict)
    _meter: Meter | None = None

    def start(self, pids: Sequence[int]) -> None:
        components: dict[str, Callable[[], list[psutil.Process]]] = {
            "processes": lambda: [p for pid in pids for p in with_children(pid)]
        }
        if self.database_url is not None:
            url = self.database_url
            components["postgres"] = lambda: database_servers(url, helpers=())
        self._meter = Meter(components)
        self._meter.start()

    def stop(self) -> None:
        assert self._meter is not None, "stop() before start()"
        self.spent = self._meter.stop()

    def per_message(self, messages: int, prefix: str = "") -> dict[str, float]:
        """``{prefix}cpu_ms_per_message``: CPU milliseconds between start and stop per message;
        with a database, also each component's share (``..._processes``, ``..._postgres``), so
        a change that moves work between the daemon and its backend shows where it went."""
        out = {f"{prefix}cpu_ms_per_message": round(sum(self.spent.values()) * 1000 / max(messages, 1), 4)}
        if len(self.spent) > 1:
            for name, seconds in self.spent.items():
                out[f"{prefix}cpu_ms_per_message_{name}"] = round(seconds * 1000 / max(messages, 1), 4)
        return out
