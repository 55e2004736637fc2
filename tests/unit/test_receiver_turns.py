"""The takeover rule of framework.receiver.turns, on explicit moments (no clock involved)."""

from __future__ import annotations

from framework import amqp
from framework.receiver.turns import LEASE_SECONDS, Takeover, takeover_seconds


def test_no_other_consumer_starts_at_once() -> None:
    takeover = Takeover(bound=30.0)
    assert takeover.ready(0, now=100.0)
    assert takeover.since is None


def test_other_consumers_are_waited_for_up_to_the_bound_then_not_at_all() -> None:
    """A consumer the broker keeps counting (one of a node that died) holds a holder back
    for the bound, never for ever."""
    takeover = Takeover(bound=30.0)
    assert not takeover.ready(1, now=100.0)
    assert not takeover.ready(1, now=129.9)
    assert round(takeover.waited(now=129.9), 6) == 29.9
    assert takeover.ready(1, now=130.0)


def test_a_consumer_that_leaves_ends_the_wait_and_a_new_one_starts_a_new_wait() -> None:
    takeover = Takeover(bound=30.0)
    assert not takeover.ready(2, now=100.0)
    assert takeover.ready(0, now=110.0)
    assert not takeover.ready(1, now=200.0), "a later wait is measured from its own start"
    takeover.reset()
    assert takeover.waited(now=500.0) == 0.0
    assert not takeover.ready(1, now=500.0)


def test_the_bound_outlasts_a_fenced_holder_and_the_heartbeat() -> None:
    bound = takeover_seconds(connect_timeout=3, drain_seconds=5.0, heartbeat_seconds=amqp.HEARTBEAT_SECONDS)
    assert bound > LEASE_SECONDS + 3 + 5.0
    assert bound > amqp.HEARTBEAT_SECONDS
    assert takeover_seconds(connect_timeout=60, drain_seconds=5.0, heartbeat_seconds=30) > LEASE_SECONDS + 65
