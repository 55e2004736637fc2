"""PostgreSQL failover: kill -9 the primary mid-run, promote its synchronous standby.

docs/explanation/operations.md, "PostgreSQL failover".

A private primary streams to a synchronous standby (every commit waits for it). The
publisher, receiver and worker of `counter-service` run as processes against the
multi-host URL (``?host=primary&host=standby&target_session_attrs=read-write``). The test
writes Count commands into the outbox, kills the primary's whole process group while
the daemons work, promotes the standby, and writes more commands through the same
engine (whose pooled connections died with the primary). It judges from the database,
as the chaos verdict does: every command applied exactly once, every outbox row
published, nothing dead-lettered, and the same three processes still running, each
LISTENing on the new primary.

``TXBOX_FAILOVER_MESSAGES`` sets the size (``make failover`` runs a larger one).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import psycopg
import pytest

from framework import migrate, topology
from framework.service import Service
from tests import support
from tests.apps import counter
from tests.apps.helpers import query, scalar
from txbox_tools.chaos.instances import PrivatePostgres
from txbox_tools.processes import Daemon, ProcessGroup

pytestmark = pytest.mark.slow

MESSAGES = int(os.environ.get("TXBOX_FAILOVER_MESSAGES", "600"))
SETTLE = 60 + MESSAGES // 50  # seconds for the run to finish after the failover, generously
APP = ["--app", "tests.apps.counter:service"]
DAEMONS = {"publisher": "running", "receiver": "consuming", "worker": "processing"}


@pytest.fixture
def servers() -> Iterator[tuple[PrivatePostgres, PrivatePostgres]]:
    with (
        PrivatePostgres(settings={"synchronous_standby_names": "*"}) as primary,
        primary.standby() as standby,
    ):
        primary.wait_for_sync_standby()
        yield primary, standby


def multi_host_url(primary: PrivatePostgres, standby: PrivatePostgres) -> str:
    return (
        f"postgresql+psycopg://postgres@/counter?host=127.0.0.1:{primary.port}&host=127.0.0.1:{standby.port}"
        "&target_session_attrs=read-write"
    )


def send_counts(app: Service, first: int, count: int) -> set[str]:
    """Count commands into the outbox, committed in transactions of 100 (the business side)."""
    ids: set[str] = set()
    for start in range(first, first + count, 100):
        with app.engine.begin() as conn:
            outbox = app.outbox(conn)
            for n in range(start, min(start + 100, first + count)):
                ids.add(str(outbox.send_command("Count", aggregate_id=str(n % 40), payload={"n": n})))
    return ids


@pytest.mark.timeout(180 + SETTLE)
def test_daemons_follow_a_promoted_standby_and_nothing_is_lost_or_applied_twice(
    servers: tuple[PrivatePostgres, PrivatePostgres], amqp_url: str, processes: ProcessGroup
) -> None:
    primary, standby = servers
    primary.create_database("counter")
    url = multi_host_url(primary, standby)
    migrate.upgrade(url)
    query(url, counter.TABLE)
    env = {
        "TXBOX_DATABASE_URL": url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
        # The daemons commit leases and marks without waiting for the standby: one lost in
        # the failover holds its rows until the lease ends, so keep leases short.
        "TXBOX_PUBLISHER_LEASE": "6s",
        "TXBOX_PUBLISHER_CONFIRM_TIMEOUT": "3s",
        "TXBOX_WORKER_LEASE": "4s",
        "TXBOX_WORKER_TIMEOUT": "2s",
        "TXBOX_WORKER_POLL_INTERVAL": "0.5s",
        "TXBOX_PUBLISHER_POLL_INTERVAL": "0.5s",
    }
    app = counter.build(env)
    topology.declare(app.settings, app.registry)
    before = send_counts(app, 0, MESSAGES)
    daemons = {name: processes.start(name, [name, *APP], env=env) for name in DAEMONS}
    for name, ready in DAEMONS.items():
        support.wait_until(lambda n=name, r=ready: up(daemons[n], r), 90, message=f"{name} to be up\n{logs(processes)}")

    def a_quarter_applied() -> int:
        applied = int(scalar(url, "SELECT count(*) FROM counters"))
        return applied if applied >= MESSAGES // 4 else 0

    # Mid-run: some commands applied, others still in the outbox, the broker or the inbox.
    at_kill = support.wait_until(a_quarter_applied, 90, interval=0.02, message="a quarter of the commands applied")
    primary.kill()
    standby.promote()
    print(f"primary killed with {at_kill} of {MESSAGES} commands applied; standby promoted")
    assert not standby.in_recovery()
    # The engine's pooled connections went with the old primary: its ping finds them dead
    # and the new connections reach the promoted standby.
    after = send_counts(app, MESSAGES, MESSAGES // 2)
    expected = before | after

    def settled() -> bool:
        dead = [name for name, d in daemons.items() if not d.alive]
        assert not dead, f"{dead} exited; the daemons must carry on without a restart\n{logs(processes)}"
        return bool(
            scalar(
                url,
                "SELECT (SELECT count(*) FROM counters) = %(n)s"
                " AND (SELECT count(*) FROM txbox.inbox WHERE processed_at IS NOT NULL) = %(n)s"
                " AND NOT EXISTS (SELECT FROM txbox.outbox WHERE processed_at IS NULL)",
                {"n": len(expected)},
            )
        )

    support.wait_until(settled, SETTLE, interval=0.2, message=f"every command to be applied\n{logs(processes)}")

    counts = dict(query(url, "SELECT id::text, n FROM counters"))
    assert set(counts) == expected, f"lost: {len(expected - set(counts))}, unknown: {len(set(counts) - expected)}"
    twice = {k: v for k, v in counts.items() if v != 1}
    assert not twice, f"{len(twice)} commands applied more than once"
    assert scalar(url, "SELECT count(*) FROM txbox.dead_letters") == 0
    assert scalar(url, "SELECT count(*) FROM txbox.inbox") == len(expected)

    # The connections that LISTEN reconnected too: to the new primary.
    def listening() -> int:
        with psycopg.connect(standby.admin_url, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = 'counter'"
                " AND application_name IN ('txbox-publisher', 'txbox-worker-listen')"
            ).fetchone()
        # The publisher listens on its one connection (outbox), the worker on its own (inbox).
        return int(row[0]) if row and row[0] >= 2 else 0

    support.wait_until(listening, 30, message=f"publisher and worker to LISTEN on the new primary\n{logs(processes)}")
    assert len(processes.daemons) == len(DAEMONS) and all(d.alive for d in processes.daemons)


def up(daemon: Daemon, ready: str) -> bool:
    assert daemon.alive, f"{daemon.name} exited during start\n{daemon.log_tail()}"
    return ready in daemon.log_tail(100_000)


def logs(group: ProcessGroup) -> str:
    return "\n".join(f"--- {d.name}\n{d.log_tail(15)}" for d in group.daemons)
