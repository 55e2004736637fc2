"""Per-test databases and vhosts made and dropped off the test's own time.

Each test that asks for ``database`` (``vhost``) still gets a fresh clone of the migrated
template (a new, empty vhost), never one another test used; only *when* it is made and
dropped moves. ``CREATE DATABASE ... TEMPLATE`` and ``DROP DATABASE`` each wait mostly on
the server's disk (a clone is ~8 MB written and flushed): about a second per test together
on the 2-core CI machine, which, over a few hundred such tests, was the largest share of the
suite's time; a vhost's quorum queues go with it, node by node. For each kind a background
thread keeps a few ready ahead of the next tests, another drops those of finished tests
while the following ones run.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable

#: Kept ready: a longer test's time fills the stock a run of short tests then takes from
#: (one thread makes them, one at a time, so more would not load the server harder).
READY = 3


class Pool:
    """Fresh resources from ``make`` on demand; the ones handed back go to ``drop`` in the background."""

    def __init__(self, what: str, make: Callable[[], str], drop: Callable[[str], None]) -> None:
        self.what = what
        self._make = make
        self._drop = drop
        self._ready: collections.deque[str] = collections.deque()
        self._to_drop: collections.deque[str] = collections.deque()
        self._wanted = False  # made ahead only once a test has asked for one
        self._error: BaseException | None = None
        self._closing = False
        self._changed = threading.Condition()
        # Two threads: a drop (a database's waits on the disk as long as its clone) never
        # holds back the one the next test waits for.
        self._threads = [
            threading.Thread(target=self._make_ahead, name=f"test {what}: make", daemon=True),
            threading.Thread(target=self._drop_behind, name=f"test {what}: drop", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take(self) -> str:
        """A fresh one: made ahead, or made now."""
        with self._changed:
            self._wanted = True
            self._raise_if_failed()
            name = self._ready.popleft() if self._ready else None
            self._changed.notify_all()
        if name is None:
            name = self._make()
        return name

    def give_back(self, name: str) -> None:
        """Drop ``name`` in the background."""
        with self._changed:
            self._to_drop.append(name)
            self._changed.notify_all()

    def close(self) -> None:
        """Drop every one still ready or handed back; re-raise a background failure."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
        for name in [*self._ready, *self._to_drop]:
            self._drop(name)
        self._raise_if_failed()

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the pool of test {self.what} failed: {self._error!r}") from self._error

    def _make_ahead(self) -> None:
        while True:
            with self._changed:
                while not self._closing and not (self._wanted and len(self._ready) < READY):
                    self._changed.wait()
                if self._closing or self._error is not None:
                    return
            if not self._attempt(self._ready_one):
                return

    def _drop_behind(self) -> None:
        while True:
            with self._changed:
                while not self._closing and not self._to_drop:
                    self._changed.wait()
                if self._closing or self._error is not None:
                    return
                name = self._to_drop[0]  # left in the queue until dropped: close() drops it otherwise
            if not self._attempt(functools.partial(self._drop, name)):
                return
            with self._changed:
                self._to_drop.remove(name)

    def _ready_one(self) -> None:
        name = self._make()
        with self._changed:
            self._ready.append(name)
            self._changed.notify_all()

    def _attempt(self, action: Callable[[], None]) -> bool:
        try:
            action()
            return True
        except BaseException as exc:  # reported by the next take() or at the end of the run
            with self._changed:
                self._error = exc
                self._changed.notify_all()
            return False
