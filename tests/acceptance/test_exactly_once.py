"""Exactly once, proven with real processes killed at random moments.

docs/explanation/guarantees.md, "Guarantees and how they are kept".

Receiver and worker run as ``txbox receiver|worker --app tests.apps.counter:service``,
or, in one variant, as two ``txbox run`` processes.
Messages are published while a chaos loop SIGKILLs the receiver and the workers at
random moments and restarts them. The handler adds one to a per-message counter in
the worker's transaction, so a message applied twice shows as 2 and a lost one as a
missing row. The result must be exactly one per message.
"""

from __future__ import annotations

import json
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import pika
import pytest

from framework import amqp, migrate, names
from tests import support
from tests.apps import counter
from tests.apps.helpers import publish, query, scalar
from txbox_tools.processes import Daemon, ProcessGroup

APP = ["--app", "tests.apps.counter:service"]
# `make test` runs a bounded load; `make heavy` the full one (10,000 messages, 5 kills of each kind);
# the poison test runs half as many.
MESSAGES = int(os.environ.get("TXBOX_EXACTLY_ONCE_MESSAGES", "3000"))
KILLS_EACH = int(os.environ.get("TXBOX_EXACTLY_ONCE_KILLS", "3"))


@pytest.fixture
def env(database_url: str, amqp_url: str) -> dict[str, str]:
    return counter.daemon_env(database_url, amqp_url, **counter.SHORT_LEASE)


class Chaos:
    """Keeps one receiver and two workers running (or, with ``deployment="run"``, two
    `txbox run` processes, each all daemons of the service); kills one of them now and then."""

    def __init__(self, group: ProcessGroup, env: dict[str, str], seed: int, deployment: str = "daemons") -> None:
        self.group = group
        self.env = env
        self.rng = random.Random(seed)
        self.one_process = deployment == "run"
        self.kills = {"run": 0} if self.one_process else {"receiver": 0, "worker": 0}
        self.crashes = 0  # workers the poison handler ended (its exit code)
        self.started = 0
        self.daemons: dict[str, Daemon] = {}
        for name in ("run-a", "run-b") if self.one_process else ("receiver", "worker-a", "worker-b"):
            self._start(name)

    def _start(self, name: str) -> None:
        self.started += 1
        command = name.partition("-")[0]  # receiver, worker or run
        self.daemons[name] = self.group.start(f"{name}-{self.started}", [command, *APP], env=self.env)

    def revive(self) -> None:
        for name, daemon in list(self.daemons.items()):
            if not daemon.alive:
                self.crashes += daemon.process.returncode == counter.CRASH_EXIT_CODE
                self._start(name)

    def strike(self) -> None:
        kind = min(self.kills, key=lambda k: (self.kills[k], self.rng.random()))
        name = "receiver" if kind == "receiver" else self.rng.choice([f"{kind}-a", f"{kind}-b"])
        if not self.daemons[name].alive:  # it ended on its own since revive(): not our kill
            self.revive()
            return
        self.group.kill(self.daemons[name])  # SIGKILL
        self.kills[kind] += 1
        self._start(name)

    def run(self, done: Callable[[], bool], kills_each: int) -> None:
        while not (done() and min(self.kills.values()) >= kills_each):
            support.pause(self.rng.uniform(0.7, 2.5))  # a random moment, not a synchronization
            self.revive()
            self.strike()

    def logs(self) -> str:
        return "\n".join(f"--- {d.name}\n{d.log_tail(15)}" for d in self.group.daemons[-4:])


def publish_in_background(
    amqp_url: str, bodies: list[bytes], chunk: int = 500, properties: list[pika.BasicProperties] | None = None
) -> threading.Thread:
    def target() -> None:
        for start in range(0, len(bodies), chunk):
            props = properties[start : start + chunk] if properties is not None else None
            publish(amqp_url, bodies[start : start + chunk], routing_key=counter.ROUTING_KEY, properties=props)
            support.pause(0.3)  # spread the load over the chaos

    thread = threading.Thread(target=target, name="publisher", daemon=True)
    thread.start()
    return thread


def settle_and_stop(chaos: Chaos, url: str | None, expected: int, processes: ProcessGroup) -> None:
    """Wait until ``expected`` rows of ``url``'s inbox are settled (None: the caller waited), then
    stop every daemon with SIGTERM, each ending with 0."""

    def settled() -> bool:
        chaos.revive()
        return bool(
            scalar(
                url,
                "SELECT count(*) = %s AND bool_and(processed_at IS NOT NULL OR abandoned_at IS NOT NULL)"
                " FROM txbox.inbox",
                (expected,),
            )
        )

    if url is not None:
        support.wait_until(settled, 240, interval=0.5, message=f"every message to be settled\n{chaos.logs()}")
    for daemon in list(chaos.daemons.values()):
        # A daemon restarted a moment ago may still be importing: SIGTERM would end it
        # before it could install its handler. Wait until it runs its loop.
        ready = "consuming" if daemon.name.startswith(("receiver", "run")) else "processing"
        support.wait_until(lambda d=daemon, r=ready: r in d.log_tail(100_000), 60, message=f"{daemon.name} to be up")
        assert processes.stop(daemon) == 0, f"{daemon.name} did not exit 0 on SIGTERM\n{daemon.log_tail()}"


@pytest.mark.slow
@pytest.mark.parametrize("deployment", ["daemons", "run"])
def test_messages_exactly_once_through_kill_9s(
    database_url: str, amqp_url: str, env: dict[str, str], processes: ProcessGroup, deployment: str
) -> None:
    """With ``run``, both processes hand the rows their receiver stores to their own worker
    (docs/explanation/daemons.md, "The hand-off in one process"), and both consume: a kill takes
    a receiver and a worker at once, between any two steps of the hand-off."""
    if deployment == "run":
        env = {**env, "TXBOX_RECEIVER_STANDBY": "false"}
    bodies = [counter.envelope(n, aggregate_id=str(n % 200)) for n in range(MESSAGES)]
    ids = {json.loads(b)["message_id"] for b in bodies}
    sender = publish_in_background(amqp_url, bodies)
    chaos = Chaos(processes, env, seed=int(time.time()), deployment=deployment)
    chaos.run(done=lambda: not sender.is_alive(), kills_each=KILLS_EACH)
    settle_and_stop(chaos, database_url, len(bodies), processes)

    assert min(chaos.kills.values()) >= KILLS_EACH
    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    assert set(counts) == ids, f"missing: {len(ids - set(counts))}, unexpected: {len(set(counts) - ids)}"
    twice = {k: v for k, v in counts.items() if v != 1}
    assert not twice, f"{len(twice)} messages applied more than once"
    assert scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == 0
    assert scalar(database_url, "SELECT count(*) FROM txbox.inbox WHERE processed_at IS NULL") == 0


@pytest.mark.slow
def test_a_handler_that_kills_the_process_ends_as_poison_and_nothing_else_suffers(
    database_url: str, amqp_url: str, env: dict[str, str], processes: ProcessGroup
) -> None:
    # Half the load of the test above, the longer of the two (every crash strands the
    # batch around the poison): the same assertions at any size.
    bodies = [counter.envelope(n, aggregate_id=str(n % 50)) for n in range(MESSAGES // 2)]
    poison = counter.envelope(-1, crash=True, aggregate_id="poison")
    bodies.insert(len(bodies) // 2, poison)
    poison_id = json.loads(poison)["message_id"]
    sender = publish_in_background(amqp_url, bodies)
    chaos = Chaos(processes, env, seed=int(time.time()) + 1)

    def poison_abandoned() -> bool:
        return bool(scalar(database_url, "SELECT count(*) FROM txbox.dead_letters WHERE reason = 'poison'"))

    chaos.run(done=lambda: not sender.is_alive() and poison_abandoned(), kills_each=KILLS_EACH)
    settle_and_stop(chaos, database_url, len(bodies), processes)

    # A random kill can end a run of the poison too (while its handler or a batch holding it
    # runs), and counts toward the threshold as a crash would: the database tells. Three
    # runs that never finished, then the claim that abandoned it.
    started = scalar(database_url, "SELECT started_attempts FROM txbox.inbox WHERE id = %s", (poison_id,))
    assert started >= 4, "abandoned as poison only after the threshold of unfinished runs"
    assert chaos.crashes >= 1, "the poison handler ends the worker process when it runs"
    [(message_id, source, reason)] = query(database_url, "SELECT message_id, source, reason FROM txbox.dead_letters")
    assert (str(message_id), source, reason) == (poison_id, "inbox", "poison")
    counts = dict(query(database_url, "SELECT id::text, n FROM counters"))
    expected = {json.loads(b)["message_id"] for b in bodies} - {poison_id}
    assert set(counts) == expected
    assert set(counts.values()) == {1}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["a database each", "schemas of one database"])
def test_tenants_messages_exactly_once_through_kill_9s(
    database_url: str,
    amqp_url: str,
    env: dict[str, str],
    processes: ProcessGroup,
    template_db: str,
    tmp_path: Any,
    layout: str,
) -> None:
    """Two `txbox run` processes serving the two tenants of a registry (a database each,
    or a schema each in one database, whose workers share one LISTEN session), killed at
    random moments: every message is applied once and stored in its own tenant's inbox
    and nowhere else (docs/how-to/tenants.md, "One set of daemons for every tenant").

    The tenant of each message is its ``x-txbox-tenant`` header, as a txbox relay serving
    tenants sends it; the counter command is not multi-tenant, so nothing else names it.
    With schemas the tenants' handlers write to the one ``counters`` table of the
    database (the handler names no schema), so each tenant is judged by its inbox there.
    """
    shared = layout == "schemas of one database"
    names_ = ["shared"] if shared else ["acme", "globex"]
    databases = {key: support.unique(f"txbox_{key}") for key in names_}
    for name in databases.values():
        support.create_database(name, template=template_db)
    try:
        if shared:
            url = support.db_url(databases["shared"])
            for key in ("acme", "globex"):
                migrate.upgrade(url, f"t_{key}")
            locations = {key: (url, f"t_{key}") for key in ("acme", "globex")}
            entry = 'database_url = "{}"\nschema = "{}"\n'
        else:
            locations = {key: (support.db_url(name), "txbox") for key, name in databases.items()}
            entry = 'database_url = "{}"\n'
        urls = {key: url for key, (url, _) in locations.items()}
        for url in set(urls.values()):
            query(url, counter.TABLE)
        registry = tmp_path / "tenants.toml"
        registry.write_text(
            "".join(f"[tenants.{key}]\n" + entry.format(*location) for key, location in locations.items())
        )
        tenant_env = {**env, "TXBOX_TENANTS_FILE": str(registry), "TXBOX_RECEIVER_STANDBY": "false"}
        keys = sorted(locations)
        bodies = [counter.envelope(n, aggregate_id=str(n % 100)) for n in range(MESSAGES // 2)]
        owner = {json.loads(b)["message_id"]: keys[n % 2] for n, b in enumerate(bodies)}
        # user_id: RabbitMQ vouches for the publisher, whose control headers then count.
        user = amqp.username(amqp_url)
        props = [
            pika.BasicProperties(
                content_type="application/json", delivery_mode=2, user_id=user, headers={names.HEADER_TENANT: key}
            )
            for key in (keys[n % 2] for n in range(len(bodies)))
        ]
        sender = publish_in_background(amqp_url, bodies, properties=props)
        chaos = Chaos(processes, tenant_env, seed=int(time.time()) + 2, deployment="run")
        chaos.run(done=lambda: not sender.is_alive(), kills_each=KILLS_EACH)

        def settled() -> bool:
            chaos.revive()
            done = [
                scalar(url, f"SELECT count(*) FILTER (WHERE processed_at IS NOT NULL) FROM {schema}.inbox")
                for url, schema in locations.values()
            ]
            return sum(done) == len(bodies)

        support.wait_until(settled, 240, interval=0.5, message=f"every message to be settled\n{chaos.logs()}")
        settle_and_stop(chaos, None, 0, processes)

        assert min(chaos.kills.values()) >= KILLS_EACH
        for key, (url, schema) in locations.items():
            mine = {mid for mid, k in owner.items() if k == key}
            stored = {mid for (mid,) in query(url, f"SELECT id::text FROM {schema}.inbox")}
            assert stored == mine, f"{key}: missing {len(mine - stored)}, others' {len(stored - mine)}"
            assert scalar(url, f"SELECT count(*) FROM {schema}.dead_letters") == 0
            if not shared:  # applied in its own database
                assert {mid for (mid,) in query(url, "SELECT id::text FROM counters")} == mine, key
        applied = [row for url in set(urls.values()) for row in query(url, "SELECT id::text, n FROM counters")]
        assert sorted(mid for mid, _ in applied) == sorted(owner), "every message applied, in one place"
        assert {n for _, n in applied} == {1}, "messages applied more than once"
        assert scalar(database_url, "SELECT count(*) FROM txbox.inbox") == 0  # the service's own: none stored
        assert scalar(database_url, "SELECT count(*) FROM txbox.dead_letters") == 0
    finally:
        for name in databases.values():
            support.drop_database(name)
