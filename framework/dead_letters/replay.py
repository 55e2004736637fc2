"""Replay and discard dead letters; mark replayed ones resolved once processed.

Replay semantics (each covered by tests/integration/dead_letters/test_replay.py and
test_replay_route.py). Every letter is first judged by :func:`framework.dead_letters.route.route`:
its parts must agree with each other and with the route this service's contracts give
its type, or it is refused and stays open (docs/explanation/dead-letters.md, "Dead letters").

* **inbox** letters (the worker abandoned the message): the inbox row is reset in the
  transaction that marks the letter replayed — ``abandoned_at``/``last_error`` cleared,
  ``started_attempts``/``finished_attempts`` back to 0 so the max-attempts and poison
  checks give it a fresh set of attempts, ``locked_until = now()`` so it is due at
  once. The attempt history is not lost: the row's counters, last error and abandon
  time are appended to the letter's ``attempts -> 'history'`` list first.
* **broker** letters (the message never made it into the inbox: rejected by the
  receiver or dead-lettered by RabbitMQ) are re-sent through this service's outbox in
  the transaction that marks them replayed (same ``message_id``, validated against the
  current contracts, routed by its contract): the relay publishes it, and the receiver
  stores it like any delivery, checks included. An event goes to every subscriber
  again; the others already have its id in their inboxes and drop it. Another
  producer's event is not published under this service's broker user: it is written
  into this service's inbox instead. If this service's inbox already holds that id, the
  inbox rules apply instead.
* **outbox** letters (the publisher gave up): the outbox row is reset the same way (or,
  if it is gone, a fresh outbox row with the same ``message_id`` is written), so the
  publisher relays it again; receivers dedupe by ``message_id``.
* A message already processed (or published) is never reset: the letter is marked
  resolved instead, so replaying twice cannot apply the business effect twice (the
  inbox also dedupes by ``message_id``).
* ``txbox archive`` keeps an archived inbox row as a tombstone (its id, type, aggregate
  and payload digest) for ``TXBOX_DEDUP_WINDOW`` (framework/dedup.py): a processed
  tombstone counts as processed above; an abandoned one is filled in again from the
  letter's envelope, then reset. The archive also resolves the letters of the processed
  messages it removes, so a replay after the window is "already resolved", not a rerun.
* **id conflict**: when the inbox holds the letter's ``message_id`` with other content
  (type, aggregate or payload; tombstones compare by payload digest), the replay is
  refused (``id-conflict``) and the letter stays open — replaying would either drop the
  letter's content as a duplicate or run it in place of what was received. The sender
  must send that content under a new ``message_id``; then discard the letter.

Discard: an open letter is closed. A letter already replayed whose message has not run
yet is *taken back*: its row (inbox; outbox while not handed to the broker) is abandoned
again in the discarding transaction, so it does not run. If the message is being
processed or sent at that moment, or was processed already, the discard is refused (the
letter resolves by itself once processed).

Resolution: :func:`resolve_replayed` is one set-based UPDATE over the replayed, still
unresolved letters (a small partial index) joined to ``inbox``/``outbox.processed_at``;
the collector runs it every few seconds and the CLI and dashboard run it before they
read. :func:`resolve_processed` is the same for given message ids, for a worker that
wants letters resolved in its own completion transaction.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import psycopg
from psycopg import sql
from psycopg.rows import dict_row, tuple_row
from psycopg.types.json import Jsonb

from framework import jsoncodec, names
from framework.contracts import MessageSpec, Registry
from framework.dead_letters.route import Route, route
from framework.envelope import Message, message_from_dict
from framework.errors import ConfigurationError, ReplayRefused, TxboxError
from framework.outbox import Outbox, default_segment
from framework.permissions import MAX_TOKEN_CHARS
from framework.reasons import Reason
from framework.redaction import AUTH_TOKEN
from framework.sql import dead_letters as dead_letters_sql
from framework.sql import inbox as inbox_sql
from framework.sql import messages as messages_sql
from framework.sql import outbox as outbox_sql
from framework.sql.inbox import InboxRow
from framework.tenants.model import Registry as TenantRegistry
from framework.tenants.model import Tenant

CHUNK = 500
#: How the ``delivery_key`` of a letter copied into its tenant (replay_into_tenant) begins.
MOVED = "txbox moved "


def operator_token(text: str, where: str) -> str:
    """The auth_token an operator supplies for a replay (``text`` as read from ``where``), checked.

    Surrounding whitespace (a file's last newline) goes; what is left must be 1 to
    :data:`framework.permissions.MAX_TOKEN_CHARS` printable ASCII characters without
    spaces, as every JWT is. Raises :class:`ConfigurationError` naming ``where``, never
    the token.
    """
    token = text.strip()
    if not token:
        raise ConfigurationError(f"{where} holds no auth token: write the token there (one line)")
    if len(token) > MAX_TOKEN_CHARS:
        raise ConfigurationError(f"{where} holds {len(token)} characters: an auth token has at most {MAX_TOKEN_CHARS}")
    if not (token.isascii() and token.isprintable()) or any(c.isspace() for c in token):
        raise ConfigurationError(
            f"{where} holds spaces, control or non-ASCII characters, which no auth token (JWT) has: "
            "write only the token there"
        )
    return token


@dataclass(frozen=True)
class Outcome:
    """What replay/discard did (or would do, with dry_run) to one letter."""

    id: int
    action: str
    detail: str
    ok: bool = True

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "action": self.action, "detail": self.detail, "ok": self.ok}


def _x(conn: psycopg.Connection[Any], query: sql.Composed, params: Any = None) -> psycopg.Cursor[dict[str, Any]]:
    return conn.cursor(row_factory=dict_row).execute(query, params)


def _lock_letters(conn: psycopg.Connection[Any], schema: str, ids: list[int]) -> list[dict[str, Any]]:
    """The letters of ``ids``, locked for this transaction, in id order."""
    return _x(conn, dead_letters_sql.lock(schema), {"ids": ids}).fetchall()


def _chunks(ids: Sequence[int]) -> list[list[int]]:
    return [list(ids[i : i + CHUNK]) for i in range(0, len(ids), CHUNK)]


def replay(
    conn: psycopg.Connection[Any],
    schema: str,
    registry: Registry,
    service: str,
    ids: Sequence[int],
    *,
    dry_run: bool = False,
    auth_token: str | None = None,
    into_tenant: bool = False,
) -> list[Outcome]:
    """Replay letters, ``CHUNK`` per transaction; ``dry_run`` runs the same steps and rolls back.

    ``conn`` must be in autocommit mode (each chunk is its own transaction here). Each
    letter is first judged by :func:`framework.dead_letters.route.route`: one whose parts disagree
    with each other or with this service's contracts is refused and stays open.
    ``auth_token``: the token the operator supplies for the replayed messages (a letter
    keeps none, and one a letter holds all the same is never used); it is written only
    where sending or running the message needs it (the outbox or inbox row's metadata,
    which drops it once published or processed), never into the letter or an outcome.
    An ``unknown_tenant`` letter is refused, naming :func:`replay_into_tenant` (which
    replays its copy with ``into_tenant``): replayed where it is, no daemon would run it.
    """
    replaying = _Replaying(conn, schema, registry, service, auth_token, into_tenant)
    outcomes: list[Outcome] = []
    for letter in _locked(conn, schema, ids, dry_run, outcomes):
        outcomes.append(replaying.one(letter))
    return outcomes


def _locked(
    conn: psycopg.Connection[Any], schema: str, ids: Sequence[int], dry_run: bool, outcomes: list[Outcome]
) -> Iterator[dict[str, Any]]:
    """The letters of ``ids``, ``CHUNK`` per transaction, each locked in its chunk's (rolled
    back on a dry run), which stays open while the caller acts on it; each id with no
    letter is a ``missing`` outcome in ``outcomes``."""
    for chunk in _chunks(ids):
        with conn.transaction(force_rollback=dry_run):
            letters = _lock_letters(conn, schema, chunk)
            found = {row["id"] for row in letters}
            outcomes += [Outcome(i, "missing", "no dead letter with this id", False) for i in chunk if i not in found]
            yield from letters


def replay_into_tenant(
    source: psycopg.Connection[Any],
    source_schema: str,
    target: psycopg.Connection[Any],
    registry: Registry,
    service: str,
    ids: Sequence[int],
    *,
    tenant: Tenant,
    tenants: TenantRegistry,
    dry_run: bool = False,
    auth_token: str | None = None,
) -> list[Outcome]:
    """Replay letters of deliveries that named no tenant into ``tenant`` (``target``: a
    connection to its database).

    A receiver serving tenants letters a delivery naming none of them (``unknown_tenant``)
    in the service's own database (``source``), where no relay or worker runs: replayed
    there it would wait for ever. Each letter (source ``broker``, judged by its route as
    any replay, and naming no other tenant of ``tenants`` in its Mosaic ids or its
    ``x-txbox-tenant`` header) is copied into the tenant's dead letters and the copy
    replayed there by :func:`replay`, in one transaction of the tenant's database: the
    tenant's relay sends it, or its worker runs it. A copy whose replay is refused is
    rolled back and the original stays open, with the refusal. Only once the tenant's
    transaction committed is the original marked resolved, with a note naming the
    tenant; the copy's ``delivery_key`` names the original and its message, so a run that
    failed between the two commits finds its copy again and copies nothing twice. Both
    connections in autocommit mode.
    """
    outcomes: list[Outcome] = []
    for letter in _locked(source, source_schema, ids, dry_run, outcomes):
        refused = _not_movable(letter, registry, service, tenant, tenants)
        moved = refused or _move(target, letter, source_schema, registry, service, tenant, dry_run, auth_token)
        outcomes.append(moved)
        if moved.ok:
            entry = {"table": names.DEAD_LETTERS, "action": "moved", "tenant": tenant.key}
            _note(source, source_schema, letter["id"], entry, "resolved_at", "replayed_at = clock_timestamp()")
    return sorted(outcomes, key=lambda o: o.id)


def _move(
    target: psycopg.Connection[Any],
    letter: dict[str, Any],
    source_schema: str,
    registry: Registry,
    service: str,
    tenant: Tenant,
    dry_run: bool,
    auth_token: str | None,
) -> Outcome:
    """Copy ``letter`` into ``tenant``'s dead letters and replay the copy, in one transaction
    of the tenant's database, kept only if the replay went (and not on a dry run)."""
    lid = letter["id"]
    key = f"{MOVED}{source_schema} {lid} {letter['message_id']}"
    there: Outcome | None = None
    with target.transaction(force_rollback=dry_run) as tx:
        copy = _copy_letter(target, tenant.schema, letter, key)
        if copy is not None:
            [there] = replay(target, tenant.schema, registry, service, [copy], into_tenant=True, auth_token=auth_token)
        if there is None or not there.ok:
            raise psycopg.Rollback(tx)  # nothing of it stays in the tenant: the original stays open
    return _moved(lid, key, tenant, copy, there, dry_run)


def _moved(lid: int, key: str, tenant: Tenant, copy: int | None, there: Outcome | None, dry_run: bool) -> Outcome:
    """What :func:`_move` did with letter ``lid``: ``there``, the copy's replay (None: no copy)."""
    if copy is None or there is None:
        return Outcome(
            lid,
            "refused",
            f"tenant {tenant.key}'s dead letters hold another message under this letter's key ({key!r}): "
            "not replayed; look at both",
            False,
        )
    if not there.ok:
        return Outcome(lid, there.action, f"not moved to tenant {tenant.key}: {there.detail}", False)
    done = f"would move to tenant {tenant.key}" if dry_run else f"moved to tenant {tenant.key} as its letter {copy}"
    return Outcome(lid, there.action, f"{done}: {there.detail}")


def _not_movable(
    letter: dict[str, Any], registry: Registry, service: str, tenant: Tenant, tenants: TenantRegistry
) -> Outcome | None:
    """Why ``letter`` is not replayed into ``tenant``, or None."""
    lid = letter["id"]
    closed = _closed(letter)
    if closed is not None:
        return closed
    if letter["source"] != "broker" or letter["message_id"] is None:
        return Outcome(
            lid,
            "refused",
            "only a delivery's letter (source broker, with a message_id) is replayed into a tenant; "
            "replay this one where it is",
            False,
        )
    try:
        judged = route(letter, registry, service)
    except ReplayRefused as exc:
        return Outcome(lid, "refused", str(exc), False)
    named = _named_tenant(letter, judged, tenants)
    if named is not None and named != f"tenant {tenant.key}":
        return Outcome(
            lid, "refused", f"the delivery names {named}, not tenant {tenant.key}: not replayed there", False
        )
    return None


def _named_tenant(letter: dict[str, Any], judged: Route, tenants: TenantRegistry) -> str | None:
    """What the delivery named as its tenant, read as the receiver reads it with the
    registry in force: ``"tenant KEY"``, a text saying what it named that the registry
    does not list, or None (it named none)."""
    headers = letter["headers"] if isinstance(letter["headers"], dict) else {}
    header = headers.get(names.HEADER_TENANT)
    if isinstance(header, str):
        key = header[: names.MAX_TENANT_KEY_CHARS + 1]
        return f"tenant {key}" if key in tenants else f"tenant {key!r} in its {names.HEADER_TENANT} header"
    if header is not None:  # a number, a table: no tenant key (never turned into text whole)
        return f"a {type(header).__name__} in its {names.HEADER_TENANT} header, no tenant key"
    ids = names.tenancy(judged.spec.routing_key, judged.routing_key) if judged.spec.tenant_scoped else None
    if ids is None:
        return None
    found = tenants.for_mosaic(*ids)
    if found is not None:
        return f"tenant {found.key}"
    return (
        f"Mosaic tenant {ids[0]!r} environment {ids[1]!r}, which no tenant of {tenants.source} has "
        "(add them to its entry first: mosaic_tenant_id, mosaic_environment_id)"
    )


def _closed(letter: dict[str, Any]) -> Outcome | None:
    """A letter no replay touches: discarded, or resolved already."""
    if letter["discarded_at"] is not None:
        return Outcome(letter["id"], "skipped", "discarded", False)
    if letter["resolved_at"] is not None:
        return Outcome(letter["id"], "skipped", "already resolved", False)
    return None


def _copy_letter(conn: psycopg.Connection[Any], schema: str, letter: dict[str, Any], key: str) -> int | None:
    """``letter`` as an open letter of ``schema`` (its ``delivery_key`` ``key``): the copy's id,
    the one a run before made if there is one; None if a letter of another message holds the key."""
    values = {c: letter[c] for c in dead_letters_sql.COLUMNS}
    values.update(delivery_key=key, headers=Jsonb(letter["headers"]), attempts=Jsonb(letter["attempts"]))
    values["message"] = None if letter["message"] is None else Jsonb(letter["message"])
    _x(conn, dead_letters_sql.insert_sql(schema), values)
    row = _x(conn, dead_letters_sql.by_delivery_key(schema), {"key": key}).fetchone()
    if row is None or row["message_id"] != letter["message_id"]:
        return None
    return int(row["id"])


@dataclass(frozen=True)
class _Replaying:
    """One replay's connection, schema, contracts and service, which every step needs."""

    conn: psycopg.Connection[Any]
    schema: str
    registry: Registry
    service: str
    auth_token: str | None = field(default=None, repr=False)
    into_tenant: bool = False  # letters copied into their tenant (replay_into_tenant)

    def one(self, letter: dict[str, Any]) -> Outcome:
        lid = letter["id"]
        closed = _closed(letter)
        if closed is not None:
            return closed
        copied = str(letter.get("delivery_key") or "").startswith(MOVED)  # into its tenant: replayed here
        if letter["reason"] == Reason.UNKNOWN_TENANT and not (self.into_tenant or copied):
            return Outcome(
                lid,
                "refused",
                "the delivery named no tenant the receiver serves, and no relay or worker runs here: replay it "
                f"into its tenant, once the registry lists it: txbox dlq replay {lid} --into-tenant KEY",
                False,
            )
        if letter["message_id"] is None:
            return Outcome(lid, "refused", "no valid message_id: nothing to replay (discard it)", False)
        try:
            with self.conn.transaction():  # a savepoint: a refused letter leaves the others of the chunk intact
                judged = route(letter, self.registry, self.service)
                if letter["source"] == "broker":
                    return self._resend(letter, judged)
                table = names.OUTBOX if letter["source"] == "outbox" else names.INBOX
                return self._into(letter, judged, table)
        except ReplayRefused as exc:
            return Outcome(lid, "refused", str(exc), False)

    def _resend(self, letter: dict[str, Any], judged: Route) -> Outcome:
        """A broker letter: through the outbox again, unless the inbox has the message by now
        or the route is not one this service sends on (then straight into its inbox)."""
        in_inbox = _x(self.conn, inbox_sql.holds(self.schema), {"id": letter["message_id"]}).fetchone()
        if in_inbox is not None or not judged.send:
            return self._into(letter, judged, names.INBOX)
        return self._into(letter, judged, names.OUTBOX, resend=True)

    def _into(self, letter: dict[str, Any], judged: Route, table: str, *, resend: bool = False) -> Outcome:
        """Reset (or write) the message's row in ``table``; ``resend``: an outbox row that
        was published already is published again (a broker letter never reached the inbox)."""
        lid, mid = letter["id"], letter["message_id"]
        row = self._current_row(letter, table)
        if (
            row is not None
            and table == names.OUTBOX
            and (row["message_type"], row["routing_key"])
            != (
                judged.spec.message_type,
                judged.routing_key,
            )
        ):
            return Outcome(
                lid,
                "id-conflict",
                f"the outbox holds message {mid} as {row['message_type']} on {row['routing_key']!r}, not as "
                f"{judged.spec.message_type} on {judged.routing_key!r}: the letter does not describe what this "
                "service sent, so it is not replayed",
                False,
            )
        if row is not None and row["same"] is False:
            return Outcome(
                lid,
                "id-conflict",
                f"the {table} holds message {mid} with other content (type, aggregate or payload): replaying would "
                "drop this letter's content as a duplicate or run it in place of what was received. Send that "
                "content under a new message_id, then discard this letter",
                False,
            )
        if row is None:
            self._insert_from_envelope(letter, judged, table)
            action, detail = f"{table}-insert", f"written to {table} as {mid}" + (" to be sent again" if resend else "")
        elif row["processed_at"] is not None and not resend:
            _x(self.conn, dead_letters_sql.mark_resolved(self.schema), {"at": row["processed_at"], "id": lid})
            done = "published" if table == names.OUTBOX else "processed"
            return Outcome(
                lid,
                "already-" + done,
                f"{table} row {mid} was {done} at {row['processed_at']:%Y-%m-%d %H:%M:%S}; marked resolved",
            )
        elif row["abandoned_at"] is None and row["processed_at"] is None:
            action, detail = f"{table}-pending", f"{table} row {mid} is already pending"
        else:
            if row["archived_at"] is not None:  # a tombstone: only the id is left, the letter has the rest
                self._restore_from_envelope(letter, judged)
            _x(self.conn, messages_sql.reset(self.schema, table), {"id": mid, "auth_token": self.auth_token})
            action, detail = f"{table}-reset", f"{table} row {mid} reset for processing"
        history = {
            "replayed_at": None,  # filled by SQL below (clock of the database)
            "table": table,
            "action": action,
            "started_attempts": row["started_attempts"] if row else None,
            "finished_attempts": row["finished_attempts"] if row else None,
            "last_error": row["last_error"] if row else None,
            "abandoned_at": row["abandoned_at"].isoformat() if row and row["abandoned_at"] else None,
        }
        _note(self.conn, self.schema, lid, history, "replayed_at", "replay_count = replay_count + 1")
        return Outcome(lid, action, detail)

    def _current_row(self, letter: dict[str, Any], table: str) -> dict[str, Any] | None:
        """The message's row in ``table``, locked, with ``same``: whether it holds the letter's
        content (inbox only; None when there is nothing to compare)."""
        envelope = letter["message"]
        keys = ("message_type", "aggregate_type", "aggregate_id", "payload")
        comparable = (
            table == names.INBOX
            and isinstance(envelope, dict)
            and all(isinstance(envelope.get(k), str) for k in keys[:3])
            and "payload" in envelope
        )
        same: sql.Composable = sql.SQL("NULL::boolean")
        params: dict[str, Any] = {"id": letter["message_id"]}
        if comparable:
            params.update({k: envelope[k] for k in keys[:3]}, payload=Jsonb(envelope["payload"]))
            text = {k: sql.SQL("{}::text").format(sql.Placeholder(k)) for k in keys[:3]}
            same = inbox_sql.same_content(
                "r", text["message_type"], text["aggregate_type"], text["aggregate_id"], sql.Placeholder("payload")
            )
        return _x(self.conn, messages_sql.current(self.schema, table, same), params).fetchone()

    def _insert_from_envelope(self, letter: dict[str, Any], judged: Route, table: str) -> None:
        message, spec = self._validated(letter, judged)
        if table == names.OUTBOX:
            tenant, environment = names.tenancy(spec.routing_key, judged.routing_key) or (None, None)
            row = Outbox(cast(Any, None), self.registry).build(
                spec,
                tenant_id=tenant,
                environment_id=environment,
                aggregate_id=message.aggregate_id,
                payload=message.payload,
                message_context=message.message_context,
                message_id=message.message_id,
                message_version=message.message_version,
                auth_token=self.auth_token,  # the operator's: never one the letter kept
            )
            _x(self.conn, outbox_sql.insert(self.schema), row.params())
            return
        inbox_sql.insert_rows(
            self.conn.cursor(row_factory=tuple_row), self.schema, [self._inbox_row(letter, judged, message)]
        )

    def _restore_from_envelope(self, letter: dict[str, Any], judged: Route) -> None:
        """Fill a tombstone in again from the letter (its id, type and aggregate already match)."""
        message, _ = self._validated(letter, judged)
        row = self._inbox_row(letter, judged, message)
        _x(
            self.conn,
            inbox_sql.restore_tombstone(self.schema),
            {"id": row.id, "payload": row.payload, "message_context": row.message_context, "metadata": row.metadata},
        )

    def _validated(self, letter: dict[str, Any], judged: Route) -> tuple[Message, MessageSpec]:
        """The letter's envelope, parsed and checked against the contracts (its type is ``judged``'s)."""
        envelope = letter["message"]
        if not isinstance(envelope, dict):
            facts = letter["headers"].get(names.BODY_FACTS) if isinstance(letter["headers"], dict) else None
            if letter["reason"] == Reason.TOO_LARGE or (isinstance(facts, dict) and facts.get("truncated")):
                raise ReplayRefused(
                    "the letter keeps only a prefix of a body larger than this service accepts (its receiver "
                    "refused it for its size, or the letter's limit cut it): it cannot be replayed; have the "
                    "sender send it smaller, then discard this letter"
                )
            raise ReplayRefused("the letter holds no JSON envelope (raw body only): fix the sender and discard it")
        try:
            message = message_from_dict({k: v for k, v in envelope.items() if k != AUTH_TOKEN})
            spec = judged.spec
            spec.validate(message.payload, message.message_version)
        except TxboxError as exc:
            raise ReplayRefused(f"cannot replay: {exc}") from None
        if message.message_id != letter["message_id"]:
            raise ReplayRefused(
                f"envelope message_id {message.message_id} differs from the letter's {letter['message_id']}"
            )
        return message, spec

    def _inbox_row(self, letter: dict[str, Any], judged: Route, message: Message) -> InboxRow:
        """The letter's message as an inbox row. A dead letter does not keep the lane the
        receiver gave it, so it rejoins its aggregate's lane, as an outbox replay does."""
        spec = judged.spec
        metadata: dict[str, Any] = {"replayed_from_dead_letter": letter["id"]}
        if self.auth_token is not None:
            metadata[AUTH_TOKEN] = self.auth_token  # the operator's: never one the letter kept
        return InboxRow.of(
            message,
            message_type=spec.message_type,
            kind=spec.kind,
            routing_key=judged.routing_key,
            metadata=jsoncodec.dumps(metadata),
            lane=(default_segment(message.aggregate_type, message.aggregate_id), "sequential", 0),
            queue=names.inbox_queue(self.service),
        )


def _note(conn: psycopg.Connection[Any], schema: str, lid: int, entry: dict[str, Any], stamp: str, more: str) -> None:
    """Set the letter's ``stamp`` column to now and append ``entry`` (timed as ``stamp``) to its history."""
    _x(conn, dead_letters_sql.note(schema, stamp, more), {"entry": Jsonb(entry), "id": lid})


def discard(conn: psycopg.Connection[Any], schema: str, ids: Sequence[int], *, dry_run: bool = False) -> list[Outcome]:
    """Close letters nobody will replay (kept for the record, hidden from the open list).

    A replayed letter whose message has not run yet is taken back (see the module's
    docstring); one whose message is running or ran is refused.
    """
    outcomes: list[Outcome] = []
    for chunk in _chunks(ids):
        with conn.transaction(force_rollback=dry_run):
            letters = _lock_letters(conn, schema, chunk)
            by_id = {row["id"]: row for row in letters}
            for i in chunk:
                letter = by_id.get(i)
                outcomes.append(
                    _discard_one(conn, schema, letter)
                    if letter
                    else Outcome(i, "skipped", "missing, resolved or already discarded", False)
                )
    return outcomes


def _discard_one(conn: psycopg.Connection[Any], schema: str, letter: dict[str, Any]) -> Outcome:
    lid = letter["id"]
    if letter["discarded_at"] is not None or letter["resolved_at"] is not None:
        return Outcome(lid, "skipped", "missing, resolved or already discarded", False)
    if letter["replayed_at"] is None:
        _x(conn, dead_letters_sql.mark_discarded(schema), {"id": lid})
        return Outcome(lid, "discarded", "discarded")
    table = _take_back(conn, schema, letter)
    if table is not None:
        _note(
            conn,
            schema,
            lid,
            {"action": "replay-taken-back", "table": table},
            "discarded_at",
            "replay_count = replay_count",
        )
        return Outcome(lid, "discarded", f"replay taken back: the {table} row is abandoned again and will not run")
    done = resolve_replayed(conn, schema, ids=[lid])
    if done:
        return Outcome(
            lid, "refused", "its replay was processed already (now marked resolved): nothing to take back", False
        )
    return Outcome(
        lid,
        "refused",
        "its replay is being processed or sent right now and cannot be taken back; "
        "it resolves by itself once processed",
        False,
    )


def _take_back(conn: psycopg.Connection[Any], schema: str, letter: dict[str, Any]) -> str | None:
    """Abandon again the row a replay made due, if it has not started (framework.sql.messages.take_back);
    returns its table."""
    tables = {"inbox": [names.INBOX], "outbox": [names.OUTBOX], "broker": [names.OUTBOX, names.INBOX]}
    for table in tables[letter["source"]]:
        row = _x(
            conn,
            messages_sql.take_back(schema, table),
            {"id": letter["message_id"], "why": f"replay taken back: dead letter {letter['id']} discarded"},
        ).fetchone()
        if row is not None:
            return table
    return None


def resolve_replayed(conn: psycopg.Connection[Any], schema: str, *, ids: Sequence[int] | None = None) -> int:
    """Mark replayed letters whose message has since been processed (inbox) or published
    (outbox) as resolved. Touches only the ``dead_letters_unresolved_idx`` rows (and only
    the letters ``ids`` when given)."""
    total = 0
    for table, sources in ((names.INBOX, ["inbox", "broker"]), (names.OUTBOX, ["outbox"])):
        cur = _x(
            conn,
            dead_letters_sql.resolve_replayed(schema, table),
            {"sources": sources, "ids": None if ids is None else list(ids)},
        )
        total += cur.rowcount
    return total


def resolve_processed(cursor: psycopg.Cursor[Any], schema: str, message_ids: Sequence[uuid.UUID]) -> int:
    """For the worker, inside the transaction that marks ``message_ids`` processed: resolve
    their replayed letters at once (optional: the collector's sweep does it within seconds)."""
    cursor.execute(dead_letters_sql.resolve_processed(schema), {"ids": list(message_ids)})
    return cursor.rowcount
