"""A contracts folder laid out as Mosaic's media template lays out its messages, loaded as it is.

The test writes the folder itself, in Mosaic's format: a ``.spectral.yaml`` beside the
documents; two AsyncAPI documents with one service id (``media`` and ``publish`` are both
``media-service``); payload schemas sharing ids and types through ``common.json`` files
(``$ref`` into other files, ``../../common.json#/definitions/...``); channels binding
Mosaic's per-channel queues (``bindings.amqp.queue.name: channel:prepare_live_stream``); a
contract from before Mosaic required the ``aggregate-type:`` tag; and Mosaic's
``image_service.enable`` channel, whose first word merely looks like the service id.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any

import pytest

from framework import codegen, names
from framework.cli import main
from framework.contracts import Registry, load_registry

ROOT = Path(__file__).resolve().parents[2]

SPECTRAL = """\
rules:
  property-snake-case:
    description: Property names must be in snake_case.
    type: style
    given: '$..properties.*~'
    severity: error
    then:
      function: casing
      functionOptions:
        type: snake
"""

COMMON = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "common",
    "description": "Common definitions.",
    "definitions": {
        "non_empty_string": {"type": "string", "minLength": 1, "pattern": "^$|.*\\S.*", "description": "Text."},
        "non_empty_uuid": {"type": "string", "minLength": 32, "maxLength": 36, "format": "uuid", "description": "Id."},
    },
}

PUBLISH_COMMON = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "common",
    "description": "Common definitions in published feed metadata.",
    "definitions": {
        "movie_id": {"type": "string", "pattern": "^(movie)-([a-zA-Z0-9_-]+)$", "description": "A movie."},
        "license": {
            "type": "object",
            "title": "license",
            "description": "Where and when the content is available.",
            "required": ["start_time"],
            "properties": {
                "start_time": {"type": "string", "format": "date-time", "description": "From."},
                "countries": {"type": "array", "items": {"type": "string"}, "description": "Where."},
            },
        },
        "licenses": {"type": "array", "items": {"$ref": "#/definitions/license"}, "description": "Licenses."},
        "title": {"$ref": "../common.json#/definitions/non_empty_string"},
    },
}


def _schema(title: str, properties: dict[str, Any], required: list[str]) -> dict[str, Any]:
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "type": "object",
        "title": title,
        "description": f"{title} schema.",
        "additionalProperties": False,
        "required": required,
        "properties": properties,
    }


def _message(key: str, payload: str, aggregate: str | None = "entity") -> str:
    tags = (
        f"\n      tags:\n        - name: aggregate-type:{aggregate}\n        - name: aggregate-id-field:{aggregate} ID"
    )
    return f"""
    {key}:{tags if aggregate else ""}
      contentType: application/json
      payload:
        $ref: '{payload}'"""


def _channel(channel: str, op: str, key: str, queue: str = "inbox") -> str:
    return f"""
  '{channel}':
    bindings:
      amqp:
        queue:
          name: {queue}
    {op}:
      message:
        $ref: '#/components/messages/{key}'"""


def _asyncapi(title: str, service: str, channels: list[str], messages: list[str]) -> str:
    return f"""asyncapi: 2.0.0
info:
  title: {title}
  version: '1.0.0'
  description: |
    {title}
# AsyncAPI extension, used to define service id. If not defined, as service id will be used
# info.title in lower-kebab-case
x-service-id: {service}

channels:{"".join(channels)}
components:
  messages:{"".join(messages)}
"""


def write_media_folder(root: Path) -> Path:
    """The folder, as Mosaic's media template lays it out (``schemas/`` with ``payloads/``)."""
    payloads = root / "payloads"
    files: dict[str, Any] = {
        "payloads/common.json": COMMON,
        "payloads/publish/common.json": PUBLISH_COMMON,
        "payloads/media/commands/delete-entity-command.json": _schema(
            "delete_entity_command",
            {
                "entity_id": {"$ref": "../../common.json#/definitions/non_empty_uuid"},
                "entity_type": {"$ref": "../../common.json#/definitions/non_empty_string"},
            },
            ["entity_id", "entity_type"],
        ),
        "payloads/media/event/entity-deleted-event.json": _schema(
            "entity_deleted_event",
            {"entity_id": {"$ref": "../../common.json#/definitions/non_empty_uuid"}},
            ["entity_id"],
        ),
        "payloads/publish/movie-published-event.json": _schema(
            "movie_published_event",
            {
                "content_id": {"$ref": "./common.json#/definitions/movie_id"},
                "title": {"$ref": "./common.json#/definitions/title"},
                "licenses": {"$ref": "./common.json#/definitions/licenses"},
            },
            ["content_id", "title"],
        ),
        "payloads/publish/movie-unpublished-event.json": _schema(
            "movie_unpublished_event",
            {
                "content_id": {"$ref": "./common.json#/definitions/movie_id"},
                "licenses": {"$ref": "./common.json#/definitions/licenses"},
            },
            ["content_id"],
        ),
        "payloads/vod-to-live/commands/prepare-channel-live-stream-command.json": _schema(
            "prepare_channel_live_stream_command",
            {"channel_id": {"$ref": "../../common.json#/definitions/non_empty_uuid"}},
            ["channel_id"],
        ),
        "payloads/vod-to-live/events/live-stream-protection-key-created-event.json": _schema(
            "live_stream_protection_key_created_event",
            {"channel_id": {"$ref": "../../common.json#/definitions/non_empty_uuid"}, "key_id": {"type": "string"}},
            ["channel_id", "key_id"],
        ),
        "payloads/ingest/commands/start-ingest-command.json": _schema(
            "start_ingest_command",
            {"ingest_document_id": {"$ref": "../../common.json#/definitions/non_empty_uuid"}},
            ["ingest_document_id"],
        ),
        "payloads/image/commands/image-service-enable-command.json": _schema(
            "image_service_enable_command", {"environment_id": {"type": "string"}}, ["environment_id"]
        ),
    }
    for name, doc in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(json.dumps(doc, indent=2))
    (root / ".spectral.yaml").write_text(SPECTRAL)
    (payloads / "media" / "media-service-asyncapi.yml").write_text(
        _asyncapi(
            "Media Service",
            "media-service",
            [
                _channel("entity.delete", "publish", "delete-entity-command"),
                _channel("entity.deleted", "subscribe", "entity-deleted-event"),
            ],
            [
                _message("delete-entity-command", "commands/delete-entity-command.json"),
                _message("entity-deleted-event", "event/entity-deleted-event.json"),
            ],
        )
    )
    (payloads / "publish" / "publish-service-asyncapi.yml").write_text(
        _asyncapi(
            "Publish Service",
            "media-service",  # as in the media template: the same service as media's document
            [
                _channel("movie.published", "subscribe", "movie-published-event"),
                _channel("movie.unpublished", "subscribe", "movie-unpublished-event"),
            ],
            [
                _message("movie-published-event", "movie-published-event.json", "movie"),
                _message("movie-unpublished-event", "movie-unpublished-event.json", "movie"),
            ],
        )
    )
    (payloads / "vod-to-live" / "vod-to-live-service-asyncapi.yml").write_text(
        _asyncapi(
            "VOD-to-Live Service",
            "vod-to-live-service",
            [
                _channel(
                    "channel.prepare_live_stream",
                    "publish",
                    "prepare-channel-live-stream-command",
                    "channel:prepare_live_stream",
                ),
                _channel(
                    "channel.protection_key_created",
                    "subscribe",
                    "channel-protection-key-created-event",
                    "channel:protection_key_created",
                ),
            ],
            [
                _message(
                    "prepare-channel-live-stream-command",
                    "commands/prepare-channel-live-stream-command.json",
                    "channel",
                ),
                _message(
                    "channel-protection-key-created-event",
                    "events/live-stream-protection-key-created-event.json",
                    "channel",
                ),
            ],
        )
    )
    # Written before Mosaic required the aggregate-type tag: none.
    (payloads / "ingest" / "ingest-service-asyncapi.yml").write_text(
        _asyncapi(
            "Ingest Service",
            "ingest-service",
            [_channel("ingest.start", "publish", "start-ingest-command")],
            [_message("start-ingest-command", "commands/start-ingest-command.json", None)],
        )
    )
    # Mosaic names a service's enable command `<name>_service.enable`.
    (payloads / "image" / "image-service-asyncapi.yml").write_text(
        _asyncapi(
            "Image Service",
            "image-service",
            [_channel("image_service.enable", "publish", "image-service-enable-command")],
            [_message("image-service-enable-command", "commands/image-service-enable-command.json", "environment")],
        )
    )
    return root


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    return write_media_folder(tmp_path / "schemas")


def test_the_folder_loads_as_it_is(folder: Path) -> None:
    reg = load_registry(folder)  # strict: any error raises
    assert not reg.errors
    media = reg.service("media-service")
    assert [p.name for p in media.paths] == ["media-service-asyncapi.yml", "publish-service-asyncapi.yml"]
    assert sorted(s.message_type for s in media.events) == ["EntityDeleted", "MoviePublished", "MovieUnpublished"]
    assert [s.message_type for s in media.commands] == ["DeleteEntity"]
    assert reg.get("MoviePublished").routing_key == "media-service.movie.published"
    assert reg.get("PrepareChannelLiveStream").routing_key == "vod-to-live-service.channel.prepare_live_stream"
    assert reg.get("ImageServiceEnable").routing_key == "image-service.image_service.enable"
    # Warnings, each naming what differs: two per-channel queues and the untagged contract.
    warnings = sorted(p.where.rsplit(": ", 1)[1] for p in reg.problems)
    assert warnings == [
        "channels.channel.prepare_live_stream.bindings.amqp.queue.name",
        "channels.channel.protection_key_created.bindings.amqp.queue.name",
        "components.messages.start-ingest-command",
    ], [str(p) for p in reg.problems]
    assert not any(".spectral" in str(p) for p in reg.problems)
    reg.get("MoviePublished").validate({"content_id": "movie-1", "title": "A", "licenses": [{"start_time": "x"}]})


def test_the_check_command_passes_and_shows_both_files(folder: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["contracts", "check", "--contracts-dir", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "media-service (queue media-service:inbox; from " in out and "publish-service-asyncapi.yml" in out
    assert "0 error(s), 3 warning(s)" in out


def test_a_per_channel_queue_is_a_warning_saying_where_each_side_receives(folder: Path) -> None:
    reg = load_registry(folder)
    command = reg.get("PrepareChannelLiveStream")
    assert command.queue == "channel:prepare_live_stream"
    assert names.mosaic_queue(command.service, command.queue) == "vod-to-live-service:channel:prepare_live_stream"
    assert reg.get("DeleteEntity").queue == names.MOSAIC_INBOX
    # txbox's rule stands: every message of the service in its inbox queue.
    assert ("command", "vod-to-live-service.channel.prepare_live_stream") in [
        (e, k) for e, k in reg.binding_keys("vod-to-live-service")
    ]
    (said,) = [p.message for p in reg.problems if "prepare_live_stream.bindings" in p.where]
    assert "'vod-to-live-service:channel:prepare_live_stream'" in said and "'vod-to-live-service:inbox'" in said
    assert "handled twice" in said
    (event,) = [p.message for p in reg.problems if "protection_key_created.bindings" in p.where]
    assert "'<subscriber id>:channel:protection_key_created'" in event


def test_a_contract_without_the_aggregate_type_tag_takes_the_channels_entity(folder: Path) -> None:
    reg = load_registry(folder)
    assert reg.get("StartIngest").aggregate_type == "ingest"
    (said,) = [p for p in reg.problems if p.where.endswith("start-ingest-command")]
    assert said.severity == "warning" and "'ingest'" in said.message and "aggregate-type:" in said.message


def test_codegen_types_fields_that_point_into_other_files(folder: Path) -> None:
    text = codegen.generate(load_registry(folder), contracts=".")
    assert "Any" not in text, text  # every field of the folder has a Python type
    assert max(map(len, text.splitlines())) <= 120
    module = types.ModuleType("generated")
    exec(compile(text, "generated.py", "exec", dont_inherit=True), module.__dict__)
    hints = typing.get_type_hints(module.MoviePublished)
    assert hints["content_id"] is str and hints["title"] is str
    (license_class,) = typing.get_args(hints["licenses"])  # list[X] (get_type_hints drops NotRequired)
    assert license_class.__required_keys__ == {"start_time"} and license_class.__optional_keys__ == {"countries"}
    # One definition, one class: both events' `licenses` name the same one.
    unpublished = typing.get_type_hints(module.MovieUnpublished)["licenses"]
    assert typing.get_args(unpublished) == (license_class,)
    assert typing.get_type_hints(module.DeleteEntity) == {"entity_id": str, "entity_type": str}


HANDLER = textwrap.dedent(
    """\
    import messages

    def title(event: messages.MoviePublished) -> str:
        return event["title"] + event["content_id"]

    def first_start(event: messages.MoviePublished) -> str:
        return event.get("licenses", [])[0]["start_time"]

    WRONG = messages.DeleteEntity(entity_id=1, entity_type="movie")
    """
)


@pytest.mark.slow
def test_the_generated_module_passes_mypy_strict_and_types_cross_file_fields(folder: Path, tmp_path: Path) -> None:
    out = tmp_path / "messages.py"
    codegen.write(out, folder)
    (tmp_path / "handler.py").write_text(HANDLER)
    cache = str(tmp_path / "cache")
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", cache, "messages.py", "handler.py"]
    result = subprocess.run(
        command, cwd=tmp_path, env=dict(os.environ), capture_output=True, text=True, timeout=300, check=False
    )
    # The one error is the int given for a str id: a field typed Any would take it.
    assert result.returncode == 1, result.stdout + result.stderr
    errors = [line for line in result.stdout.splitlines() if ": error:" in line]
    assert len(errors) == 1 and errors[0].startswith("handler.py:9:") and '"entity_id"' in errors[0], result.stdout


def test_a_channel_that_merely_begins_like_the_service_id_is_not_flagged(tmp_path: Path) -> None:
    (tmp_path / "c.yml").write_text(
        """
asyncapi: 2.0.0
x-service-id: channel
info: {title: Channel, version: '1'}
channels:
  channel.published:
    subscribe: {message: {name: ChannelPublished, tags: [{name: "aggregate-type:channel"}], payload: {type: object}}}
  channel.cart.open:
    publish: {message: {name: OpenCart, tags: [{name: "aggregate-type:cart"}], payload: {type: object}}}
"""
    )
    reg: Registry = load_registry(tmp_path, strict=False)
    flagged = [p.where for p in reg.problems if "drop the leading" in p.message]
    assert flagged == [f"{tmp_path / 'c.yml'}: channels.channel.cart.open"]  # the whole id before `entity.action`


def test_a_deep_field_whose_type_passes_the_line_limit_is_split_as_ruff_formats_it(tmp_path: Path) -> None:
    leaf: dict[str, Any] = {"type": "object", "properties": {"value": {"type": "string"}}}
    for word in ["ui_field_custom_definition_view_property_map", "entity_field_definitions_item", "definition"]:
        leaf = {"type": "object", "properties": {word: leaf}}
    (tmp_path / "s.json").write_text(json.dumps({**leaf, "title": "entity_definition_declare_failed_event"}))
    (tmp_path / "c.yml").write_text(
        "asyncapi: 2.0.0\nx-service-id: things\ninfo: {title: Things, version: '1'}\nchannels:\n"
        "  entity.declare_failed:\n    subscribe:\n"
        "      message: {tags: [{name: 'aggregate-type:thing'}], payload: {$ref: s.json}}\n"
    )
    out = tmp_path / "messages.py"
    codegen.write(out, tmp_path)
    text = out.read_text()
    assert max(map(len, text.splitlines())) <= 120
    assert "    ui_field_custom_definition_view_property_map: NotRequired[\n" in text
    formatted = subprocess.run(
        [sys.executable, "-m", "ruff", "format", "--check", "--line-length", "120", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
