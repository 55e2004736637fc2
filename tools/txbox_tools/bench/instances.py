"""Run N instances of one daemon, each in a process of its own, and time a fixed amount of work.

Python runs one daemon's hot path on one core (the GIL), so a stage scales the way users
deploy it: more instances of the daemon, competing for the same rows or deliveries
(``FOR UPDATE SKIP LOCKED`` claims; competing consumers, which for receivers only suits
unordered traffic: docs/explanation/operations.md, "Replicas of every daemon"). The benches
start them here, spawned (no inherited sockets), and time from the moment every instance
is ready to the moment their combined counter reaches the target.

An instance is built in its child by ``build(*args)``, a module-level function returning
the daemon and the Prometheus counter child that counts its finished work; children copy
that counter into shared memory, so counting costs the database and the broker nothing.
A daemon that keeps ``counts`` (the worker's statements and claims:
framework/worker/counts.py) reports them at its end, summed over the instances into the
``daemon_counts`` dict a caller passes to :func:`timed`.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import threading
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Event
from typing import Any

from framework.daemon import Daemon
from framework.errors import TxboxError
from txbox_tools.bench.cpu import Saturation

Build = Callable[..., tuple[Daemon, Any]]
_START_TIMEOUT = 120.0


def _child(
    build: Build,
    args: tuple[Any, ...],
    ready: Event,
    go: Event,
    stop: Event,
    done: Synchronized[int],
    report: Any = None,
) -> None:
    daemon, counter = build(*args)
    before = counter._value.get()
    counts = getattr(daemon, "counts", None)
    counted = dict(counts.as_dict()) if counts is not None else {}
    ready.set()
    go.wait()
    thread = threading.Thread(target=daemon.run, name=daemon.name)
    thread.start()
    while not stop.wait(0.005) and thread.is_alive():
        done.value = int(counter._value.get() - before)
    daemon.stop()
    thread.join()
    done.value = int(counter._value.get() - before)
    if report is not None:
        now = counts.as_dict() if counts is not None else {}
        report.put({k: v - counted.get(k, 0) for k, v in now.items()})


def timed(
    build: Build,
    args: tuple[Any, ...],
    *,
    instances: int,
    target: int,
    timeout: float = 600.0,
    cpu: Saturation | None = None,
    daemon_counts: dict[str, int] | None = None,
    on_start: Callable[[], None] | None = None,
) -> float:
    """Seconds for ``instances`` daemons built by ``build(*args)`` to count ``target`` between
    them; ``cpu`` measures the instances over the same span (read while they still run);
    ``daemon_counts`` gets the daemons' own counts summed, from start to stop; ``on_start``
    runs once they were told to start (say, to begin offering the work)."""
    ctx = mp.get_context("spawn")
    report = ctx.Queue() if daemon_counts is not None else None
    go, stop = ctx.Event(), ctx.Event()
    readies = [ctx.Event() for _ in range(instances)]
    counts = [ctx.Value("q", 0) for _ in range(instances)]
    procs = [
        ctx.Process(target=_child, args=(build, args, ready, go, stop, done, report), name=f"bench instance {n}")
        for n, (ready, done) in enumerate(zip(readies, counts, strict=True))
    ]
    for proc in procs:
        proc.start()
    try:
        _wait_ready(readies, procs)
        if cpu is not None:
            cpu.start([proc.pid for proc in procs if proc.pid is not None])
        started = time.perf_counter()
        go.set()
        if on_start is not None:
            on_start()
        _wait_counted(counts, procs, target, timeout)
        seconds = time.perf_counter() - started
        if cpu is not None:
            cpu.stop()
        return seconds
    finally:
        stop.set()
        go.set()
        if report is not None and daemon_counts is not None:
            _add_reports(report, len(procs), daemon_counts)
        for proc in procs:
            proc.join(60)
            if proc.is_alive():
                proc.kill()


def _wait_ready(readies: list[Any], procs: list[Any]) -> None:
    """Until every instance says it is built; raises for one that died or took too long."""
    start_by = time.monotonic() + _START_TIMEOUT
    for ready, proc in zip(readies, procs, strict=True):
        while not ready.wait(0.1):
            if not proc.is_alive() or time.monotonic() > start_by:
                raise TxboxError(f"{proc.name} failed to start (exit code {proc.exitcode})")


def _wait_counted(counts: list[Any], procs: list[Any], target: int, timeout: float) -> None:
    """Until the instances have counted ``target`` between them; raises when one exits first
    or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while sum(c.value for c in counts) < target:
        dead = [p for p in procs if not p.is_alive()]
        if dead or time.monotonic() > deadline:
            why = f"{dead[0].name} exited ({dead[0].exitcode})" if dead else f"not done after {timeout:g}s"
            raise TxboxError(f"bench stopped early: {why}; counted {sum(c.value for c in counts)} of {target}")
        time.sleep(0.002)


def _add_reports(report: Any, instances: int, daemon_counts: dict[str, int]) -> None:
    """The daemons' own counts, one report per instance, summed into ``daemon_counts``."""
    for _ in range(instances):
        try:
            for key, value in report.get(timeout=60).items():
                daemon_counts[key] = daemon_counts.get(key, 0) + value
        except queue.Empty:
            break
