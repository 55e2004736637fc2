"""Start the txbox daemons of a service as real processes, and stop every one of them.

The demo and the acceptance tests run the daemons exactly as an operator would: through
the ``txbox`` command, one process per daemon (or ``txbox run``), each with its own log
file. A process group remembers what it started so that a Ctrl-C or a failing test never
leaves a daemon behind.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from txbox_tools import repository

_terminated = False  # SIGTERM came (see unwind_on_sigterm)


def unwind_on_sigterm() -> None:
    """Make SIGTERM (a CI timeout, ``kill``) unwind the main thread like Ctrl-C, so the
    ``finally`` blocks of a run stop its daemons and drop its scratch database and vhost
    instead of leaving them behind, orphaned. An interrupt that lands in a garbage
    collector's callback or a ``__del__`` is lost ("Exception ignored"), so the signal
    also leaves a flag that the runs' waiting loops check (:func:`raise_if_terminated`):
    a lost one is raised again at the next turn of the loop instead of the run going on
    to its end. Only the main thread can set a signal handler: elsewhere (a run started
    from a test's thread) SIGTERM keeps its default."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(signum: int, frame: FrameType | None) -> None:
    global _terminated
    _terminated = True
    raise KeyboardInterrupt


def raise_if_terminated() -> None:
    """KeyboardInterrupt if SIGTERM came: for a loop that waits, so that an interrupt lost
    on its way (:func:`unwind_on_sigterm`) still ends the run."""
    if _terminated:
        raise KeyboardInterrupt


def txbox_command() -> list[str]:
    """The ``txbox`` executable next to this Python (the venv's), else the module."""
    beside = Path(sys.executable).with_name("txbox")
    if beside.exists():
        return [str(beside)]
    found = shutil.which("txbox")
    return [found] if found else [sys.executable, "-c", "import sys; from framework.cli import main; sys.exit(main())"]


@dataclass
class Daemon:
    name: str
    argv: list[str]
    log_path: Path
    process: subprocess.Popen[bytes]

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])


@dataclass
class ProcessGroup:
    """Daemons started for one run; :meth:`stop_all` is safe to call any number of times."""

    log_dir: Path
    env: dict[str, str] = field(default_factory=dict)
    daemons: list[Daemon] = field(default_factory=list)

    def start(
        self,
        name: str,
        args: list[str],
        env: dict[str, str] | None = None,
        *,
        cwd: Path | None = None,
        program: list[str] | None = None,
    ) -> Daemon:
        """Start ``txbox <args>`` (or ``program <args>``, e.g. uvicorn); the cwd defaults
        to the clone, where ``--app examples...`` imports."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{name}.log"
        argv = [*(program or txbox_command()), *args]
        full_env = {**os.environ, **self.env, **(env or {}), "PYTHONUNBUFFERED": "1"}
        with log_path.open("ab") as log:
            log.write(f"$ {' '.join(argv)}\n".encode())
            log.flush()
            # Own session: a Ctrl-C in the terminal reaches only the orchestrator, which
            # then stops the daemons in order instead of all of them at once.
            process = subprocess.Popen(
                argv,
                cwd=cwd or repository.root(),
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        daemon = Daemon(name, argv, log_path, process)
        self.daemons.append(daemon)
        return daemon

    def dead(self) -> list[Daemon]:
        return [d for d in self.daemons if not d.alive]

    def stop(self, daemon: Daemon, timeout: float = 20.0) -> int | None:
        """SIGTERM (graceful: in-flight confirms and transactions finish), then SIGKILL."""
        if daemon.alive:
            daemon.process.send_signal(signal.SIGTERM)
            try:
                daemon.process.wait(timeout)
            except subprocess.TimeoutExpired:
                daemon.process.kill()
                daemon.process.wait(5)
        return daemon.process.returncode

    def kill(self, daemon: Daemon) -> None:
        """SIGKILL: the crash a power cut would cause (acceptance tests)."""
        if daemon.alive:
            daemon.process.kill()
            daemon.process.wait(10)

    def stop_all(self, timeout: float = 20.0) -> None:
        """SIGTERM to all, wait together; a second Ctrl-C meanwhile kills what is left."""
        try:
            for daemon in self.daemons:
                if daemon.alive:
                    daemon.process.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + timeout
            for daemon in self.daemons:
                try:
                    daemon.process.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    daemon.process.kill()
                    daemon.process.wait(5)
        except KeyboardInterrupt:
            for daemon in self.daemons:
                self.kill(daemon)
            raise
