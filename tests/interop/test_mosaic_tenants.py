"""Tenant-scoped messages between txbox and a Mosaic service, both ways (docs/explanation/receive.md,
"Multi-tenant routing keys").

Both contracts have Mosaic's multi-tenant channels (``*.*.entity.action``). The Mosaic peer
(tests/interop/peer) fills the placeholders with Mosaic's own
``MultiTenantMessagingSettings.getEnvironmentRoutingKey`` and passes the key as the
publication's ``routingKey``, as a Mosaic service does; ``txbox run`` of ``widget-service``
fills them from ``tenant_id=``/``environment_id=`` and, in a handler, from the incoming
message. Judged from txbox's inbox and effects (the stored routing key names the tenant
and environment), the peer's ``tenant_messages`` table and its output:

- the peer's ``TagWidget`` for tenant A reaches txbox on A's key, and txbox's
  ``WidgetTagged`` goes back to the peer on A's key;
- txbox's ``TagGadget`` for tenant B reaches the peer on B's key, and the peer's
  ``GadgetTagged`` comes back to txbox on B's key;
- nothing is dead-lettered on the txbox side.

Then the same with txbox serving tenants (docs/how-to/tenants.md, "One set of daemons
for every tenant"): a registry maps each Mosaic tenant to a schema of its own, and each
message is stored in, handled in and answered from its tenant's tables only.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from framework import migrate
from framework.service import Service
from tests import support
from tests.interop import app as widget_app
from tests.interop.test_mosaic_peer import (
    DEADLINE,
    PEER_ID,
    node_peer_ready,
    peer_database,  # noqa: F401 - fixture
    rows,
    widget_peer,
    widget_run,
    widget_service,  # noqa: F401 - fixture
)
from txbox_tools.processes import ProcessGroup

pytestmark = pytest.mark.acceptance

WIDGETS = widget_app.SERVICE


def test_tenant_scoped_commands_and_events_cross_both_ways_under_their_tenants_keys(
    widget_service: Service,  # noqa: F811
    peer_database: str,  # noqa: F811
    amqp_url: str,
    tmp_path: Path,
) -> None:
    node = node_peer_ready()
    txbox_db = widget_service.settings.database_url
    tenant_a, env_a = str(uuid.uuid4()), str(uuid.uuid4())  # Mosaic's ids are UUIDs
    tenant_b, env_b = "tenant-b", "env-b"
    group = ProcessGroup(tmp_path / "logs")
    peer = widget_peer(node, peer_database, amqp_url, tmp_path)
    try:
        # txbox first: its inbox queue is bound with the placeholders before the peer's
        # command arrives (Mosaic declares a command's target queue, not its binding).
        txbox, _ = widget_run(group, txbox_db, amqp_url)
        peer.start(PEER_TAG_WIDGET="t1", PEER_TENANT_ID=tenant_a, PEER_ENVIRONMENT_ID=env_a)
        with Session(widget_service.engine) as session, session.begin():
            widget_service.outbox(session).send_command(
                "TagGadget", aggregate_id="gadget-t2", payload={"name": "t2"}, tenant_id=tenant_b, environment_id=env_b
            )

        def count(url: str, query: str) -> int:
            return int(rows(url, query)[0][0])

        support.wait_until(
            lambda: (
                (
                    count(
                        txbox_db,
                        "SELECT count(*) FROM interop_effects WHERE message_type IN ('TagWidget', 'GadgetTagged')",
                    )
                    == 2
                    and count(peer_database, "SELECT count(*) FROM tenant_messages") == 2
                )
                or not (peer.alive and txbox.alive)
            ),
            DEADLINE,
            message="a tenant's command and event each way",
        )
        assert peer.alive, peer.log()[-3000:]
        assert txbox.alive, txbox.log_tail(40)

        # txbox's inbox keeps the key each tenant-scoped message came with.
        stored = dict(
            rows(
                txbox_db,
                "SELECT message_type, routing_key FROM txbox.inbox WHERE message_type IN ('TagWidget', 'GadgetTagged')",
            )
        )
        assert stored == {
            "TagWidget": f"{WIDGETS}.{tenant_a}.{env_a}.widget.tag",
            "GadgetTagged": f"{PEER_ID}.{tenant_b}.{env_b}.gadget.tagged",
        }
        effects = dict(rows(txbox_db, "SELECT message_type, routing_key FROM interop_effects"))
        assert effects["TagWidget"] == stored["TagWidget"] and effects["GadgetTagged"] == stored["GadgetTagged"]
        # txbox's event took the command's tenant, as the outbox row shows.
        sent = rows(txbox_db, "SELECT routing_key FROM txbox.outbox WHERE message_type = 'WidgetTagged'")
        assert sent == [(f"{WIDGETS}.{tenant_a}.{env_a}.widget.tagged",)]

        # The peer: its handlers saw each tenant's key, and said so.
        seen = {
            row[0]: row[1:]
            for row in rows(
                peer_database, "SELECT message_type, routing_key, tenant_id, environment_id FROM tenant_messages"
            )
        }
        assert seen == {
            "TagGadget": (f"{PEER_ID}.{tenant_b}.{env_b}.gadget.tag", tenant_b, env_b),
            "WidgetTagged": (f"{WIDGETS}.{tenant_a}.{env_a}.widget.tagged", tenant_a, env_a),
        }
        log = peer.log()
        assert f"{PEER_ID} handled TagGadget on {PEER_ID}.{tenant_b}.{env_b}.gadget.tag" in log
        assert f"{PEER_ID} handled WidgetTagged on {WIDGETS}.{tenant_a}.{env_a}.widget.tagged" in log
        assert count(txbox_db, "SELECT count(*) FROM txbox.dead_letters") == 0
    finally:
        peer.stop()
        group.stop_all(timeout=10)


def test_a_txbox_run_serving_tenants_keeps_each_mosaic_tenants_messages_in_its_tenant(
    widget_service: Service,  # noqa: F811
    peer_database: str,  # noqa: F811
    amqp_url: str,
    tmp_path: Path,
) -> None:
    """Mosaic's library names the tenant in the routing key; txbox's registry maps those
    ids to tenants ``a`` and ``b``, schemas of txbox's database. The peer's ``TagWidget``
    for A is stored and handled in A's schema, whose outbox answers with ``WidgetTagged``
    on A's key; ``TagGadget`` sent from B's outbox comes back as the peer's
    ``GadgetTagged``, stored in B's schema. The service's own schema stores nothing."""
    node = node_peer_ready()
    txbox_db = widget_service.settings.database_url
    tenant_a, env_a = str(uuid.uuid4()), str(uuid.uuid4())
    tenant_b, env_b = "tenant-b", "env-b"
    for schema in ("t_a", "t_b"):
        migrate.upgrade(txbox_db, schema)
    registry = tmp_path / "tenants.toml"
    registry.write_text(
        f'[tenants.a]\nschema = "t_a"\nmosaic_tenant_id = "{tenant_a}"\nmosaic_environment_id = "{env_a}"\n'
        f'[tenants.b]\nschema = "t_b"\nmosaic_tenant_id = "{tenant_b}"\n'
    )
    group = ProcessGroup(tmp_path / "logs")
    peer = widget_peer(node, peer_database, amqp_url, tmp_path)
    try:
        txbox, _ = widget_run(group, txbox_db, amqp_url, TXBOX_TENANTS_FILE=str(registry))
        peer.start(PEER_TAG_WIDGET="t1", PEER_TENANT_ID=tenant_a, PEER_ENVIRONMENT_ID=env_a)
        tenant_b_service = widget_service.with_settings(schema="t_b")
        with Session(tenant_b_service.engine) as session, session.begin():
            tenant_b_service.outbox(session).send_command(
                "TagGadget", aggregate_id="gadget-t2", payload={"name": "t2"}, tenant_id=tenant_b, environment_id=env_b
            )
        tenant_b_service.engine.dispose()

        def processed(schema: str) -> dict[str, str]:
            query = f"SELECT message_type, routing_key FROM {schema}.inbox WHERE processed_at IS NOT NULL"
            return dict(rows(txbox_db, query))

        support.wait_until(
            lambda: (
                ("TagWidget" in processed("t_a") and "GadgetTagged" in processed("t_b"))
                or not (peer.alive and txbox.alive)
            ),
            DEADLINE,
            message="each tenant's message stored and handled in its tenant",
        )
        assert peer.alive, peer.log()[-3000:]
        assert txbox.alive, txbox.log_tail(40)
        assert processed("t_a") == {"TagWidget": f"{WIDGETS}.{tenant_a}.{env_a}.widget.tag"}
        assert processed("t_b") == {"GadgetTagged": f"{PEER_ID}.{tenant_b}.{env_b}.gadget.tagged"}
        # What A's handler sent left from A's outbox, on A's key; B's command from B's.
        assert rows(txbox_db, "SELECT message_type, routing_key FROM t_a.outbox") == [
            ("WidgetTagged", f"{WIDGETS}.{tenant_a}.{env_a}.widget.tagged")
        ]
        assert rows(txbox_db, "SELECT message_type FROM t_b.outbox") == [("TagGadget",)]
        support.wait_until(
            lambda: len(rows(peer_database, "SELECT 1 FROM tenant_messages")) == 2,
            DEADLINE,
            message="the peer to handle A's event and B's command",
        )
        seen = {
            r[0]: r[1:]
            for r in rows(peer_database, "SELECT message_type, tenant_id, environment_id FROM tenant_messages")
        }
        assert seen == {"TagGadget": (tenant_b, env_b), "WidgetTagged": (tenant_a, env_a)}
        own = "SELECT (SELECT count(*) FROM txbox.inbox) + (SELECT count(*) FROM txbox.dead_letters)"
        assert rows(txbox_db, own) == [(0,)]
    finally:
        peer.stop()
        group.stop_all(timeout=10)
