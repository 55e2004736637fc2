"""Keep a set of daemon processes running through ``kill -9``: what systemd would do.

The chaos run kills daemons on purpose and some die on their own (the poison message
kills its worker by design; a daemon may also give up while its database is down). The
supervisor restarts every one of them — after the planned down time for a kill, after a
short pause otherwise — and counts both, so the figures say how often each happened.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from txbox_tools.processes import Daemon, ProcessGroup

RESTART_PAUSE = 0.5  # seconds before restarting a daemon that exited on its own
#: Exit status of a txbox command refusing its configuration: restarting cannot help.
CONFIGURATION_EXIT = 2


@dataclass
class Spec:
    args: list[str]
    env: dict[str, str]


@dataclass
class Tally:
    kills: dict[str, int] = field(default_factory=dict)
    unexpected_exits: dict[str, int] = field(default_factory=dict)
    #: When each unexpected exit was seen (time.monotonic()): the poison's crashes, mostly.
    exit_times: list[float] = field(default_factory=list)
    restarts: int = 0


class Supervisor:
    def __init__(self, group: ProcessGroup, specs: dict[str, Spec]) -> None:
        self.group = group
        self.specs = specs
        self.current: dict[str, Daemon] = {}
        self.tally = Tally()
        self._restart_at: dict[str, float] = {}
        self.broken: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="chaos-supervisor", daemon=True)

    def start(self) -> None:
        with self._lock:
            for name in self.specs:
                self._launch(name)
        self._thread.start()

    def _launch(self, name: str) -> None:
        spec = self.specs[name]
        self.current[name] = self.group.start(name, spec.args, spec.env)

    def kill(self, name: str, down_seconds: float) -> None:
        """``kill -9`` now; the supervisor starts it again ``down_seconds`` later."""
        with self._lock:
            daemon = self.current[name]
            self._restart_at[name] = time.monotonic() + down_seconds
            self.group.kill(daemon)
            self.tally.kills[name] = self.tally.kills.get(name, 0) + 1

    def _loop(self) -> None:
        while not self._stop.wait(0.1):
            self.poll()

    def poll(self) -> None:
        now = time.monotonic()
        with self._lock:
            if self._stop.is_set():
                return
            for name, daemon in self.current.items():
                if daemon.alive:
                    continue
                if daemon.process.returncode == CONFIGURATION_EXIT and self.broken is None:
                    self.broken = f"{name} refused to start:\n{daemon.log_tail(5)}"
                if name not in self._restart_at:
                    self.tally.unexpected_exits[name] = self.tally.unexpected_exits.get(name, 0) + 1
                    self.tally.exit_times.append(now)
                    self._restart_at[name] = now + RESTART_PAUSE
                if now >= self._restart_at[name]:
                    del self._restart_at[name]
                    self._launch(name)
                    self.tally.restarts += 1

    def raise_if_broken(self) -> None:
        """Fail the run when a daemon exits because of its configuration (it would loop forever)."""
        if self.broken is not None:
            from txbox_tools.errors import ChaosFailed

            raise ChaosFailed(self.broken)

    def alive(self) -> bool:
        with self._lock:
            return all(d.alive for d in self.current.values())

    def stop(self, timeout: float = 30.0) -> None:
        """Stop supervising, then SIGTERM everything (graceful), SIGKILL what lingers."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)
        with self._lock:
            self.group.stop_all(timeout)
