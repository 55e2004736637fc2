"""A handler run again sends the same messages: proven with real processes and two services.

docs/explanation/write.md, "Ids of the messages a handler sends". `fanout-service`
(:mod:`tests.apps.fanout`) turns each Fan command into two Count commands to
`counter-service` (:mod:`tests.apps.counter`), each service with a database of its own in
one vhost: fanout's receiver, worker and publisher as processes, counter's `txbox run`.
Judged from both databases: the ids in fanout's outbox, counter's inbox and its counters.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from framework import topology
from framework.ids import sent_id
from tests import support
from tests.acceptance.test_saga import free_port, metric
from tests.apps import counter, fanout
from tests.apps.helpers import publish, query, scalar
from txbox_tools.processes import Daemon, ProcessGroup

FANOUT_APP = ["--app", "tests.apps.fanout:service"]
COUNTER_APP = ["--app", "tests.apps.counter:service"]
HANDLER = fanout.Fan().name
# Fanout's worker is killed (or its commit undone) mid-way: its claim comes back after the
# lease, which stays far longer than the handler's timeout, so only our kill ends the run.
FANOUT_SETTINGS = {"TXBOX_WORKER_LEASE": "20s", "TXBOX_WORKER_TIMEOUT": "10s", "TXBOX_WORKER_POLL_INTERVAL": "0.5s"}


class Pair:
    """Both services' databases, environments and daemons."""

    def __init__(self, fanout_url: str, counter_url: str, amqp_url: str, processes: ProcessGroup) -> None:
        self.fanout_url, self.counter_url, self.processes = fanout_url, counter_url, processes
        self.fanout_env = {
            "TXBOX_DATABASE_URL": fanout_url,
            "TXBOX_AMQP_URL": amqp_url,
            "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
            **FANOUT_SETTINGS,
        }
        app = fanout.build(self.fanout_env)
        topology.declare(app.settings, app.registry)
        self.counter_env = counter.daemon_env(counter_url, amqp_url, TXBOX_WORKER_POLL_INTERVAL="0.5s")
        self.metrics = free_port()
        self.workers = 0
        self.worker = self.start_worker()
        for name in ("receiver", "publisher"):
            processes.start(f"fanout-{name}", [name, *FANOUT_APP], env=self.fanout_env)
        self.counter_run = processes.start(
            "counter-run", ["run", *COUNTER_APP, "--metrics-port", str(self.metrics)], env=self.counter_env
        )

    def start_worker(self) -> Daemon:
        self.workers += 1
        return self.processes.start(f"fanout-worker-{self.workers}", ["worker", *FANOUT_APP], env=self.fanout_env)

    def derived(self, fan_id: str) -> list[uuid.UUID]:
        """The ids the derivation gives the Count commands of one Fan run."""
        return [sent_id(uuid.UUID(fan_id), fanout.SERVICE, HANDLER, "Count", n) for n in range(fanout.SENDS)]

    def sent(self) -> list[uuid.UUID]:
        """The ids in fanout's outbox."""
        return [r[0] for r in query(self.fanout_url, "SELECT id FROM txbox.outbox")]

    def published(self) -> bool:
        return bool(
            scalar(self.fanout_url, "SELECT count(*) > 0 AND bool_and(processed_at IS NOT NULL) FROM txbox.outbox")
        )

    def counters(self) -> dict[uuid.UUID, int]:
        return {r[0]: r[1] for r in query(self.counter_url, "SELECT id, n FROM counters")}

    def received(self) -> list[uuid.UUID]:
        return sorted(r[0] for r in query(self.counter_url, "SELECT id FROM txbox.inbox"))

    def duplicates(self) -> float:
        """Deliveries counter's receiver found in its inbox already and dropped."""
        return metric(self.metrics, "txbox_receiver_duplicates_total")

    def letters(self) -> int:
        return int(scalar(self.fanout_url, "SELECT count(*) FROM txbox.dead_letters")) + int(
            scalar(self.counter_url, "SELECT count(*) FROM txbox.dead_letters")
        )

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}\n{d.log_tail(15)}" for d in self.processes.daemons)


@pytest.fixture
def pair(database_url: str, template_db: str, amqp_url: str, processes: ProcessGroup) -> Iterator[Pair]:
    """`database_url` is fanout's; counter gets one more database cloned from the template."""
    name = support.unique("txbox_rerun_counter")
    support.create_database(name, template=template_db)
    try:
        yield Pair(database_url, support.db_url(name), amqp_url, processes)
        processes.stop_all(timeout=10)
    finally:
        support.drop_database(name)


def publish_fan(amqp_url: str, aggregate_id: str, hold: Path | None = None) -> str:
    body = fanout.envelope(aggregate_id, hold=hold)
    publish(amqp_url, [body], routing_key=fanout.ROUTING_KEY)
    return str(json.loads(body)["message_id"])


@pytest.mark.slow
def test_a_worker_killed_mid_handler_sends_under_the_ids_of_the_killed_run(
    pair: Pair, amqp_url: str, tmp_path: Path
) -> None:
    hold = tmp_path / "first-run.json"
    fan_id = publish_fan(amqp_url, "killed", hold=hold)
    support.wait_until(hold.exists, 120, message=f"the handler's first run to send and hold\n{pair.logs()}")
    first_run = [uuid.UUID(i) for i in json.loads(hold.read_text())]
    assert pair.worker.alive, "the first run is still inside its handler, before its commit"
    pair.processes.kill(pair.worker)  # SIGKILL
    assert pair.worker.process.returncode == -signal.SIGKILL
    assert pair.sent() == [], "nothing of the killed run committed"
    pair.worker = pair.start_worker()

    def applied() -> bool:
        return pair.published() and len(pair.counters()) >= fanout.SENDS

    support.wait_until(applied, 180, message=f"the second run committed and counter applied it\n{pair.logs()}")
    started, finished, processed = query(
        pair.fanout_url, "SELECT started_attempts, finished_attempts, processed_at IS NOT NULL FROM txbox.inbox"
    )[0]
    assert (started, finished, processed) == (2, 1, True), "one run killed, one committed"
    assert first_run == pair.derived(fan_id), "the killed run's ids are the derivation's"
    assert sorted(pair.sent()) == sorted(first_run), "the run after the kill sent the killed run's ids"
    assert pair.counters() == dict.fromkeys(first_run, 1)
    assert pair.received() == sorted(first_run)
    assert pair.letters() == 0


@pytest.mark.slow
def test_a_lost_commit_run_again_sends_copies_that_the_receiving_inbox_drops(pair: Pair, amqp_url: str) -> None:
    fan_id = publish_fan(amqp_url, "lost")

    def applied() -> bool:
        return pair.published() and len(pair.counters()) >= fanout.SENDS

    support.wait_until(applied, 180, message=f"the first run's Counts published and applied\n{pair.logs()}")
    first_run = pair.sent()
    assert pair.counters() == dict.fromkeys(first_run, 1)
    assert pair.duplicates() == 0

    # What an asynchronous standby promoted after this commit would hold (docs/explanation/operations.md,
    # "PostgreSQL failover"): the claim (its own autocommit statement, replicated), not the
    # worker's transaction, so the Fan is pending again and its outbox rows never existed.
    # The relay had published them already: counter-service holds and applied them.
    query(
        pair.fanout_url,
        "WITH gone AS (DELETE FROM txbox.outbox RETURNING id) "
        "UPDATE txbox.inbox SET processed_at = NULL, finished_attempts = finished_attempts - 1 "
        "WHERE id = %s AND (SELECT count(*) FROM gone) = %s",
        (fan_id, fanout.SENDS),
    )
    assert scalar(pair.fanout_url, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL") == 1

    def arrived() -> bool:  # as copies dropped, or as new messages stored
        return pair.published() and pair.duplicates() + len(pair.received()) >= 2 * fanout.SENDS

    support.wait_until(arrived, 180, message=f"the run again published, its Counts reached counter\n{pair.logs()}")
    assert pair.received() == sorted(first_run), "no new message reached counter-service"
    assert pair.counters() == dict.fromkeys(first_run, 1), "each Count applied exactly once"
    assert pair.duplicates() == fanout.SENDS, "both copies arrived and were dropped"
    assert sorted(pair.sent()) == sorted(first_run) == sorted(pair.derived(fan_id)), "the first run's ids again"
    assert scalar(pair.fanout_url, "SELECT processed_at IS NOT NULL FROM txbox.inbox") is True
    assert pair.letters() == 0, "the copies were quiet duplicates, not id conflicts"
