"""Per-test databases made and dropped off the test's own time.

Each test that asks for ``database`` still gets a fresh clone of the migrated template,
never a reused one; only *when* the clone is made and dropped moves. ``CREATE DATABASE
... TEMPLATE`` and ``DROP DATABASE`` each wait mostly on the server's disk (a clone is
~8 MB written and flushed): about a second per test together on the 2-core CI machine,
which, over a few hundred such tests, was the largest share of the suite's time. A
background thread keeps one clone ready ahead of the next test, another drops the clones
of finished tests while the following ones run.
"""

from __future__ import annotations

import collections
import functools
import threading
from collections.abc import Callable

from tests import support

#: Clones kept ready. One hides the next test's clone behind the current test; more would
#: only add disk writes competing with the tests themselves.
READY = 1


class DatabasePool:
    """Fresh clones of ``template`` on demand; drops handed over are done in the background."""

    def __init__(self, template: str) -> None:
        self.template = template
        self._ready: collections.deque[str] = collections.deque()
        self._to_drop: collections.deque[str] = collections.deque()
        self._wanted = False  # clones are made ahead only once a test has asked for one
        self._error: BaseException | None = None
        self._closing = False
        self._changed = threading.Condition()
        # Two threads: a drop (it waits on the disk as long as a clone) never holds back the
        # clone the next test waits for.
        self._threads = [
            threading.Thread(target=self._make_ahead, name="test database clones", daemon=True),
            threading.Thread(target=self._drop_behind, name="test database drops", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def take(self) -> str:
        """A fresh clone of the template: a ready one, or one made now."""
        with self._changed:
            self._wanted = True
            self._raise_if_failed()
            name = self._ready.popleft() if self._ready else None
            self._changed.notify_all()
        if name is None:
            name = self._create()
        return name

    def give_back(self, name: str) -> None:
        """Drop ``name`` (WITH FORCE, as before) in the background."""
        with self._changed:
            self._to_drop.append(name)
            self._changed.notify_all()

    def close(self) -> None:
        """Drop every clone still ready or handed back; re-raise a background failure."""
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        for thread in self._threads:
            thread.join()
        for name in [*self._ready, *self._to_drop]:
            support.drop_database(name)
        self._raise_if_failed()

    def _create(self) -> str:
        name = support.unique("txbox_t")
        support.create_database(name, template=self.template)
        return name

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"the test database pool failed: {self._error!r}") from self._error

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
            if not self._attempt(functools.partial(support.drop_database, name)):
                return
            with self._changed:
                self._to_drop.remove(name)

    def _ready_one(self) -> None:
        name = self._create()
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
