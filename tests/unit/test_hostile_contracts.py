"""Hostile contract files, written by the test as raw text, through `txbox contracts check` and `txbox codegen`.

docs/explanation/receive.md, "Contracts are outside input": a contract is refused with the
file, the path in it and the value, never turned into code, a wait or a slow regex.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
TXBOX = Path(sys.executable).parent / "txbox"


def contract(payload: Any, *, name: Any = "PlaceThing", aggregate: str = "thing", channel: str = "thing.place") -> str:
    doc = {
        "asyncapi": "2.6.0",
        "x-service-id": "thing-service",
        "info": {"title": "Thing", "version": "1"},
        "channels": {
            channel: {
                "publish": {
                    "message": {"name": name, "tags": [{"name": f"aggregate-type:{aggregate}"}], "payload": payload}
                }
            }
        },
    }
    return json.dumps(doc)


def txbox(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """The CLI as users run it; a hang fails the test by its timeout, never waits forever."""
    return subprocess.run([str(TXBOX), *args], check=False, cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def check(folder: Path) -> str:
    result = txbox("contracts", "check", "--contracts-dir", str(folder))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    return result.stdout


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ('Evil"""\nimport os', "is not a message type"),
        ("Place Thing", "is not a message type"),
        ("Any", "is reserved"),
        ("None", "is reserved"),
        ("X" * 101, "at most 100 characters"),
    ],
)
def test_a_message_type_that_is_not_a_python_class_name_is_refused(tmp_path: Path, name: str, expected: str) -> None:
    (tmp_path / "thing.json").write_text(contract({"type": "object"}, name=name))
    out = check(tmp_path)
    assert f"{tmp_path / 'thing.json'}: channels.thing.place.publish.message.name: " in out
    assert expected in out


def test_titles_aggregate_types_and_property_names_follow_their_grammar(tmp_path: Path) -> None:
    (tmp_path / "a.json").write_text(contract({"type": "object", "title": "Do It!\u2028"}, name=None))
    (tmp_path / "b.yml").write_text(
        contract({"type": "object"}, name="MakeThing", aggregate="thing\nx", channel="thing.make").replace(
            "thing-service", "b-service"
        )
    )
    (tmp_path / "c.json").write_text(
        contract({"type": "object", "properties": {"a\x00b": {"type": "string"}}}, channel="thing.c").replace(
            "thing-service", "c-service"
        )
    )
    out = check(tmp_path)
    assert "a.json: channels.thing.place.publish.message.payload.title: 'DoIt!' is not a message type" in out
    assert "b.yml: channels.thing.make.publish.message.tags: 'thing\\nx' is not an aggregate type" in out
    assert "c.json: channels.thing.c.publish.message.payload.properties: 'a\\x00b' holds a control" in out


def test_a_service_id_from_a_title_follows_the_grammar(tmp_path: Path) -> None:
    doc = {"asyncapi": "2.0.0", "info": {"title": "x" * 5000, "version": "1"}, "channels": {}}
    (tmp_path / "t.json").write_text(json.dumps(doc))
    assert "info.title: 'xxxx" in check(tmp_path)


@pytest.mark.parametrize(
    "ref",
    [
        "http://127.0.0.1:9/schema.json",
        "file:///etc/passwd",
        "/etc/passwd",
        "../outside.json",
        "sub/../../outside.json",
        "fifo.json",
        "dev.json",
        "proc.json",
        "link-out.json",
    ],
)
def test_a_ref_to_anything_but_a_regular_file_inside_the_folder_is_an_error(tmp_path: Path, ref: str) -> None:
    folder = tmp_path / "contracts"
    (folder / "sub").mkdir(parents=True)
    (tmp_path / "outside.json").write_text('{"type": "object"}')
    os.mkfifo(folder / "fifo.json")  # opening it for reading would wait for a writer
    (folder / "dev.json").symlink_to("/dev/zero")
    (folder / "proc.json").symlink_to("/proc/self/environ")
    (folder / "link-out.json").symlink_to(tmp_path / "outside.json")
    (folder / "thing.yml").write_text(contract({"$ref": ref}))
    out = check(folder)
    assert f"$ref {ref!r}" in out, out
    assert "thing.yml: channels.thing.place.publish.message.payload.$ref" in out


def test_refs_inside_a_schema_are_confined_too(tmp_path: Path) -> None:
    (tmp_path / "outside.json").write_text('{"type": "string"}')
    folder = tmp_path / "contracts"
    folder.mkdir()
    os.mkfifo(folder / "fifo.json")
    (folder / "thing.yml").write_text(
        contract({"type": "object", "properties": {"a": {"$ref": "../outside.json"}, "b": {"$ref": "fifo.json"}}})
    )
    out = check(folder)
    assert "inside the schema does not resolve" in out and "outside the contracts folder" in out


def test_a_fifo_or_a_symlink_out_named_like_a_contract_is_an_error_not_a_wait(tmp_path: Path) -> None:
    folder = tmp_path / "contracts"
    folder.mkdir()
    os.mkfifo(folder / "waits.yml")
    (tmp_path / "secret.yml").write_text("asyncapi: 2.0.0\n")
    (folder / "out.yml").symlink_to(tmp_path / "secret.yml")
    out = check(folder)
    assert "waits.yml: is a FIFO; only regular files are read" in out
    assert "out.yml: resolves to" in out and "outside the contracts folder" in out


def test_size_depth_and_aliases_are_bounded(tmp_path: Path) -> None:
    laughs = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    laughs += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    (tmp_path / "laughs.yml").write_text("asyncapi: 2.0.0\n" + "\n".join(laughs) + "\n")
    (tmp_path / "deep.json").write_text('{"asyncapi": "2.0.0", "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    (tmp_path / "self.yml").write_text("asyncapi: 2.0.0\nx: &a [*a]\n")
    (tmp_path / "big.yml").write_text("asyncapi: 2.0.0\n# " + "x" * (2 << 20) + "\n")
    out = check(tmp_path)
    assert "laughs.yml: cannot read YAML: more than 100000 values" in out
    assert "deep.json: nested deeper than 64 levels" in out
    assert "self.yml: cannot read YAML:" in out
    assert "big.yml: larger than 1048576 bytes" in out


def test_a_ref_cycle_and_a_fan_out_end_with_an_error_or_a_verdict(tmp_path: Path) -> None:
    for i in range(100):  # a chain longer than a schema may pull in
        (tmp_path / f"s{i}.json").write_text(json.dumps({"$ref": f"s{i + 1}.json"}))
    (tmp_path / "s100.json").write_text('{"type": "object"}')
    (tmp_path / "loop-a.json").write_text('{"properties": {"x": {"$ref": "loop-b.json"}}}')
    (tmp_path / "loop-b.json").write_text('{"properties": {"y": {"$ref": "loop-a.json"}}}')
    (tmp_path / "thing.yml").write_text(contract({"type": "object", "properties": {"a": {"$ref": "s0.json"}}}))
    (tmp_path / "loop.yml").write_text(
        contract({"$ref": "loop-a.json"}, name="Loop", channel="loop.go").replace("thing-service", "loop-service")
    )
    out = check(tmp_path)
    assert "more than 64 schema files through $ref" in out
    assert "loop-service" in out and "accepts command Loop" in out  # a cycle loads, read once per file


@pytest.mark.parametrize("pattern", ["(?=a)b", "(a)\\1", "a++", "(?>a)"])
def test_a_pattern_that_needs_backtracking_is_refused_at_load(tmp_path: Path, pattern: str) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}}
    (tmp_path / "thing.json").write_text(contract(schema))
    out = check(tmp_path)
    assert "the schema does not compile" in out and "linear-time engine" in out


def test_codegen_escapes_every_string_and_writes_valid_code(tmp_path: Path) -> None:
    hostile = 'end """ \\ \\x00 \x00 \u2028 # {x} \n\n"'
    schema = {
        "type": "object",
        "description": hostile,
        "properties": {
            "kind": {"enum": [hostile, 'a"', "\\"]},
            'x"y': {"type": "object", "description": hostile, "properties": {"z\\": {"const": "\x7f\u200b"}}},
            "odd key\u00e9": {"type": "string"},
        },
    }
    (tmp_path / "thing.json").write_text(contract(schema))
    out = tmp_path / "messages.py"
    result = txbox("codegen", "--contracts-dir", str(tmp_path), "--output", str(out))
    assert result.returncode == 0, result.stderr
    text = out.read_text(encoding="utf-8")
    namespace: dict[str, Any] = {}
    exec(compile(text, str(out), "exec", dont_inherit=True), namespace)
    cls = namespace["PlaceThing"]  # keys that are not identifiers: the functional form, its doc a comment
    assert set(cls.__optional_keys__) == {"kind", 'x"y', "odd key\u00e9"}
    assert hostile in cls.__annotations__["kind"].__args__[0].__args__
    nested = namespace["PlaceThingXy"]  # named from the key with what an identifier cannot hold dropped
    assert '\n# end """ ' in text  # the description, a comment of its own lines
    assert nested.__annotations__["z\\"].__args__[0].__args__ == ("\x7f\u200b",)
    assert "\x00" not in text and "\u2028" not in text
    # Regenerating is idempotent and `--check` agrees.
    assert txbox("codegen", "--check", "--output", str(out)).returncode == 0
