"""A contract's catastrophic `pattern` against a running `txbox receiver`, fed with plain pika.

docs/explanation/receive.md, "Contracts are outside input": a pattern never runs in a
backtracking engine on a sender's data, including the wording of the error after the
payload was rejected. ``^(a+)+$`` and ``(a|aa)+$`` on ``'a' * 40 + '!'`` take a
backtracking engine about 2**40 steps; the receiver must dead-letter those payloads with
the reason ``schema_invalid`` and go on storing the next message. The verdict comes from
the database; the pytest timeout is the only clock.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from framework import topology
from framework.envelope import Message
from framework.service import Service
from framework.settings import Settings
from tests import support
from tests.apps.helpers import publish, query
from txbox_tools.processes import ProcessGroup

SERVICE = "pattern-service"
ROUTING_KEY = f"{SERVICE}.thing.place"
HOSTILE = "a" * 40 + "!"


def contracts(folder: Path) -> Path:
    """The contract as another team would commit it: raw YAML, catastrophic patterns."""
    folder.mkdir()
    (folder / "pattern-service.yml").write_text(
        f"""asyncapi: 2.6.0
x-service-id: {SERVICE}
info: {{title: Pattern, version: '1'}}
channels:
  thing.place:
    publish:
      message:
        name: PlaceThing
        tags: [{{name: 'aggregate-type:thing'}}]
        payload:
          type: object
          required: [nested, alternation]
          properties:
            nested: {{type: string, pattern: '^(a+)+$'}}
            alternation: {{type: string, pattern: '(a|aa)+$'}}
          patternProperties:
            '^(x+)+$': {{type: string}}
""",
        encoding="utf-8",
    )
    return folder


def envelope(payload: dict[str, Any]) -> bytes:
    message = Message(
        message_id=uuid.uuid4(),
        message_type="PlaceThing",
        aggregate_type="thing",
        aggregate_id="1",
        payload=payload,
        message_context={},
    )
    return json.dumps(message.to_dict()).encode()


@pytest.mark.timeout(240)
def test_a_catastrophic_pattern_costs_bounded_time_in_the_receiver(
    database_url: str, amqp_url: str, processes: ProcessGroup, tmp_path: Path
) -> None:
    folder = contracts(tmp_path / "contracts")
    env = {
        "TXBOX_SERVICE": SERVICE,
        "TXBOX_DATABASE_URL": database_url,
        "TXBOX_AMQP_URL": amqp_url,
        "TXBOX_CONTRACTS_DIR": str(folder),
        "TXBOX_QUEUE_TYPE": os.environ.get("TXBOX_QUEUE_TYPE", "quorum"),
    }
    settings = Settings(
        service=SERVICE,
        database_url=database_url,
        amqp_url=amqp_url,
        contracts_dir=folder,
        queue_type=env["TXBOX_QUEUE_TYPE"],
    )  # type: ignore[arg-type]
    topology.declare(settings, Service(settings=settings).registry)
    bodies = [
        envelope({"nested": HOSTILE, "alternation": "a"}),
        envelope({"nested": "a", "alternation": HOSTILE}),
        envelope({"nested": "a", "alternation": "a", "x" * 40 + "!": 1}),  # a key: patternProperties
        envelope({"nested": "aaa", "alternation": "aa"}),  # valid: stored after the others
    ]
    publish(amqp_url, bodies, routing_key=ROUTING_KEY)
    receiver = processes.start("receiver", ["receiver"], env=env)

    def settled() -> bool:
        dead = query(database_url, "SELECT count(*) FROM txbox.dead_letters")[0][0]
        stored = query(database_url, "SELECT count(*) FROM txbox.inbox")[0][0]
        return bool(dead == 2 and stored == 2)

    support.wait_until(settled, 180, message=f"two dead letters and two stored\n{receiver.log_tail()}")
    reasons = query(database_url, "SELECT reason, error FROM txbox.dead_letters ORDER BY error")
    assert [r for r, _ in reasons] == ["schema_invalid", "schema_invalid"]
    assert 'nested: "' + HOSTILE + '" does not match "^(a+)+$"' in reasons[1][1]
    assert 'alternation: "' + HOSTILE + '" does not match "(a|aa)+$"' in reasons[0][1]
    assert receiver.alive
