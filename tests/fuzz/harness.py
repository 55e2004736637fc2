"""Drive the real daemons with a batch of cases and judge every case from the database.

One round: publish the batch with plain pika (confirms on), then a sentinel valid message
through the inbox queue; the receiver stores and commits in delivery order, so once the
sentinel's row exists every earlier delivery of that queue is settled. Then a sentinel
dead letter does the same for the collector (published only after the first, so what the
broker dead-lettered from the inbox queue, e.g. an expired message, is ahead of it).
Verdicts are per case, found by the tag header or, where a daemon dropped the headers,
by the body itself.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any

import pika
import pika.exceptions
import psycopg

from framework import names, topology
from framework.db import conninfo
from framework.dead_letters import decode_body, stored_body
from framework.redaction import drop_key
from framework.service import Service
from tests import support
from tests.fuzz.cases import MAX_BODY_BYTES, ROUTES, SERVICE, TAG, Case, describe, dumps, envelope
from txbox_tools.processes import Daemon, ProcessGroup

INBOX_QUEUE = f"{SERVICE}:inbox"
DEAD_LETTER_QUEUE = f"{SERVICE}:dead_letter"
DAEMONS = {"receiver": INBOX_QUEUE, "collector": DEAD_LETTER_QUEUE}
PUBLISH_RECURSION_LIMIT = 20_000  # pika encodes nested header tables recursively
PARKED_ROUNDS = 5  # sentinel rounds while deliveries come back from the delay queues
PARKED_WAIT = 40.0  # s beyond the round timeout: a parked delivery returns after 10 s (30 s later in the schedule)


@dataclass(frozen=True)
class Finding:
    daemon: str
    symptom: str
    case: str = ""

    def __str__(self) -> str:
        return f"[{self.daemon}] {self.symptom}" + (f"\n      {self.case}" if self.case else "")


@dataclass
class Fuzzer:
    service: Service
    database_url: str
    amqp_url: str
    vhost: str
    log_dir: Path
    round_timeout: float
    group: ProcessGroup = field(init=False)
    refused: int = 0  # cases the broker or pika would not take (not a daemon's fault)
    published: int = 0

    def __post_init__(self) -> None:
        self.group = ProcessGroup(log_dir=self.log_dir)

    # --- daemons ------------------------------------------------------------------------

    def env(self) -> dict[str, str]:
        return {
            "TXBOX_SERVICE": SERVICE,
            "TXBOX_DATABASE_URL": self.database_url,
            "TXBOX_AMQP_URL": self.amqp_url,
            "TXBOX_CONTRACTS_DIR": str(self.service.settings.contracts_dir),
            "TXBOX_QUEUE_TYPE": self.service.settings.queue_type,
            "TXBOX_RECEIVER_MAX_BODY_BYTES": str(MAX_BODY_BYTES),
            "TXBOX_COLLECTOR_FLUSH_INTERVAL": "50ms",
        }

    def start(self) -> None:
        topology.declare(self.service.settings, self.service.registry)
        for name in DAEMONS:
            self.group.start(name, [name], self.env())
        support.wait_until(
            lambda: all(self._consumers(q) for q in DAEMONS.values()) or self.group.dead(),
            timeout=60,
            message="the receiver and the collector consuming",
        )
        assert not self.group.dead(), self._death_report()

    def restart(self) -> None:
        """After a broken round: stop everything, drop what is left in the queues, start again."""
        self.group.stop_all(timeout=10)
        self.group.daemons.clear()
        with self._channel() as channel:
            for queue in DAEMONS.values():
                channel.queue_purge(queue)
        self.start()

    def stop(self) -> dict[str, int | None]:
        codes = {d.name: self.group.stop(d) for d in self.group.daemons}
        self.group.daemons.clear()
        return codes

    def logs(self, lines: int = 40) -> str:
        """The end of every daemon's log (restarts append to the same file)."""
        out = []
        for path in sorted(self.log_dir.glob("*.log")):
            text = path.read_text(errors="replace").splitlines()
            out.append(f"--- {path} (last {lines} lines)\n" + "\n".join(line[:300] for line in text[-lines:]))
        return "\n".join(out)

    def _death_report(self) -> str:
        return "; ".join(f"{d.name} exited with {d.process.poll()}: {_last_error(d)}" for d in self.group.dead())

    def _consumers(self, queue: str) -> int:
        with self._channel() as channel:
            return int(channel.queue_declare(queue, passive=True).method.consumer_count)

    def _ready(self, queue: str) -> int:
        with self._channel() as channel:
            return int(channel.queue_declare(queue, passive=True).method.message_count)

    @contextlib.contextmanager
    def _channel(self) -> Iterator[Any]:
        connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
        try:
            yield connection.channel()
        finally:
            with contextlib.suppress(pika.exceptions.AMQPError):
                connection.close()

    # --- one round ------------------------------------------------------------------------

    def round(self, cases: list[Case]) -> list[Finding]:
        since = self._now()
        sent = self.publish(cases)
        findings = self.settle()
        verdicts = self.judge(sent, since)
        if findings:
            self.restart()
            # What a crash or a stall left undone is a consequence, not a class of its own.
            verdicts = [Finding(f.daemon, f"{f.symptom} (in a round where a daemon broke)", f.case) for f in verdicts]
        return findings + verdicts

    def publish(self, cases: list[Case]) -> list[Case]:
        """Publish with confirms; returns the cases the broker took (confirmed)."""
        sent: list[Case] = []
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, PUBLISH_RECURSION_LIMIT))
        connection: pika.BlockingConnection | None = None
        try:
            for case in cases:
                if connection is None or not connection.is_open:
                    connection = pika.BlockingConnection(pika.URLParameters(self.amqp_url))
                    channel = connection.channel()
                    channel.confirm_delivery()
                exchange, key = ROUTES[case.route]
                props = pika.BasicProperties(
                    **{**case.properties, "headers": {**case.properties["headers"], TAG: case.tag}}
                )
                try:
                    channel.basic_publish(exchange, key, case.body, props, mandatory=True)
                except Exception:  # pika cannot encode it, or the broker closed the channel on it
                    self.refused += 1
                    with contextlib.suppress(Exception):
                        connection.close()
                    connection = None
                    continue
                sent.append(case)
        finally:
            sys.setrecursionlimit(limit)
            if connection is not None and connection.is_open:
                with contextlib.suppress(pika.exceptions.AMQPError):
                    connection.close()
        self.published += len(sent)
        return sent

    def settle(self) -> list[Finding]:
        """Sentinels through both daemons until nothing is parked in the delay queues.

        A delivery the receiver could not store (its database connection dropped: on a
        shared server another suite may terminate it) waits in a delay queue and comes
        back after the sentinels; judged then, it would look lost. So once the delay
        queues are empty, the sentinels go through again.
        """
        for _ in range(PARKED_ROUNDS):
            findings = self._sentinels()
            parked = self._parked()
            if findings or not parked:
                return findings
            if not self._wait(lambda: not self._parked(), timeout=self.round_timeout + PARKED_WAIT):
                return [Finding("receiver", f"{parked} deliveries stayed in the delay queues")]
        return [Finding("receiver", f"deliveries still being parked after {PARKED_ROUNDS} rounds of sentinels")]

    def _parked(self) -> int:
        return sum(self._ready(names.delay_queue(seconds)) for seconds in names.DELAY_SECONDS)

    def _sentinels(self) -> list[Finding]:
        """Sentinels through both daemons; findings if a daemon died or did not get there in time."""
        findings: list[Finding] = []
        sentinel = uuid.uuid4()
        marker = uuid.uuid4().hex
        steps: list[tuple[str, Case, Callable[[], bool]]] = [
            (
                "receiver",
                Case("valid", "command", dumps(envelope(sentinel)), {"headers": {}}, "sentinel", sentinel, marker),
                lambda: bool(self._query("SELECT 1 FROM txbox.inbox WHERE id = %s", (sentinel,))),
            ),
            (
                "collector",
                Case("collected", "dead_letter", b"sentinel " + marker.encode(), {"headers": {}}, "sentinel"),
                lambda: bool(
                    self._query("SELECT 1 FROM txbox.dead_letters WHERE raw_body = %s", (f"sentinel {marker}",))
                ),
            ),
        ]
        for daemon, case, done in steps:
            self.publish([case])
            self.published -= 1
            reached = self._wait(done)
            dead = self.group.dead()
            if dead:
                return [Finding(d.name, f"died: exit {d.process.poll()}: {_last_error(d)}") for d in dead]
            if not reached:
                findings.append(
                    Finding(daemon, f"did not settle within {self.round_timeout:.0f}s (stuck, crash-looping or lost)")
                )
                return findings
        for daemon, queue in DAEMONS.items():
            if ready := self._ready(queue):
                findings.append(Finding(daemon, f"{queue} not drained: {ready} messages still ready"))
        return findings

    def _wait(self, done: Callable[[], bool], timeout: float | None = None) -> bool:
        deadline = time.monotonic() + (self.round_timeout if timeout is None else timeout)
        while time.monotonic() < deadline:
            if done():
                return True
            if self.group.dead():
                return False
            support.pause(0.05)  # polling interval of a condition with a deadline
        return done()

    # --- verdicts -------------------------------------------------------------------------

    def judge(self, cases: list[Case], since: Any) -> list[Finding]:
        tags = [c.tag for c in cases]
        ids = [c.message_id for c in cases if c.message_id is not None]
        rows = self._query(
            "SELECT id, metadata->'properties'->'headers'->>%s, payload::text, aggregate_id FROM txbox.inbox "
            "WHERE id = ANY(%s) OR metadata->'properties'->'headers'->>%s = ANY(%s)",
            (TAG, ids, TAG, tags),
        )
        letters = self._query(
            "SELECT id, headers->>%s, reason, raw_body, raw_encoding, message::text, headers::text "
            "FROM txbox.dead_letters WHERE died_at >= %s AND coalesce(raw_body, '') NOT LIKE 'sentinel %%'",
            (TAG, since),
        )
        letters_of, untraced = _trace(cases, letters)
        findings = [
            Finding("receiver/collector", "a dead letter traceable to no published case", repr(u)[:300])
            for u in untraced
        ]
        rows_by_tag: dict[str, int] = {}
        rows_by_id: dict[Any, list[Any]] = {}
        for row_id, tag, payload, aggregate_id in rows:
            rows_by_tag[tag] = rows_by_tag.get(tag, 0) + 1
            rows_by_id.setdefault(row_id, []).append((json.loads(payload), aggregate_id))
        groups: dict[Any, list[Case]] = {}
        for case in cases:
            mine = letters_of.get(case.tag, [])
            daemon = "collector" if case.route == "dead_letter" else "receiver"
            if case.expect in ("valid", "dup_same", "dup_conflict"):
                groups.setdefault(case.message_id, []).append(case)
                continue
            stored = rows_by_tag.get(case.tag, 0)
            if case.expect == "either":
                if stored + len(mine) != 1:
                    findings.append(
                        Finding(
                            daemon,
                            f"ended in {stored} inbox rows and {len(mine)} dead letters (want exactly one)",
                            describe(case),
                        )
                    )
            elif stored or len(mine) != 1:
                findings.append(
                    Finding(
                        daemon,
                        f"{case.expect}: {stored} inbox rows, {len(mine)} dead letters (want 0 and 1)",
                        describe(case),
                    )
                )
            findings += [
                Finding(daemon, problem, describe(case)) for letter in mine if (problem := _body_kept(case, letter))
            ]
        for message_id, members in groups.items():
            findings += _judge_group(members, rows_by_id.get(message_id, []), letters_of)
        return findings

    def _now(self) -> Any:
        return self._query("SELECT clock_timestamp()")[0][0]

    def _query(self, statement: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
        with psycopg.connect(conninfo(self.database_url), autocommit=True) as conn:
            return conn.execute(statement, params).fetchall()  # type: ignore[arg-type]


def _content(body: bytes) -> tuple[Any, Any]:
    data = json.loads(body)
    return data["payload"], data["aggregate_id"]


def _judge_group(members: list[Case], rows: list[Any], letters_of: dict[str, list[Any]]) -> list[Finding]:
    """One message id: stored exactly once; copies with the stored content quiet, others id_conflict."""
    if len(rows) != 1:
        return [
            Finding(
                "receiver", f"a valid message stored {len(rows)} times (want 1){_reasons(letters_of, c)}", describe(c)
            )
            for c in members
            if c.expect == "valid"
        ]
    stored = rows[0]
    findings = []
    for case in members:
        mine = letters_of.get(case.tag, [])
        if _content(case.body) == stored:
            if mine:
                reasons = sorted({letter[2] for letter in mine})
                findings.append(
                    Finding("receiver", f"{case.expect}: dead-lettered {reasons} although stored", describe(case))
                )
        elif [letter[2] for letter in mine] != ["id_conflict"]:
            reasons = [letter[2] for letter in mine]
            symptom = "silently dropped (no dead letter)" if not mine else f"dead-lettered as {reasons}"
            findings.append(
                Finding("receiver", f"same id, other content: {symptom}; want one id_conflict", describe(case))
            )
    return findings


def _reasons(letters_of: dict[str, list[Any]], case: Case) -> str:
    reasons = sorted({str(letter[2]) for letter in letters_of.get(case.tag, [])})
    return f", dead-lettered as {', '.join(reasons)}" if reasons else ""


def _trace(cases: list[Case], letters: list[tuple[Any, ...]]) -> tuple[dict[str, list[Any]], list[Any]]:
    """Dead letters per case tag: by the tag header, else the tag anywhere in the headers, else the body.

    A daemon may keep the headers in another shape (the collector wraps headers jsonb
    refused as one string), so the tag, 32 random hex digits, is also looked for in
    their text; only then by the body, among cases no letter was traced to yet.
    """
    by_tag: dict[str, list[Any]] = {}
    known = {c.tag for c in cases}
    untraced = []
    for letter in sorted(letters, key=lambda row: row[1] not in known):  # tagged first
        tag = letter[1]
        if tag not in known:
            tag = next((c.tag for c in cases if c.tag in (letter[6] or "")), None)
        if tag is None:
            candidates = [c for c in cases if _body_kept(c, letter) is None]
            tag = next((c.tag for c in candidates if c.tag not in by_tag), None)
            tag = tag or (candidates[0].tag if candidates else None)
        if tag is None:
            untraced.append(letter)
        else:
            by_tag.setdefault(tag, []).append(letter)
    return by_tag, untraced


def _as_kept(body: bytes) -> bytes:
    """What a dead letter keeps of a body: secrets redacted, at most the first 64 KiB (dead_letters.BODY_LIMIT)."""
    stored = stored_body(body)
    return decode_body(stored.text, stored.encoding)


def _body_kept(case: Case, letter: tuple[Any, ...]) -> str | None:
    """None when the dead letter holds the body as published (raw bytes, or the same JSON value)."""
    _, _, _, raw, encoding, message, _ = letter
    if raw is not None:
        return (
            None
            if decode_body(raw, encoding) == _as_kept(case.body)
            else "the dead letter's raw body differs from the body sent"
        )
    if message is not None:
        # Numbers compared as values: jsonb keeps a number, not its spelling (1e16, 1E+16 and
        # 10000000000000000 are one number); a letter never keeps the auth_token.
        exact = {"parse_float": Decimal, "parse_int": Decimal}
        try:
            sent = json.loads(case.body, **exact)
        except ValueError:
            return "the dead letter keeps a parsed message for a body that is not JSON"
        sent = drop_key(sent) if isinstance(sent, dict) else sent
        if sent == json.loads(message, **exact):
            return None
        return "the dead letter's message differs from the body sent (exact bytes lost)"
    return "the dead letter keeps neither the raw body nor the message"


def _last_error(daemon: Daemon) -> str:
    lines = [line for line in daemon.log_tail(60).splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors[-1] if errors else (lines[-1] if lines else "(no log)"))[:300]
