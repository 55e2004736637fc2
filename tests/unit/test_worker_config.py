"""Worker configuration and the pieces of the worker that need no database."""

from __future__ import annotations

import threading
import time
import uuid

import pytest

from framework.envelope import Message
from framework.errors import ConfigurationError
from framework.settings import load
from framework.sql import inbox as q
from framework.worker import HandlerTimeout, WorkerConfig
from framework.worker.batch import Claimed, run_deadlines
from framework.worker.config import GRACE, LEASE_MARGIN
from framework.worker.timeout import Watchdog
from tests import support


def test_defaults() -> None:
    config = WorkerConfig()
    assert (config.max_attempts, config.poison_threshold, config.segment_policy) == (5, 3, "proceed")
    assert config.timeout < config.lease


def test_a_timeout_not_shorter_than_the_lease_fails_at_start_naming_both() -> None:
    with pytest.raises(ConfigurationError, match=r"TXBOX_WORKER_TIMEOUT.*TXBOX_WORKER_LEASE"):
        WorkerConfig(timeout=60, lease=60)  # type: ignore[arg-type]


def test_a_lease_with_no_room_for_a_run_fails_at_start_with_an_example() -> None:
    with pytest.raises(
        ConfigurationError, match=r"TXBOX_WORKER_LEASE=3s is too short.*Example: TXBOX_WORKER_LEASE=60s"
    ):
        WorkerConfig(timeout=1, lease=3)  # type: ignore[arg-type]


def test_a_handler_gets_its_whole_timeout_while_the_lease_is_young() -> None:
    assert run_deadlines(claimed_at=100.0, now=100.0, lease=60.0, timeout=30.0) == (30.0, 60.0 - LEASE_MARGIN)


def test_a_handler_late_in_its_lease_still_has_time_to_unwind_before_the_hard_stop() -> None:
    # Batch mates used 55 of 60 s: the timeout shrinks, the grace before the hard stop does not.
    timeout, hard = run_deadlines(claimed_at=100.0, now=155.0, lease=60.0, timeout=30.0) or (0.0, 0.0)
    assert hard == pytest.approx(60.0 - LEASE_MARGIN - 55.0)
    assert timeout == pytest.approx(hard - GRACE)
    assert timeout > 0


def test_a_handler_is_not_started_without_lease_for_a_run_and_its_grace() -> None:
    assert run_deadlines(claimed_at=100.0, now=100.0 + 60.0 - LEASE_MARGIN - GRACE, lease=60.0, timeout=30.0) is None


def test_policy_and_durations_come_from_the_environment() -> None:
    config = load(WorkerConfig, {"TXBOX_WORKER_SEGMENT_POLICY": "park", "TXBOX_WORKER_LEASE": "2m"})
    assert config.segment_policy == "park" and config.lease == 120
    with pytest.raises(ConfigurationError, match="TXBOX_WORKER_SEGMENT_POLICY"):
        load(WorkerConfig, {"TXBOX_WORKER_SEGMENT_POLICY": "later"})


def _claimed(started: int, finished: int) -> Claimed:
    message = Message(message_id=uuid.uuid4(), message_type="T", aggregate_type="a", aggregate_id="1", payload={})
    return Claimed(
        id=message.message_id,
        message_type="T",
        routing_key="x.y.z",
        started=started,
        finished=finished,
        metadata={},
        message=message,
        claimed_at=0.0,
    )


def test_unfinished_runs_do_not_count_this_claim() -> None:
    assert _claimed(started=1, finished=0).unfinished_before == 0
    assert _claimed(started=4, finished=1).unfinished_before == 2


def test_claim_sql_differs_for_suspects_and_park() -> None:
    plain = q.claim("txbox", suspects=False, park=False).as_string(None)
    suspects = q.claim("txbox", suspects=True, park=False).as_string(None)
    parked = q.claim("txbox", suspects=False, park=True).as_string(None)
    assert "started_attempts <= i.finished_attempts" in plain and "dead_letters" not in plain
    assert "started_attempts > i.finished_attempts" in suspects and "ORDER BY i.locked_until" in suspects
    assert "discarded_at IS NULL" in parked
    assert "SKIP LOCKED" in plain


def test_the_watchdog_interrupts_python_code_and_then_forgets() -> None:
    dog = Watchdog()
    cancelled = threading.Event()
    try:
        started = time.monotonic()
        with pytest.raises(HandlerTimeout), dog.guard(0.2, 30, cancelled.set):
            while time.monotonic() - started < 10:
                support.pause(0.005)  # Python code between short waits
        assert cancelled.is_set() and time.monotonic() - started < 2
        with dog.guard(5, 30, cancelled.set):
            pass  # a quick run after a timeout is not interrupted
        support.pause(0.1)  # no late interrupt arrives meanwhile
    finally:
        dog.close()
