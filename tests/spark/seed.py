"""Rows written straight into outbox/inbox/dead_letters with chosen timestamps.

The daemons are not involved: these tests check the job's arithmetic, so every row's
state and time must be exactly what the test says.
"""

from __future__ import annotations

import json
import uuid
from datetime import datetime, timedelta
from typing import Any

import psycopg

from framework.contracts import Registry
from framework.db import conninfo
from framework.dead_letters import fingerprint


def at(base: datetime, seconds: float) -> datetime:
    return base + timedelta(seconds=seconds)


class Seeder:
    def __init__(self, url: str, registry: Registry, service: str, schema: str = "txbox") -> None:
        self.conn = psycopg.connect(conninfo(url), autocommit=True)
        self.registry = registry
        self.service = service
        self.schema = schema

    def close(self) -> None:
        self.conn.close()

    def _common(self, message_type: str, mid: uuid.UUID, **kw: Any) -> dict[str, Any]:
        spec = self.registry.messages.get(message_type)
        row = {
            "id": mid,
            "message_type": message_type,
            "aggregate_type": spec.aggregate_type if spec else "thing",
            "aggregate_id": "1",
            "kind": spec.kind if spec else "event",
            "routing_key": spec.routing_key if spec else "foreign.thing.happened",
            "payload": json.dumps({}),
            "segment": f"x-{mid}",
            "created_at": kw["created_at"],
            "locked_until": kw.get("locked_until") or kw["created_at"],
            "started_attempts": kw.get("started", 1 if kw.get("processed_at") or kw.get("abandoned_at") else 0),
            "finished_attempts": kw.get("finished", 1 if kw.get("processed_at") or kw.get("abandoned_at") else 0),
            "processed_at": kw.get("processed_at"),
            "abandoned_at": kw.get("abandoned_at"),
            "last_error": kw.get("last_error"),
        }
        return row

    def _insert(self, table: str, row: dict[str, Any]) -> None:
        cols = ", ".join(row)
        marks = ", ".join(f"%({c})s" for c in row)
        self.conn.execute(f"INSERT INTO {self.schema}.{table} ({cols}) VALUES ({marks})", row)

    def outbox(self, message_type: str, created_at: datetime, mid: uuid.UUID | None = None, **kw: Any) -> uuid.UUID:
        mid = mid or uuid.uuid4()
        self._insert("outbox", self._common(message_type, mid, created_at=created_at, **kw))
        return mid

    def inbox(
        self, message_type: str, mid: uuid.UUID, message_timestamp: datetime, received_at: datetime, **kw: Any
    ) -> uuid.UUID:
        row = self._common(message_type, mid, created_at=kw.pop("created_at", received_at), **kw)
        row.update(
            message_timestamp=message_timestamp,
            received_at=received_at,
            queue=f"{self.service}:inbox",
            redelivered=kw.get("redelivered", False),
        )
        self._insert("inbox", row)
        return mid

    def dead_letter(
        self,
        mid: uuid.UUID | None,
        message_type: str | None,
        died_at: datetime,
        *,
        source: str = "inbox",
        reason: str = "max_attempts",
        error: str = "boom 42",
        discarded: bool = False,
    ) -> str:
        fp = fingerprint(message_type, reason, error)
        self._insert(
            "dead_letters",
            {
                "message_id": mid,
                "source": source,
                "reason": reason,
                "error": error,
                "fingerprint": fp,
                "message_type": message_type,
                "died_at": died_at,
                "discarded_at": died_at if discarded else None,
            },
        )
        return fp

    def redelivery(self, mid: uuid.UUID, count: int, first_seen: datetime) -> None:
        self._insert(
            "redeliveries",
            {
                "queue": f"{self.service}:inbox",
                "message_id": str(mid),
                "count": count,
                "first_seen": first_seen,
                "last_seen": first_seen,
            },
        )
