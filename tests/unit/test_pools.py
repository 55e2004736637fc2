"""The pool behind the ``database`` and ``vhost`` fixtures (tests/pools.py): every take is a
fresh one never handed out before, everything made is dropped, and a failure is not lost."""

from __future__ import annotations

import itertools
import threading

import pytest

from tests import support
from tests.pools import READY, Pool


class Fake:
    """``make`` and ``drop`` of a pool, recording what they did."""

    def __init__(self, fail_make_after: int | None = None) -> None:
        self.counter = itertools.count()
        self.made: list[str] = []
        self.dropped: list[str] = []
        self.lock = threading.Lock()
        self.fail_make_after = fail_make_after

    def make(self) -> str:
        with self.lock:
            n = next(self.counter)
            if self.fail_make_after is not None and n >= self.fail_make_after:
                raise OSError("the server went away")
            name = f"r{n}"
            self.made.append(name)
            return name

    def drop(self, name: str) -> None:
        with self.lock:
            self.dropped.append(name)


def test_takes_are_fresh_and_everything_made_is_dropped_by_the_end() -> None:
    fake = Fake()
    pool = Pool("things", fake.make, fake.drop)
    taken = []
    for _ in range(10):
        name = pool.take()
        assert name not in taken, "a name was handed out twice"
        taken.append(name)
        pool.give_back(name)
    pool.close()
    assert sorted(fake.dropped) == sorted(fake.made)  # the handed back and the unused ready ones
    assert len(fake.dropped) == len(set(fake.dropped)), "dropped twice"


def test_nothing_is_made_ahead_before_the_first_take() -> None:
    fake = Fake()
    pool = Pool("things", fake.make, fake.drop)
    pool.close()
    assert fake.made == [] and fake.dropped == []


def test_after_a_take_a_stock_is_made_ahead() -> None:
    fake = Fake()
    pool = Pool("things", fake.make, fake.drop)
    pool.take()
    support.wait_until(lambda: len(fake.made) >= 1 + READY, 10, message="the stock made ahead")
    pool.close()
    assert len(fake.made) == 1 + READY


def test_a_failure_in_the_background_fails_the_next_take_and_the_close() -> None:
    fake = Fake(fail_make_after=1)
    pool = Pool("things", fake.make, fake.drop)
    pool.take()  # the first one is made; the ones made ahead fail

    def failed() -> bool:
        try:
            pool.take()
        except RuntimeError:  # the background's failure, reported
            return True
        except OSError:  # the same failure met by a make of this take's own
            return False
        return False

    support.wait_until(failed, 10, message="a take failing with the background's error")
    with pytest.raises(RuntimeError, match="the server went away"):
        pool.close()
