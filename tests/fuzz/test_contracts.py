"""Generated hostile contracts: random mutations of a valid one, loaded and turned into code.

docs/explanation/receive.md, "Contracts are outside input". Hypothesis starts from a valid
contract and bends it: hostile names (service id, channel, message type, title,
aggregate type, property names), hostile strings (descriptions, enum values, defaults:
quotes, backslashes, NUL, line separators, ``#``, braces), ``$ref``s to URLs, absolute
paths, ``..``, a FIFO, a device, ``/proc``, a symlink out, cycles and missing files,
patterns (catastrophic, lookaround, backreferences, not a regex), deep nesting and huge
numbers, written as raw JSON or YAML (with aliases). Every case must end in either
success — the generated module parses and imports, and payloads can be checked — or a
TxboxError subclass, never another exception; nothing may be written but the output
module. A hang fails the run through the pytest timeout.

Budget: ``TXBOX_CONTRACT_FUZZ_EXAMPLES`` cases (default 600, about ten seconds here),
derandomized unless ``TXBOX_FUZZ_SEED`` is set.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

from framework import codegen
from framework.contracts import load_registry
from framework.errors import PayloadValidationError, TxboxError

EXAMPLES = int(os.environ.get("TXBOX_CONTRACT_FUZZ_EXAMPLES", "600"))
SEED = os.environ.get("TXBOX_FUZZ_SEED")

HOSTILE_TEXT = [
    '"""',
    "'''",
    "\\",
    "\\x00",
    "\x00",
    "\n",
    "\r\n",
    "\u2028",
    "\u2029",
    "\x85",
    "#",
    "{x}",
    "{{",
    "}",
    '"',
    "\ufeff",
    "\u200b",
    "é",
    "\U0001f600",
    "import os",
    "__import__('os').system('true')",
    "None",
    "Any",
    "TypedDict",
    "class",
    "1x",
    " ",
    "a" * 300,
]
REFS = [
    "http://127.0.0.1:9/x.json",
    "https://example.invalid/x.json",
    "file:///etc/passwd",
    "/etc/passwd",
    "../outside.json",
    "sub/../../outside.json",
    "fifo",
    "dev",
    "proc",
    "link-out",
    "missing.json",
    "cycle-a.json",
    "ok.json",
    "ok.json#/definitions/x",
    "ok.json#/nowhere",
    "#",
    "#/definitions/self",
    "\x00.json",
]
PATTERNS = [
    "^(a+)+$",
    "(a|aa)+$",
    "(?=a)a",
    "(?<=a)b",
    "(a)\\1",
    "a++",
    "(?>a)",
    "[",
    "(",
    "\\",
    "a{99999999}",
    "^[A-Z0-9-]{1,10}$",
]
CLASSES = (
    "name",
    "service",
    "channel",
    "title",
    "aggregate",
    "property",
    "string",
    "ref",
    "pattern",
    "deep",
    "number",
    "version",
    "shape",
)
NUMBERS = [10**30, -(10**30), 2**64, 1e308, -1e308, 5e-324, 0, -1, 0.5, float("inf")]

hostile_strings = st.one_of(
    st.sampled_from(HOSTILE_TEXT),
    st.lists(st.sampled_from(HOSTILE_TEXT), min_size=1, max_size=4).map("".join),
    st.text(max_size=30),
)


def base() -> dict[str, Any]:
    return {
        "asyncapi": "2.6.0",
        "x-service-id": "fuzz-service",
        "info": {"title": "Fuzz", "version": "1"},
        "channels": {
            "thing.place": {
                "publish": {
                    "message": {
                        "name": "PlaceThing",
                        "tags": [{"name": "aggregate-type:thing"}],
                        "payload": {
                            "type": "object",
                            "title": "place_thing_command",
                            "description": "Place a thing.",
                            "required": ["sku"],
                            "properties": {
                                "sku": {"type": "string", "pattern": "^[A-Z0-9-]{1,10}$"},
                                "kind": {"enum": ["a", "b"]},
                                "size": {"type": "integer", "minimum": 1, "default": 1},
                            },
                        },
                    }
                }
            }
        },
    }


def _payload(doc: dict[str, Any]) -> dict[str, Any]:
    payload: dict[str, Any] = doc["channels"]["thing.place"]["publish"]["message"]["payload"]
    return payload


@st.composite
def mutations(draw: st.DrawFn) -> tuple[list[str], dict[str, Any], bool]:
    """(the classes of mutation applied, the contract, whether it is written as YAML)."""
    doc = base()
    message = doc["channels"]["thing.place"]["publish"]["message"]
    applied: list[str] = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(CLASSES))
        applied.append(kind)
        payload = _payload(doc) if isinstance(message.get("payload"), dict) else None
        if payload is not None and not isinstance(payload.get("properties"), dict):
            payload = None  # replaced by a `$ref`: nothing of it to bend
        if kind in _OF_PAYLOAD:
            if payload is not None:
                _OF_PAYLOAD[kind](draw, payload)
        elif _OF_DOCUMENT[kind](draw, doc, message, payload):
            break  # the message is no longer where the next mutation would look
    return applied, doc, draw(st.booleans())


Payload = dict[str, Any]


def _name(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    message["name"] = draw(hostile_strings | st.sampled_from([None, 1, [], {}]))
    return False


def _service(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    doc["x-service-id"] = draw(hostile_strings)
    return False


def _channel(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    doc["channels"] = {draw(hostile_strings): doc["channels"]["thing.place"]}
    return True  # the message lives under another key now


def _title(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    message.pop("name", None)
    if payload is not None:
        payload["title"] = draw(hostile_strings)
    return False


def _aggregate(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    message["tags"] = [{"name": "aggregate-type:" + draw(hostile_strings)}]
    return False


def _ref(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    target = draw(st.sampled_from(REFS))
    if draw(st.booleans()):
        message["payload"] = {"$ref": target}
    elif payload is not None:
        payload["properties"]["linked"] = {"$ref": target}
    return False


def _version(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    message["x-message-version"] = draw(hostile_strings | st.sampled_from([2, None]))
    message["x-previous-versions"] = {draw(hostile_strings): {"type": "object"}}
    return False


def _shape(draw: st.DrawFn, doc: dict[str, Any], message: dict[str, Any], payload: Payload | None) -> bool:
    spot = draw(st.sampled_from(("channels", "components", "tags", "message", "payload", "x-subscribes")))
    junk = draw(st.sampled_from([None, 1, "x", [], [1, "a"], {"a": 1}]))
    if spot in ("channels", "components", "x-subscribes"):
        doc[spot] = junk
        return True
    if spot == "message":
        doc["channels"]["thing.place"]["publish"]["message"] = junk
        return True
    message[spot] = junk
    return False


def _property(draw: st.DrawFn, payload: Payload) -> None:
    payload["properties"][draw(hostile_strings)] = {"type": "string", "description": draw(hostile_strings)}
    if draw(st.booleans()):
        payload["required"] = [draw(hostile_strings)]


def _string(draw: st.DrawFn, payload: Payload) -> None:
    payload["description"] = draw(hostile_strings)
    payload["properties"]["kind"] = {"enum": draw(st.lists(hostile_strings, min_size=1, max_size=4))}
    payload["properties"]["size"]["default"] = draw(hostile_strings)


def _pattern(draw: st.DrawFn, payload: Payload) -> None:
    pattern = draw(st.sampled_from(PATTERNS) | st.text(max_size=12))
    where = draw(st.sampled_from(("pattern", "patternProperties", "format")))
    if where == "pattern":
        payload["properties"]["sku"]["pattern"] = pattern
    elif where == "patternProperties":
        payload["patternProperties"] = {pattern: {"type": "string"}}
    else:
        payload["properties"]["sku"]["format"] = "regex"


def _deep(draw: st.DrawFn, payload: Payload) -> None:
    node: dict[str, Any] = {"type": "string"}
    for _ in range(draw(st.integers(10, 120))):
        node = {"type": "object", "properties": {"n": node}}
    payload["properties"]["deep"] = node


def _number(draw: st.DrawFn, payload: Payload) -> None:
    keyword = draw(st.sampled_from(("minimum", "maximum", "maxLength", "multipleOf", "const", "enum")))
    value: Any = draw(st.sampled_from(NUMBERS))
    payload["properties"]["size"][keyword] = [value] if keyword == "enum" else value


# Each class of mutation: of the document (True: stop, the message moved), or of the
# payload's schema (nothing when the payload is a `$ref` or gone).
_OF_DOCUMENT: dict[str, Callable[[st.DrawFn, dict[str, Any], dict[str, Any], Payload | None], bool]] = {
    "name": _name,
    "service": _service,
    "channel": _channel,
    "title": _title,
    "aggregate": _aggregate,
    "ref": _ref,
    "version": _version,
    "shape": _shape,
}
_OF_PAYLOAD: dict[str, Callable[[st.DrawFn, Payload], None]] = {
    "property": _property,
    "string": _string,
    "pattern": _pattern,
    "deep": _deep,
    "number": _number,
}


def folder_with(root: Path) -> Path:
    """A contracts folder holding the files the refs name, and the hostile things beside it
    (without a contract suffix: the folder's own listing refuses those, see tests/unit)."""
    (root / "outside.json").write_text('{"type": "object"}')
    folder = root / "contracts"
    (folder / "sub").mkdir(parents=True)
    os.mkfifo(folder / "fifo")
    (folder / "dev").symlink_to("/dev/zero")
    (folder / "proc").symlink_to("/proc/self/environ")
    (folder / "link-out").symlink_to(root / "outside.json")
    (folder / "ok.json").write_text('{"type": "object", "definitions": {"x": {"type": "object"}}}')
    (folder / "cycle-a.json").write_text('{"type": "object", "properties": {"b": {"$ref": "cycle-b.json"}}}')
    (folder / "cycle-b.json").write_text('{"type": "object", "properties": {"a": {"$ref": "cycle-a.json"}}}')
    return folder


def yaml_text(doc: dict[str, Any]) -> str:
    """YAML written by hand (JSON is YAML), with an alias shared by two messages."""
    text = json.dumps(doc, allow_nan=True)
    return "# fuzz\n" + text.replace('"tags": [', '"tags": &tags [', 1) if '"tags": [' in text else text


def snapshot(root: Path) -> dict[str, tuple[int, float]]:
    out: dict[str, tuple[int, float]] = {}
    for path in root.rglob("*"):
        st_ = path.lstat()
        out[str(path)] = (st_.st_size, st_.st_mtime)
    return out


OUTCOMES: Counter[tuple[str, str]] = Counter()


@pytest.fixture(scope="module", autouse=True)
def summary() -> Iterator[None]:
    yield
    lines = [f"{count:5d}  {kind:<10} {outcome}" for (kind, outcome), count in sorted(OUTCOMES.items())]
    print("\nhostile contracts: class, outcome\n" + "\n".join(lines))


def run_case(applied: list[str], doc: dict[str, Any], as_yaml: bool) -> str:
    root = Path(tempfile.mkdtemp(prefix="txbox-contract-fuzz-"))
    try:
        folder = folder_with(root)
        name = "fuzz.yml" if as_yaml else "fuzz.json"
        text = yaml_text(doc) if as_yaml else json.dumps(doc, allow_nan=True)
        (folder / name).write_text(text, encoding="utf-8", errors="surrogatepass")
        output = root / "out" / "messages.py"
        before = snapshot(root)
        try:
            registry = load_registry(folder)
            codegen.write(output, folder)
        except TxboxError as exc:
            assert str(exc), "an error must say what is wrong"
            outcome = f"refused: {type(exc).__name__}"
        else:
            module: dict[str, Any] = {}
            exec(compile(output.read_text(encoding="utf-8"), str(output), "exec", dont_inherit=True), module)
            for spec in registry.messages.values():
                assert spec.message_type in module
                with contextlib.suppress(PayloadValidationError):  # never a backtracking engine on this
                    spec.validate({"sku": "a" * 40 + "!", "n": "a" * 40 + "!"})
            outcome = "loaded and generated"
        after = snapshot(root)
        created = set(after) - set(before)
        assert created <= {str(output.parent), str(output)}, f"wrote outside the output: {created}"
        assert all(before[p] == after[p] for p in before), "changed a file that is not the output"
        return outcome
    finally:
        shutil.rmtree(root, ignore_errors=True)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture],
)
@given(mutations())
def _fuzz(case: tuple[list[str], dict[str, Any], bool]) -> None:
    applied, doc, as_yaml = case
    outcome = run_case(applied, copy.deepcopy(doc), as_yaml)
    for kind in set(applied):
        OUTCOMES[(kind, outcome)] += 1


@pytest.mark.timeout(300)
def test_every_hostile_contract_loads_or_is_refused_with_a_txbox_error() -> None:
    fuzz = seed(int(SEED))(_fuzz) if SEED is not None else _fuzz
    fuzz()
    assert OUTCOMES, "no case ran"
