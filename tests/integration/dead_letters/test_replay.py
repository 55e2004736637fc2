"""Replay and discard semantics against the real database (framework.dead_letters.replay docstring)."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from framework import migrate, names
from framework.contracts import Registry
from framework.dead_letters import DeadLetter, replay
from framework.reasons import Reason
from framework.sql import dead_letters as dead_letters_sql
from framework.tenants.model import Registry as TenantRegistry
from framework.tenants.model import Tenant
from tests.integration.dead_letters import seed

S = seed.SCHEMA
SERVICE = "order-service"


def _one(conn: psycopg.Connection[Any], query: str, *params: Any) -> dict[str, Any]:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row


def _letter(conn: psycopg.Connection[Any], lid: int) -> dict[str, Any]:
    return _one(conn, "SELECT * FROM txbox.dead_letters WHERE id = %s", lid)


def test_inbox_letter_replay_resets_the_row_and_keeps_the_history(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m, error="KeyError: 'price'", attempts=5)

    [outcome] = replay.replay(conn, S, registry, SERVICE, [lid])

    assert (outcome.action, outcome.ok) == ("inbox-reset", True)
    row = _one(conn, "SELECT *, locked_until <= clock_timestamp() AS due FROM txbox.inbox WHERE id = %s", m.message_id)
    assert row["abandoned_at"] is None and row["processed_at"] is None and row["last_error"] is None
    assert (row["started_attempts"], row["finished_attempts"], row["due"]) == (0, 0, True)
    letter = _letter(conn, lid)
    assert letter["replay_count"] == 1 and letter["replayed_at"] is not None and letter["resolved_at"] is None
    [history] = letter["attempts"]["history"]
    assert history["started_attempts"] == 5 and history["last_error"] == "KeyError: 'price'"
    assert history["abandoned_at"] and history["replayed_at"]
    assert letter["attempts"]["started"] == 5  # what the worker wrote stays


def test_replaying_twice_never_applies_the_effect_twice(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    replay.replay(conn, S, registry, SERVICE, [lid])

    [again] = replay.replay(conn, S, registry, SERVICE, [lid])  # still pending: nothing to reset
    assert again.action == "inbox-pending"
    assert _letter(conn, lid)["replay_count"] == 2

    conn.execute("UPDATE txbox.inbox SET processed_at = now(), finished_attempts = 1 WHERE id = %s", (m.message_id,))
    assert replay.resolve_replayed(conn, S) == 1
    assert _letter(conn, lid)["resolved_at"] is not None

    [third] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert (third.action, third.ok) == ("skipped", False)
    row = _one(conn, "SELECT processed_at, finished_attempts FROM txbox.inbox WHERE id = %s", m.message_id)
    assert row["processed_at"] is not None and row["finished_attempts"] == 1  # not reset again


def test_a_letter_whose_message_was_processed_meanwhile_is_resolved_not_reset(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    conn.execute("UPDATE txbox.inbox SET abandoned_at = NULL, processed_at = now() WHERE id = %s", (m.message_id,))
    [outcome] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert outcome.action == "already-processed"
    letter = _letter(conn, lid)
    assert letter["resolved_at"] is not None and letter["replay_count"] == 0


def test_broker_letter_is_sent_again_through_the_outbox_once(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.rejected(conn, m)

    [first] = replay.replay(conn, S, registry, SERVICE, [lid])
    [second] = replay.replay(conn, S, registry, SERVICE, [lid])

    assert (first.action, second.action) == ("outbox-insert", "outbox-pending")
    rows = conn.execute("SELECT * FROM txbox.outbox WHERE id = %s", (m.message_id,)).fetchall()
    assert len(rows) == 1
    row = rows[0]
    assert row["payload"] == m.payload and row["message_context"] == m.message_context
    assert "auth_token" not in row["metadata"]  # dropped when the letter was stored: never at rest
    assert (row["kind"], row["routing_key"], row["segment"]) == (
        "command",
        "order-service.order.place",
        f"order:{m.aggregate_id}",
    )
    assert _letter(conn, lid)["replay_count"] == 2  # marked in the same transaction, each time
    # The relay publishes it, the receiver stores it, the worker processes it: resolved.
    conn.execute("UPDATE txbox.outbox SET processed_at = now() WHERE id = %s", (m.message_id,))
    replay.resolve_replayed(conn, S)
    assert _letter(conn, lid)["resolved_at"] is None, "published is not processed"
    conn.execute(
        """INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
               segment, message_timestamp, queue, processed_at)
           SELECT id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload, segment, created_at,
               'order-service:inbox', now() FROM txbox.outbox WHERE id = %s""",
        (m.message_id,),
    )
    replay.resolve_replayed(conn, S)
    assert _letter(conn, lid)["resolved_at"] is not None


def test_broker_letter_of_a_message_the_inbox_has_follows_the_inbox(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.rejected(conn, m)
    conn.execute(
        """INSERT INTO txbox.inbox (id, message_type, aggregate_type, aggregate_id, kind, routing_key, payload,
               segment, message_timestamp, queue, processed_at)
           VALUES (%s, 'PlaceOrder', 'order', %s, 'command', 'order-service.order.place', %s, 'x', now(),
               'order-service:inbox', now())""",
        (m.message_id, m.aggregate_id, Jsonb(m.payload)),
    )
    [outcome] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert outcome.action == "already-processed"
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0


def test_broker_letters_that_cannot_be_replayed_are_refused_and_left_open(conn: Any, registry: Registry) -> None:
    raw = seed.rejected(conn, None, raw=b"\x00\xffnot json")
    bad = seed.envelope(quantity=0)  # violates the schema (minimum 1)
    invalid = seed.rejected(conn, bad)
    other = seed.envelope()
    unknown = seed.rejected(conn, other)
    conn.execute(
        "UPDATE txbox.dead_letters SET message = jsonb_set(message, '{message_type}', '\"Nope\"') WHERE id = %s",
        (unknown,),
    )

    outcomes = {o.id: o for o in replay.replay(conn, S, registry, SERVICE, [raw, invalid, unknown, 999_999])}

    assert all(not o.ok for o in outcomes.values())
    assert "message_id" in outcomes[raw].detail
    assert "quantity" in outcomes[invalid].detail or "invalid" in outcomes[invalid].detail
    assert "Nope" in outcomes[unknown].detail
    assert outcomes[999_999].action == "missing"
    assert conn.execute("SELECT count(*) AS n FROM txbox.inbox").fetchone()["n"] == 0
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0
    assert (
        conn.execute("SELECT count(*) AS n FROM txbox.dead_letters WHERE replayed_at IS NOT NULL").fetchone()["n"] == 0
    )


def test_outbox_letter_replay_resets_or_rewrites_the_outbox_row(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "outbox", m, error="unroutable: no queue bound")
    [reset] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert reset.action == "outbox-reset"
    row = _one(conn, "SELECT * FROM txbox.outbox WHERE id = %s", m.message_id)
    assert row["abandoned_at"] is None and row["started_attempts"] == 0

    gone = seed.envelope()
    lid2 = seed.abandoned(conn, "outbox", gone)
    conn.execute("DELETE FROM txbox.outbox WHERE id = %s", (gone.message_id,))  # archived meanwhile
    [rewritten] = replay.replay(conn, S, registry, SERVICE, [lid2])
    assert rewritten.action == "outbox-insert"
    row = _one(conn, "SELECT * FROM txbox.outbox WHERE id = %s", gone.message_id)
    assert row["routing_key"] == "order-service.order.place" and "auth_token" not in row["metadata"]

    conn.execute("UPDATE txbox.outbox SET processed_at = now()")
    assert replay.resolve_replayed(conn, S) == 2


def test_dry_run_reports_and_changes_nothing(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    broker = seed.rejected(conn, seed.envelope())
    outcomes = replay.replay(conn, S, registry, SERVICE, [lid, broker], dry_run=True)
    assert [o.action for o in outcomes] == ["inbox-reset", "outbox-insert"]
    assert _one(conn, "SELECT abandoned_at FROM txbox.inbox WHERE id = %s", m.message_id)["abandoned_at"] is not None
    assert conn.execute("SELECT count(*) AS n FROM txbox.inbox").fetchone()["n"] == 1
    assert conn.execute("SELECT count(*) AS n FROM txbox.outbox").fetchone()["n"] == 0
    assert _letter(conn, lid)["replay_count"] == 0
    assert [o.action for o in replay.discard(conn, S, [lid], dry_run=True)] == ["discarded"]
    assert _letter(conn, lid)["discarded_at"] is None


def test_discarded_letters_leave_the_open_list_and_cannot_be_replayed(conn: Any, registry: Registry) -> None:
    lid = seed.abandoned(conn, "inbox", seed.envelope())
    keep = seed.abandoned(conn, "inbox", seed.envelope())
    assert [o.action for o in replay.discard(conn, S, [lid, lid + 1000])] == ["discarded", "skipped"]
    assert [r["id"] for r in dead_letters_sql.list_letters(conn, S, dead_letters_sql.Filters())] == [keep]
    assert [r["id"] for r in dead_letters_sql.list_letters(conn, S, dead_letters_sql.Filters(status="discarded"))] == [
        lid
    ]
    [o] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert (o.action, o.detail) == ("skipped", "discarded")


def test_worker_hook_resolves_in_the_callers_transaction(conn: Any, registry: Registry) -> None:
    m = seed.envelope()
    lid = seed.abandoned(conn, "inbox", m)
    replay.replay(conn, S, registry, SERVICE, [lid])
    with conn.transaction(), conn.cursor() as cur:
        cur.execute("UPDATE txbox.inbox SET processed_at = now() WHERE id = %s", (m.message_id,))
        assert replay.resolve_processed(cur, S, [m.message_id, uuid.uuid4()]) == 1
    assert _letter(conn, lid)["resolved_at"] is not None


def test_a_whole_group_is_selected_by_fingerprint(conn: Any, registry: Registry) -> None:
    same = [seed.abandoned(conn, "inbox", seed.envelope(), error=f"KeyError: 'sku-{i}'") for i in range(3)]
    seed.abandoned(conn, "inbox", seed.envelope(), error="TimeoutError: handler took 31s")
    [group, _other] = dead_letters_sql.groups(conn, S, dead_letters_sql.Filters())
    assert group["count"] == 3
    ids = dead_letters_sql.ids_matching(conn, S, dead_letters_sql.Filters(fingerprint=group["fingerprint"]))
    assert ids == same
    assert all(o.ok for o in replay.replay(conn, S, registry, SERVICE, ids))
    assert dead_letters_sql.count_letters(conn, S, dead_letters_sql.Filters()) == 1


def _unknown_tenant_letter(conn: Any, m: Any, *, routing_key: str = "order-service.order.place") -> int:
    letter = DeadLetter(
        source="broker",
        reason=Reason.UNKNOWN_TENANT,
        error="the delivery names no tenant",
        message_id=m.message_id,
        message_type=m.message_type,
        routing_key=routing_key,
        message=m.to_dict(),
    )
    with conn.transaction():
        return seed.insert_letter(conn, letter)


def _tenants(database_url: str) -> TenantRegistry:
    """acme (schema txbox, the service's own here) and globex (schema seed.GLOBEX)."""
    made = [Tenant(key, database_url, schema) for key, schema in (("acme", "txbox"), ("globex", seed.GLOBEX))]
    return TenantRegistry(tuple(made), "the test's registry", "1")


def _moved(conn: Any, tenants: TenantRegistry, registry: Registry, lid: int, **kw: Any) -> list[replay.Outcome]:
    globex = tenants.tenant("globex")
    return replay.replay_into_tenant(conn, S, conn, registry, SERVICE, [lid], tenant=globex, tenants=tenants, **kw)


def test_a_delivery_that_named_no_tenant_is_replayed_into_its_tenant_once(
    conn: Any, registry: Registry, database_url: str
) -> None:
    """An ``unknown_tenant`` letter of the service's own schema: refused where it is (no
    daemon would run it there); replayed into the tenant's schema, through its outbox,
    once, even after a run that copied it and failed before marking the original. A dry
    run changes nothing."""
    migrate.upgrade(database_url, seed.GLOBEX)
    tenants = _tenants(database_url)
    m = seed.envelope()
    lid = _unknown_tenant_letter(conn, m)
    [refused] = replay.replay(conn, S, registry, SERVICE, [lid])
    assert (refused.action, refused.ok) == ("refused", False) and "--into-tenant KEY" in refused.detail
    [dry] = _moved(conn, tenants, registry, lid, dry_run=True)
    assert dry.ok and dry.detail.startswith("would move to tenant globex")
    assert conn.execute(f"SELECT count(*) AS n FROM {seed.GLOBEX}.dead_letters").fetchone() == {"n": 0}

    with conn.transaction():  # a run before copied it, then failed before marking the original
        replay._copy_letter(conn, seed.GLOBEX, _letter(conn, lid), f"{replay.MOVED}{S} {lid} {m.message_id}")
    [moved] = _moved(conn, tenants, registry, lid)
    [again] = _moved(conn, tenants, registry, lid)

    assert (moved.action, moved.ok) == (
        "outbox-insert",
        True,
    ) and "moved to tenant globex as its letter" in moved.detail
    assert (again.action, again.detail) == ("skipped", "already resolved")
    copies = conn.execute(f"SELECT reason FROM {seed.GLOBEX}.dead_letters WHERE message_id = %s", (m.message_id,))
    assert [r["reason"] for r in copies] == ["unknown_tenant"]
    sent = conn.execute(f"SELECT count(*) AS n FROM {seed.GLOBEX}.outbox WHERE id = %s", (m.message_id,)).fetchone()
    assert sent == {"n": 1}
    assert _one(conn, "SELECT count(*) AS n FROM txbox.outbox WHERE id = %s", m.message_id) == {"n": 0}
    original = _letter(conn, lid)
    assert original["resolved_at"] is not None
    assert original["attempts"]["history"][-1]["tenant"] == "globex"


def test_a_letter_is_not_moved_into_a_tenant_it_does_not_name_nor_left_there_unreplayable(
    conn: Any, registry: Registry, database_url: str
) -> None:
    """A letter whose header names acme is refused for globex; one whose copy's replay is
    refused (its payload breaks the contract) leaves nothing in globex and stays open."""
    migrate.upgrade(database_url, seed.GLOBEX)
    tenants = _tenants(database_url)
    acmes = seed.envelope()
    lid = _unknown_tenant_letter(conn, acmes)
    conn.execute(
        "UPDATE txbox.dead_letters SET headers = jsonb_build_object(%s::text, 'acme') WHERE id = %s",
        (names.HEADER_TENANT, lid),
    )
    [refused] = _moved(conn, tenants, registry, lid)
    assert not refused.ok and "names tenant acme, not tenant globex" in refused.detail
    tabled = _unknown_tenant_letter(conn, seed.envelope())  # a header table, as a hostile sender's
    conn.execute(
        "UPDATE txbox.dead_letters SET headers = jsonb_build_object(%s::text, jsonb_build_object('k', "
        "repeat('x', 100000))) WHERE id = %s",
        (names.HEADER_TENANT, tabled),
    )
    [table_refused] = _moved(conn, tenants, registry, tabled)
    assert not table_refused.ok and "a dict in its x-txbox-tenant header" in table_refused.detail
    assert len(table_refused.detail) < 200
    broken = seed.envelope()
    bad = _unknown_tenant_letter(conn, broken)
    conn.execute("UPDATE txbox.dead_letters SET message = message || '{\"payload\": {}}' WHERE id = %s", (bad,))
    [not_moved] = _moved(conn, tenants, registry, bad)
    assert not not_moved.ok and not_moved.detail.startswith("not moved to tenant globex")
    assert conn.execute(f"SELECT count(*) AS n FROM {seed.GLOBEX}.dead_letters").fetchone() == {"n": 0}
    assert _letter(conn, bad)["resolved_at"] is None and _letter(conn, lid)["resolved_at"] is None
