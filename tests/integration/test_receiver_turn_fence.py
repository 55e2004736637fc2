"""A holder whose database went away gives its turn up after the lease, so another
replica's takeover bound holds (docs/explanation/operations.md, "Replicas of every daemon").

A private PostgreSQL is stopped under a receiver's turn: the shared server must not be.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from framework.receiver.turns import ConsumerTurn
from tests import support
from txbox_tools.chaos.instances import PrivatePostgres


@pytest.fixture
def private_pg() -> Iterator[PrivatePostgres]:
    with PrivatePostgres() as pg:
        yield pg


def test_a_holder_that_cannot_confirm_its_turn_stops_consuming(private_pg: PrivatePostgres) -> None:
    url = private_pg.create_database("turns")
    turn = ConsumerTurn(url, "order-service", connect_timeout=1)
    try:
        assert turn.check(), "the free turn is taken"
        assert turn.still_held()
        private_pg.stop(mode="immediate")
        # While the lease runs, an unreachable database counts as held; once it ran out,
        # the holder must stop: a replica that reaches the database may hold the turn.
        support.wait_until(lambda: not turn.still_held(), 60, interval=0.2, message="the holder gives its turn up")
        assert turn.still_held(), "after giving it up, an unreachable database no longer stops it again"
    finally:
        turn.release()


def test_a_receiver_that_never_confirmed_its_turn_is_not_stopped(private_pg: PrivatePostgres) -> None:
    """It consumes only because the queue had no other consumer (the database was down at its start)."""
    url = private_pg.create_database("turns")
    private_pg.stop(mode="immediate")
    turn = ConsumerTurn(url, "order-service", connect_timeout=1)
    try:
        for _ in range(3):
            assert turn.still_held()
    finally:
        turn.release()
