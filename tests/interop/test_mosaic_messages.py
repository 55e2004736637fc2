"""Mosaic's own message definitions (``@axinom/mosaic-messages``) through txbox's contracts.

The npm package (installed in tests/interop/peer by ``make setup``) ships Mosaic's real
payload schemas (``src/generated/schemas/payloads``) and the messaging settings Mosaic's
code generator wrote from its AsyncAPI documents (``src/generated/config``), but not the
AsyncAPI documents themselves. So the test writes them: one document per settings
class, as Mosaic's generator reads them (a channel per message, its
``bindings.amqp.queue.name``, an ``aggregate-type:`` tag, a payload ``$ref`` to the real
schema file, no ``name:``), beside a copy of the package's schemas, plus a txbox
service's own event whose fields ``$ref`` into those files. Judged:

- every one of the package's messages loads, and the message type txbox derives from
  the real schema's ``title`` is the type Mosaic's generator wrote;
- the routing key and the receiving queue txbox derives are those Mosaic's own message
  bus (``RascalConfigBuilder``) builds from the settings; where a channel binds a queue
  of its own, txbox says so (a warning) and receives it in ``<service>:inbox``;
- ``txbox codegen`` of all of them passes ``mypy --strict``, and fields that ``$ref`` into
  the package's files have real types (mypy refuses a wrong one).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

from framework import codegen, names
from framework.contracts import load_registry

pytestmark = pytest.mark.acceptance

PEER_DIR = Path(__file__).resolve().parent / "peer"
PACKAGE = PEER_DIR / "node_modules" / "@axinom" / "mosaic-messages"
SUBSCRIBER = "txbox-subscriber"


def mosaic_settings() -> list[dict[str, str]]:
    """Every settings object of the package, with Mosaic's bus's routing key and queue for it."""
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed: run `make setup` (it installs nodejs and npm from Debian)")
    if not (PACKAGE / "src" / "generated" / "schemas").is_dir():
        pytest.fail(f"@axinom/mosaic-messages is missing in {PEER_DIR}/node_modules: run `make setup`")
    done = subprocess.run(
        [node, "mosaic-messages-settings.js", SUBSCRIBER], cwd=PEER_DIR, capture_output=True, text=True, timeout=120,
        check=True,
    )  # fmt: skip
    return typing.cast(list[dict[str, str]], json.loads(done.stdout))


def kebab(pascal: str) -> str:
    return re.sub(r"(?<!^)([A-Z])", r"-\1", pascal).lower()


def schema_file(schemas: Path, entry: dict[str, str]) -> Path:
    """The package's schema of ``entry``, found by the package's own file naming."""
    stem = kebab(entry["messageType"])
    found = [
        *schemas.glob(f"*/{entry['action']}s/{stem}-{entry['action']}.json"),
        *schemas.glob(f"*/types/{stem}.json"),  # an event whose schema Mosaic keeps with its types
    ]
    assert len(found) == 1, (entry, found)
    return found[0]


AUDIT_SCHEMA = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "title": "image_types_audited_event",
    "description": "A txbox service's event quoting Mosaic's own types.",
    "additionalProperties": False,
    "required": ["declared", "first_new_type"],
    "properties": {
        "declared": {"$ref": "../mosaic/image/events/image-types-declared-event.json"},
        "first_new_type": {
            "$ref": "../mosaic/image/events/image-types-declared-event.json#/properties/new_image_types/items"
        },
    },
}


def write_contracts(root: Path, settings: list[dict[str, str]]) -> dict[str, Path]:
    """The contracts folder: the package's schemas, a document per settings class, the audit service."""
    shutil.copytree(
        PACKAGE / "src" / "generated" / "schemas" / "payloads",
        root / "mosaic",
        ignore=lambda folder, files: [f for f in files if not f.endswith(".json") and not (Path(folder) / f).is_dir()],
    )
    used: dict[str, Path] = {}
    documents: dict[str, dict[str, Any]] = {}
    for entry in settings:
        path = schema_file(root / "mosaic", entry)
        used[entry["messageType"]] = path
        doc = documents.setdefault(
            entry["settingsClass"],
            {
                "asyncapi": "2.0.0",
                "info": {"title": entry["settingsClass"], "version": "1.0.0"},
                "x-service-id": entry["serviceId"],
                "channels": {},
                "components": {"messages": {}},
            },
        )
        key = path.stem
        doc["channels"][entry["routingKey"]] = {
            "bindings": {"amqp": {"queue": {"name": entry["queue"]}}},
            "publish" if entry["action"] == "command" else "subscribe": {
                "message": {"$ref": f"#/components/messages/{key}"}
            },
        }
        doc["components"]["messages"][key] = {
            "tags": [{"name": f"aggregate-type:{entry['aggregateType']}"}],
            "contentType": "application/json",
            "payload": {"$ref": path.relative_to(root).as_posix()},
        }
    for settings_class, doc in documents.items():
        (root / f"{kebab(settings_class)}-asyncapi.yml").write_text(yaml.safe_dump(doc, sort_keys=False))
    (root / "audit").mkdir()
    (root / "audit" / "image-types-audited-event.json").write_text(json.dumps(AUDIT_SCHEMA))
    (root / "audit" / "audit-service-asyncapi.yml").write_text(
        textwrap.dedent(
            """\
            asyncapi: 2.0.0
            info: {title: Audit Service, version: '1.0.0'}
            x-service-id: audit-service
            channels:
              image_types.audited:
                subscribe: {message: {$ref: '#/components/messages/image-types-audited-event'}}
            components:
              messages:
                image-types-audited-event:
                  tags: [{name: 'aggregate-type:image-type'}]
                  payload: {$ref: image-types-audited-event.json}
            """
        )
    )
    return used


@pytest.fixture(scope="module")
def mosaic(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, str]]]:
    root = tmp_path_factory.mktemp("contracts")
    settings = mosaic_settings()
    write_contracts(root, settings)
    return root, settings


def test_txbox_derives_mosaics_message_types_routing_keys_and_queues(mosaic: tuple[Path, list[dict[str, str]]]) -> None:
    root, settings = mosaic
    assert len(settings) > 100  # the package's every message (157 in 0.73.0)
    reg = load_registry(root)  # strict: an error in any document raises
    per_channel: set[tuple[str, str]] = set()
    for entry in settings:
        spec = reg.get(entry["messageType"])  # the type txbox derives from the real schema's title
        assert spec.message_type == entry["messageType"], entry
        assert (spec.kind, spec.service, spec.aggregate_type) == (
            entry["action"],
            entry["serviceId"],
            entry["aggregateType"],
        ), entry
        assert spec.routing_key == entry["wireRoutingKey"], entry
        receiver = entry["serviceId"] if spec.kind == "command" else SUBSCRIBER
        assert names.mosaic_queue(receiver, spec.queue) == entry["receiveQueue"], entry
        if spec.queue == names.MOSAIC_INBOX:  # Mosaic's queue is txbox's inbox queue
            assert names.inbox_queue(receiver) == entry["receiveQueue"], entry
        else:
            per_channel.add((entry["settingsClass"], entry["routingKey"]))
    # Two settings classes of one service id (Admin and Id are both ax-id-service) make one service.
    assert len(reg.service("ax-id-service").paths) >= 2
    # Each channel with a queue of its own is a warning naming it; nothing else is a problem.
    warned = {
        (Path(p.where.split(": ")[0]).name, p.where.split(": ")[1])
        for p in reg.problems
        if p.where.endswith(".bindings.amqp.queue.name")
    }
    expected = {
        (f"{kebab(cls)}-asyncapi.yml", f"channels.{channel}.bindings.amqp.queue.name") for cls, channel in per_channel
    }
    assert per_channel and warned == expected
    others = [str(p) for p in reg.problems if not p.where.endswith(".bindings.amqp.queue.name")]
    assert all(p.severity == "warning" and "should be named" in p.message for p in reg.problems if str(p) in others), (
        others
    )


HANDLER = textwrap.dedent(
    """\
    import messages

    def service_of(event: messages.ImageTypesAudited) -> str:
        return event["declared"]["service_id"] + event["first_new_type"]["image_type"]

    def titles(event: messages.ImageTypesDeclared) -> list[str]:
        return [t["title"] for t in event["new_image_types"]]

    WRONG: messages.ImageTypesAudited = {
        "declared": {"service_id": 1, "new_image_types": []},
        "first_new_type": {"image_type": "png"},
    }
    """
)


@pytest.mark.slow
def test_codegen_of_mosaics_messages_passes_mypy_strict_with_real_types_across_files(
    mosaic: tuple[Path, list[dict[str, str]]], tmp_path: Path
) -> None:
    root, _ = mosaic
    out = tmp_path / "messages.py"
    codegen.write(out, root)
    text = out.read_text()
    assert max(map(len, text.splitlines())) <= 120
    (audited,) = [line for line in text.splitlines() if line.startswith(("    declared:", "    first_new_type:"))][:1]
    assert "Any" not in audited, audited
    (tmp_path / "handler.py").write_text(HANDLER)
    cache = str(tmp_path / "cache")
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", cache, "messages.py", "handler.py"]
    result = subprocess.run(
        command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=600, check=False
    )
    # The generated module is clean; the handler's WRONG value is refused: an int for the
    # str id, and a key the real schema requires missing. Fields typed Any would take both.
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 2 and all(line.startswith("handler.py:") for line in errors), result.stdout + result.stderr
    assert '"service_id"' in result.stdout and 'Missing key "title"' in result.stdout, result.stdout
