"""One set of daemons serving every tenant of a registry, as `txbox run` runs them
(docs/how-to/tenants.md, "One set of daemons for every tenant").

Three schemas of the test database: the service's own (``txbox``) and two tenants'. A
command published with plain pika on a tenant's Mosaic key is stored in that tenant's
inbox; its handler's event goes into that tenant's outbox, leaves with the tenant named
(``x-txbox-tenant``) and comes back to the same tenant's inbox. Deliveries naming no
tenant, or one the registry does not list, are ``unknown_tenant`` letters in the
service's own schema. A tenant added to the registry file while the daemons run is
served; one removed is not. Everything is judged from the database.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pika
import prometheus_client
import pytest

from framework import CommandHandler, metrics, migrate, names, topology
from framework.cli import main as txbox
from framework.cli.run import Supervisor, build_tenants
from framework.receiver import Receiver
from framework.receiver.consumer import Consumer
from framework.service import Service
from framework.settings import Settings
from framework.tenants import FileSource, RegistryWatcher
from framework.tenants.follow import RegistryFollower
from tests import support
from tests.apps.helpers import publish, query, queue_depth
from tests.integration.test_tenant_routing import CreateThing, ThingCreated, contracts_folder, envelope
from txbox_tools.chaos.instances import PrivatePostgres

pytestmark = pytest.mark.integration

SERVICE = "ax-tenant-service"
QUEUE = names.inbox_queue(SERVICE)
ACME, GLOBEX, INITECH = "t_acme", "t_globex", "t_initech"
REGISTRY = {
    "acme": f'schema = "{ACME}"\nmosaic_tenant_id = "acme-id"\nmosaic_environment_id = "prod"\n',
    "globex": f'schema = "{GLOBEX}"\nmosaic_tenant_id = "globex-id"\n',
    "initech": f'schema = "{INITECH}"\nmosaic_tenant_id = "initech-id"\n',
}


class ThingCreatedQuietly(ThingCreated):
    """The event handled: its inbox row processed is the evidence (no table of the tenant's)."""

    def handle(self, message: Any, session: Any, outbox: Any) -> None:
        pass


class CreateAndAudit(CreateThing):
    """Also sends a command that is not multi-tenant: only the tenant header names its tenant."""

    def handle(self, message: Any, session: Any, outbox: Any) -> None:
        super().handle(message, session, outbox)
        outbox.send_command("AuditThing", aggregate_id=message.aggregate_id, payload=message.payload)


class AuditThing(CommandHandler):
    message_type = "AuditThing"

    def handle(self, message: Any, session: Any, outbox: Any) -> None:
        pass


@pytest.fixture
def service(settings: Settings, tmp_path: Path, database_url: str) -> Service:
    contracts = contracts_folder(tmp_path)
    service = Service(settings=dataclasses.replace(settings, service=SERVICE, contracts_dir=contracts))
    service.register(CreateAndAudit())
    service.register(ThingCreatedQuietly())
    service.register(AuditThing())
    for tenant_schema in (ACME, GLOBEX, INITECH):
        migrate.upgrade(database_url, tenant_schema)
    return service


def _save(path: Path, keys: list[str]) -> None:
    """Write the registry as an editor saves: a new file renamed over the old."""
    temporary = path.with_suffix(".tmp")
    temporary.write_text("".join(f"[tenants.{k}]\n{REGISTRY[k]}\n" for k in keys))
    temporary.replace(path)


@pytest.fixture
def serving(service: Service, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Path, Supervisor]]:
    """The tenants' daemons on one loop in a thread, as `txbox run` runs them; stopped after."""
    path = tmp_path / "tenants.toml"
    _save(path, ["acme", "globex"])
    yield from _serve(service, path, monkeypatch)


def _serve(
    service: Service, path: Path, monkeypatch: pytest.MonkeyPatch, *, poll: str = "0.2"
) -> Iterator[tuple[Path, Supervisor]]:
    monkeypatch.setenv("TXBOX_WORKER_POLL_INTERVAL", poll)
    monkeypatch.setenv("TXBOX_PUBLISHER_POLL_INTERVAL", poll)
    monkeypatch.setenv("TXBOX_RECEIVER_BATCH_WAIT", "0.01")
    source = FileSource(path, default_database_url=service.settings.database_url, default_schema="txbox")
    follower = RegistryFollower(RegistryWatcher(source, interval=0.1))
    follower.start()
    topology.declare(service.settings, service.registry)
    daemons, tenants = build_tenants(service, follower, ["collector"])
    supervisor = Supervisor(daemons)
    supervisor.follow(tenants)
    thread = threading.Thread(target=supervisor.run, args=(30.0,), name="supervisor", daemon=True)
    thread.start()
    try:
        yield path, supervisor
    finally:
        supervisor.stop()
        thread.join(60)
        follower.stop()
    assert not thread.is_alive() and not supervisor.failures and not supervisor.stuck


def _command(amqp_url: str, name: str, tenant_id: str, environment: str = "prod") -> None:
    props: Any = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    key = f"{SERVICE}.{tenant_id}.{environment}.thing.create"
    publish(amqp_url, [envelope("CreateThing", name)], routing_key=key, properties=[props])


def _handled(database_url: str, tenant_schema: str) -> list[tuple[str, str]]:
    """(message type, aggregate) of the tenant's inbox rows that were processed."""
    return query(
        database_url,
        f"SELECT message_type, aggregate_id FROM {tenant_schema}.inbox WHERE processed_at IS NOT NULL "
        "ORDER BY message_type, aggregate_id",
    )


def _letters(database_url: str) -> list[tuple[str, str]]:
    return query(database_url, "SELECT reason, routing_key FROM txbox.dead_letters ORDER BY routing_key")


def test_each_tenants_messages_stay_in_its_own_tables(
    serving: tuple[Path, Supervisor], amqp_url: str, database_url: str
) -> None:
    _command(amqp_url, "a1", "acme-id")
    _command(amqp_url, "g1", "globex-id", "staging")  # globex: every environment
    _command(amqp_url, "n1", "acme-id", "staging")  # acme: prod only
    _command(amqp_url, "x1", "nobody-id")
    audit = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    publish(amqp_url, [envelope("AuditThing", "u1")], routing_key=f"{SERVICE}.thing.audit", properties=[audit])
    support.wait_until(
        lambda: (
            len(_handled(database_url, ACME)) == 3
            and len(_handled(database_url, GLOBEX)) == 3
            and len(_letters(database_url)) == 3
        ),
        timeout=60,
        message="both tenants' command, event and audit handled, three letters",
    )
    assert _handled(database_url, ACME) == [("AuditThing", "a1"), ("CreateThing", "a1"), ("ThingCreated", "a1")]
    assert _handled(database_url, GLOBEX) == [("AuditThing", "g1"), ("CreateThing", "g1"), ("ThingCreated", "g1")]
    # What the handler sent stayed in its tenant: its outbox, published with the tenant named.
    sent = query(database_url, f"SELECT message_type FROM {ACME}.outbox WHERE processed_at IS NOT NULL ORDER BY 1")
    assert sent == [("AuditThing",), ("ThingCreated",)]
    assert query(database_url, "SELECT count(*) FROM txbox.inbox UNION ALL SELECT count(*) FROM txbox.outbox") == [
        (0,),
        (0,),
    ]
    assert _letters(database_url) == [
        ("unknown_tenant", f"{SERVICE}.acme-id.staging.thing.create"),
        ("unknown_tenant", f"{SERVICE}.nobody-id.prod.thing.create"),
        ("unknown_tenant", f"{SERVICE}.thing.audit"),
    ]
    errors = {e for (e,) in query(database_url, "SELECT error FROM txbox.dead_letters")}
    assert any("names Mosaic tenant 'nobody-id' environment 'prod'" in e for e in errors)
    assert any("the delivery names no tenant" in e for e in errors)
    # Counted per tenant: the tenant's relay, worker and inbox; the letters under no tenant.
    for tenant in ("acme", "globex"):
        owner = metrics.labels(SERVICE, tenant)
        assert _sample("txbox_worker_processed_total", message_type="CreateThing", **owner) == 1.0
        assert _sample("txbox_publisher_published_total", message_type="ThingCreated", **owner) == 1.0
        assert (_sample("txbox_receiver_stored_total", **owner) or 0) >= 3
    home = metrics.labels(SERVICE)
    assert _sample("txbox_receiver_rejected_total", reason="unknown_tenant", **home) == 3.0


def _sample(name: str, **labels: str) -> float | None:
    return prometheus_client.REGISTRY.get_sample_value(name, labels)


def test_a_tenant_added_or_removed_at_run_time_is_served_or_not(
    serving: tuple[Path, Supervisor], amqp_url: str, database_url: str
) -> None:
    path, supervisor = serving
    _save(path, ["acme", "initech"])  # globex leaves, initech comes
    support.wait_until(
        lambda: (
            sum(1 for d in supervisor.daemons if d.name == "worker") == 2
            and not any(getattr(d, "settings", None) and d.settings.schema == GLOBEX for d in supervisor.daemons)
        ),
        timeout=30,
        message="initech's daemons started, globex's stopped",
    )
    _command(amqp_url, "i1", "initech-id")
    _command(amqp_url, "g2", "globex-id")
    support.wait_until(
        lambda: len(_handled(database_url, INITECH)) == 3 and len(_letters(database_url)) == 1,
        timeout=60,
        message="initech's command and event handled, globex's lettered",
    )
    assert _handled(database_url, GLOBEX) == []
    assert _letters(database_url) == [("unknown_tenant", f"{SERVICE}.globex-id.prod.thing.create")]
    # Each tenant's daemons have their since-progress series while they run, and no longer.
    progress = "txbox_worker_since_progress_seconds"
    assert _sample(progress, **metrics.labels(SERVICE, "initech")) is not None
    assert _sample(progress, **metrics.labels(SERVICE, "globex")) is None


def test_a_delivery_that_named_no_tenant_is_replayed_into_its_tenant_once_listed(
    serving: tuple[Path, Supervisor],
    service: Service,
    amqp_url: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """initech's command comes before the registry lists initech: an ``unknown_tenant``
    letter in the service's own database, where no relay or worker runs. Replayed there
    it is refused, naming ``--into-tenant``; once initech is listed, ``txbox dlq replay
    --into-tenant initech`` copies it into initech's letters and replays it there: its
    worker handles it, once, however often the command is run."""
    path, supervisor = serving
    _command(amqp_url, "i2", "initech-id")
    support.wait_until(lambda: len(_letters(database_url)) == 1, timeout=60, message="the command lettered")
    [(letter,)] = query(database_url, "SELECT id FROM txbox.dead_letters")
    monkeypatch.setenv("TXBOX_SERVICE", SERVICE)
    monkeypatch.setenv("TXBOX_DATABASE_URL", database_url)
    monkeypatch.setenv("TXBOX_CONTRACTS_DIR", str(service.settings.contracts_dir))
    monkeypatch.setenv("TXBOX_TENANTS_FILE", str(path))
    assert txbox(["dlq", "--database-url", database_url, "replay", str(letter)]) == 1
    assert f"txbox dlq replay {letter} --into-tenant KEY" in capsys.readouterr().out
    assert txbox(["dlq", "replay", str(letter), "--into-tenant", "initech"]) == 2  # not listed yet
    assert "no tenant 'initech'" in capsys.readouterr().err

    _save(path, ["acme", "globex", "initech"])
    support.wait_until(
        lambda: sum(1 for d in supervisor.daemons if d.name == "worker") == 3, timeout=30, message="initech served"
    )
    assert txbox(["dlq", "replay", str(letter), "--into-tenant", "initech"]) == 0
    assert "moved to tenant initech as its letter" in capsys.readouterr().out
    support.wait_until(
        lambda: ("CreateThing", "i2") in _handled(database_url, INITECH), timeout=60, message="initech handled it"
    )
    assert txbox(["dlq", "replay", str(letter), "--into-tenant", "initech"]) == 1  # resolved: nothing again
    assert "already resolved" in capsys.readouterr().out
    assert query(database_url, f"SELECT count(*) FROM {INITECH}.inbox WHERE message_type = 'CreateThing'") == [(1,)]
    assert query(database_url, f"SELECT count(*) FROM {INITECH}.dead_letters") == [(1,)]
    assert query(database_url, "SELECT resolved_at IS NOT NULL FROM txbox.dead_letters") == [(True,)]


def test_interleaved_tenants_are_batched_apart_and_every_delivery_acked(
    serving: tuple[Path, Supervisor], amqp_url: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deliveries of two tenants alternating: each batch is one tenant's, taken from the
    whole buffer (not only its head), so a batch is no prefix of what arrived: no ack
    ever covers a delivery still waiting in the buffer (acked before it is stored, it
    would be lost with the process). Every one is stored once, in its tenant, and acked."""
    _, supervisor = serving
    receiver = next(d for d in supervisor.daemons if isinstance(d, Receiver))
    early: list[int] = []  # deliveries an ack covered while they waited to be stored
    ack = Consumer.ack

    def checked(self: Consumer, delivery_tag: int, *, multiple: bool = False) -> None:
        early.extend(d.delivery_tag for d in receiver._buffer if d.delivery_tag <= delivery_tag and multiple)
        ack(self, delivery_tag, multiple=multiple)

    monkeypatch.setattr(Consumer, "ack", checked)
    props: Any = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    bodies = [envelope("CreateThing", f"n{n}") for n in range(60)]
    keys = [f"{SERVICE}.{'acme-id' if n % 2 == 0 else 'globex-id'}.prod.thing.create" for n in range(60)]
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for body, key in zip(bodies, keys, strict=True):
            channel.basic_publish(names.COMMAND_EXCHANGE, key, body, props)
    finally:
        connection.close()

    def commands(tenant_schema: str) -> set[str]:
        return {a for t, a in _handled(database_url, tenant_schema) if t == "CreateThing"}

    support.wait_until(
        lambda: len(commands(ACME)) == 30 and len(commands(GLOBEX)) == 30 and queue_depth(amqp_url, QUEUE) == 0,
        timeout=60,
        message="every command stored in its tenant and acked",
    )
    assert commands(ACME) == {f"n{n}" for n in range(0, 60, 2)}
    assert commands(GLOBEX) == {f"n{n}" for n in range(1, 60, 2)}
    assert query(database_url, f"SELECT count(*) FROM {ACME}.inbox WHERE message_type = 'CreateThing'") == [(30,)]
    assert early == []


def test_a_tenants_delivery_behind_anothers_burst_is_stored_at_its_turn(
    service: Service, tmp_path: Path, amqp_url: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst of one tenant's commands waiting in the queue, then one of another tenant:
    the receiver reads the whole prefetch window and the tenants take turns, so the
    second tenant's command is stored after a batch or two of the burst, not after all of
    it (batches of 10 here: as first in, first out, 300 rows of the burst would come
    before it). Judged from the rows' insertion times (``received_at``)."""
    path = tmp_path / "tenants.toml"
    _save(path, ["acme", "globex"])
    topology.declare(service.settings, service.registry)
    props: Any = pika.BasicProperties(content_type="application/json", delivery_mode=2)
    acme, globex = f"{SERVICE}.acme-id.prod.thing.create", f"{SERVICE}.globex-id.prod.thing.create"
    burst = [(acme, envelope("CreateThing", f"burst-{n}")) for n in range(300)]
    connection = pika.BlockingConnection(pika.URLParameters(amqp_url))
    try:
        channel = connection.channel()
        channel.confirm_delivery()
        for key, body in [*burst, (globex, envelope("CreateThing", "quiet"))]:
            channel.basic_publish(names.COMMAND_EXCHANGE, key, body, props)
    finally:
        connection.close()
    monkeypatch.setenv("TXBOX_RECEIVER_BATCH_SIZE", "10")
    serving = _serve(service, path, monkeypatch)
    next(serving)
    try:
        support.wait_until(
            lambda: (
                queue_depth(amqp_url, QUEUE) == 0
                and query(database_url, f"SELECT count(*) FROM {ACME}.inbox WHERE message_type = 'CreateThing'")
                == [(300,)]
            ),
            timeout=60,
            message="the burst and the quiet command stored and acked",
        )
        [(after,)] = query(
            database_url,
            f"SELECT count(*) FROM {ACME}.inbox WHERE message_type = 'CreateThing' AND received_at > "
            f"(SELECT received_at FROM {GLOBEX}.inbox WHERE message_type = 'CreateThing' AND aggregate_id = 'quiet')",
        )
    finally:
        next(serving, None)
    assert after >= 10, f"only {after} of the burst's 300 stored after the other tenant's command"


def test_a_tenant_whose_database_is_down_waits_while_the_others_go_on(
    service: Service, tmp_path: Path, amqp_url: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tenant's database on a server of its own, stopped: the other tenant's messages are
    handled meanwhile; the down tenant's wait in the delay chain (nothing lettered, nothing
    lost) and are handled once its server is back, its relay and worker reconnecting."""
    with PrivatePostgres() as remote:
        url = remote.create_database("remote")
        migrate.upgrade(url)
        path = tmp_path / "tenants.toml"
        path.write_text(
            f"[tenants.acme]\n{REGISTRY['acme']}\n"
            f'[tenants.remote]\ndatabase_url = "{url}"\nmosaic_tenant_id = "remote-id"\n'
        )
        serving = _serve(service, path, monkeypatch)
        next(serving)
        try:
            remote.stop(mode="immediate")
            _command(amqp_url, "r1", "remote-id")
            _command(amqp_url, "a1", "acme-id")
            support.wait_until(lambda: len(_handled(database_url, ACME)) == 3, timeout=60, message="acme served")
            assert _letters(database_url) == []
            remote.start()
            support.wait_until(
                lambda: len(_handled(url, "txbox")) == 3, timeout=120, message="the remote tenant served once back"
            )
            assert _handled(url, "txbox") == [("AuditThing", "r1"), ("CreateThing", "r1"), ("ThingCreated", "r1")]
            assert _letters(database_url) == []
        finally:
            next(serving, None)


def _listen_sessions(database_url: str) -> list[tuple[int, int]]:
    """(pid, advisory locks held) of each worker LISTEN session on the test database."""
    return query(
        database_url,
        "SELECT a.pid, (SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND l.locktype = 'advisory')::int "
        "FROM pg_stat_activity a WHERE a.datname = current_database() AND a.application_name = 'txbox-worker-listen'",
    )


def test_the_tenants_of_one_database_listen_on_one_connection(
    service: Service, tmp_path: Path, amqp_url: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three tenants in schemas of one database: their workers hold one LISTEN session
    between them, each tenant's listener lock on it, and a NOTIFY on it wakes the tenant
    it is for (the poll interval is an hour here: what is handled was woken by one). The
    session killed, every worker listens again on a new one; a tenant that leaves gives
    its lock back, and the others still wake."""
    path = tmp_path / "tenants.toml"
    _save(path, ["acme", "globex", "initech"])
    serving = _serve(service, path, monkeypatch, poll="1h")
    _, supervisor = next(serving)
    try:

        def workers() -> list[Any]:
            return [d for d in supervisor.daemons if d.name == "worker" and not d.ended]

        def listening(count: int) -> bool:
            sessions = _listen_sessions(database_url)
            return (
                len(workers()) == count and all(w.listening for w in workers()) and [n for _, n in sessions] == [count]
            )

        support.wait_until(lambda: listening(3), 30, message="one session, three locks")
        for name, tenant_id in (("a1", "acme-id"), ("g1", "globex-id"), ("i1", "initech-id")):
            _command(amqp_url, name, tenant_id)
        support.wait_until(
            lambda: all(len(_handled(database_url, t)) == 3 for t in (ACME, GLOBEX, INITECH)),
            timeout=60,
            message="every tenant woken for its command and event",
        )

        [(pid, _)] = _listen_sessions(database_url)
        query(database_url, "SELECT pg_terminate_backend(%s)", (pid,))
        support.wait_until(
            lambda: listening(3) and _listen_sessions(database_url)[0][0] != pid, 30, message="listening again"
        )
        _command(amqp_url, "a2", "acme-id")
        _command(amqp_url, "i2", "initech-id")
        support.wait_until(
            lambda: len(_handled(database_url, ACME)) == 6 and len(_handled(database_url, INITECH)) == 6,
            timeout=60,
            message="woken on the new session",
        )

        _save(path, ["acme", "initech"])
        support.wait_until(lambda: listening(2), 30, message="globex's lock given back, the session kept")
        _command(amqp_url, "a3", "acme-id")
        support.wait_until(lambda: len(_handled(database_url, ACME)) == 9, timeout=60, message="acme still woken")
    finally:
        next(serving, None)
    # A closed session's backend leaves pg_stat_activity once it has exited: wait for that.
    support.wait_until(
        lambda: _listen_sessions(database_url) == [], 10, message="the session closed with the last worker"
    )
