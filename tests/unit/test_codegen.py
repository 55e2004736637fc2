"""`txbox codegen`: one TypedDict per message type, idempotent, stale code reported by `txbox check`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import types
from pathlib import Path
from typing import Any

import pytest

from framework import codegen
from framework.cli import main
from framework.contracts import load_registry
from framework.envelope import Message
from framework.errors import ConfigurationError

ROOT = Path(__file__).resolve().parents[2]
CONTRACTS = ROOT / "contracts"


def load(text: str) -> types.ModuleType:
    module = types.ModuleType("generated")
    # dont_inherit: not this file's `from __future__ import annotations`
    exec(compile(text, "generated.py", "exec", dont_inherit=True), module.__dict__)
    return module


def test_one_typed_dict_per_message_type_named_after_it() -> None:
    registry = load_registry(CONTRACTS)
    module = load(codegen.generate(registry, contracts="contracts"))
    for message_type in registry.messages:
        assert getattr(module, message_type).__required_keys__ <= set(registry.get(message_type).schema["properties"])
    assert module.PlaceOrder.__required_keys__ == {"customer", "sku", "quantity"}
    assert module.StockRejected.__optional_keys__ == {"reason"}


def test_the_examples_module_is_what_codegen_writes_now() -> None:
    assert codegen.stale(ROOT / "examples" / "messages.py") is None


def test_regenerating_is_idempotent_and_stale_code_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    contracts = tmp_path / "contracts"
    shutil.copytree(CONTRACTS, contracts)
    output = tmp_path / "app" / "messages.py"
    assert main(["codegen", "--contracts-dir", str(contracts), "--output", str(output)]) == 0
    first = output.read_text()
    assert main(["codegen", "--contracts-dir", str(contracts), "--output", str(output)]) == 0
    assert output.read_text() == first
    assert "is up to date" in capsys.readouterr().out
    assert main(["check", "--contracts-dir", str(contracts), "--generated", str(output)]) == 0

    schema = contracts / "order-service" / "commands" / "place-order.json"
    doc = json.loads(schema.read_text())
    doc["properties"]["note"] = {"type": "string"}
    schema.write_text(json.dumps(doc))
    capsys.readouterr()
    assert main(["check", "--contracts-dir", str(contracts), "--generated", str(output)]) == 1
    assert f"error: {output}: {output} is stale" in capsys.readouterr().out
    assert main(["codegen", "--check", "--output", str(output)]) == 1
    assert main(["codegen", "--contracts-dir", str(contracts), "--output", str(output)]) == 0
    assert main(["codegen", "--check", "--output", str(output)]) == 0


def test_a_file_codegen_did_not_write_is_not_overwritten(tmp_path: Path) -> None:
    mine = tmp_path / "messages.py"
    mine.write_text("HANDWRITTEN = True\n")
    with pytest.raises(ConfigurationError, match="not written by `txbox codegen`"):
        codegen.write(mine, CONTRACTS)
    assert mine.read_text() == "HANDWRITTEN = True\n"


def test_services_limit_the_module_to_what_they_receive_and_emit() -> None:
    text = codegen.generate(load_registry(CONTRACTS), contracts="c", services=["inventory-service"])
    module = load(text)
    assert {n for n, v in vars(module).items() if isinstance(v, type) and n[0].isupper()} >= {
        "RestockItem", "OrderPlaced", "StockReserved", "StockRejected"
    }  # fmt: skip
    assert not hasattr(module, "PlaceOrder")


CONTRACT = """\
asyncapi: 2.0.0
x-service-id: shape-service
info: {title: Shape Service, version: '1'}
channels:
  shape.draw:
    publish:
      message: {$ref: '#/components/messages/draw'}
components:
  messages:
    draw:
      name: DrawShape
      tags: [{name: "aggregate-type:shape"}]
      payload:
        $ref: draw.json
"""

SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "type": "object",
    "title": "draw_shape_command",
    "description": 'Draw one shape. Quotes """ and backslashes \\ stay in the docstring.',
    "required": ["kind", "points", "style"],
    "definitions": {
        "point": {"type": "object", "required": ["x"], "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}
    },
    "properties": {
        "kind": {"enum": ["circle", "square"]},
        "points": {"type": "array", "items": {"$ref": "#/definitions/point"}},
        "style": {
            "type": "object",
            "properties": {"class": {"type": "string"}, "line-width": {"type": ["integer", "null"]}},
        },
        "tags": {"type": "object", "additionalProperties": {"type": "string"}},
        "size": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        "anything": {},
    },
}  # fmt: skip


def test_json_schema_features_map_to_python_types(tmp_path: Path) -> None:
    (tmp_path / "shape.yml").write_text(CONTRACT)
    (tmp_path / "draw.json").write_text(json.dumps(SCHEMA))
    text = codegen.generate(load_registry(tmp_path), contracts=".")
    module = load(text)
    hints = {k: str(v) for k, v in module.DrawShape.__annotations__.items()}
    assert "Literal['circle', 'square']" in hints["kind"]
    assert "DrawShapePoints" in hints["points"] and hints["points"].startswith("list[")
    assert module.DrawShapePointsItem.__required_keys__ == {"x"}  # the $ref'd definition, named for its place
    assert module.DrawShapeStyle.__optional_keys__ == {"class", "line-width"}  # keys that are not identifiers
    assert "int | None" in str(module.DrawShapeStyle.__annotations__["line-width"])
    assert "dict[str, str]" in hints["tags"]
    assert "int | str" in hints["size"]
    assert "Any" in hints["anything"]
    assert 'Quotes """ and backslashes \\ stay' in module.DrawShape.__doc__
    assert max(map(len, text.splitlines())) <= 120


def test_payload_as_types_the_payload_and_refuses_a_class_it_does_not_fit() -> None:
    module = load(codegen.generate(load_registry(CONTRACTS), contracts="contracts"))
    message = Message(message_id=__import__("uuid").uuid4(), message_type="OrderPlaced", aggregate_type="order",
                      aggregate_id="1", payload={"order_id": "1", "sku": "A", "quantity": 1})  # fmt: skip
    assert message.payload_as(module.OrderPlaced) is message.payload
    with pytest.raises(TypeError, match="has no customer: it is not a PlaceOrder"):
        message.payload_as(module.PlaceOrder)


MISUSE = textwrap.dedent(
    """\
    from framework import Message, Outbox
    from examples import messages

    def handle(message: Message, outbox: Outbox) -> None:
        order = message.payload_as(messages.PlaceOrder)
        order["customr"]
        outbox.publish_event("OrderPlaced", aggregate_id="1", payload=messages.OrderPlaced(order_id="1", sku="A"))
    """
)


@pytest.mark.slow
def test_mypy_checks_what_handlers_read_and_send(tmp_path: Path) -> None:
    (tmp_path / "handler.py").write_text(MISUSE)
    # A process of its own: mypy raises the interpreter's recursion limit, which the
    # worker's tests of deeply nested payloads rely on.
    command = [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache"), "handler.py"]
    result = subprocess.run(
        command, cwd=tmp_path, env={**os.environ, "MYPYPATH": str(ROOT)}, capture_output=True, text=True, timeout=300,
        check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    assert 'TypedDict "PlaceOrder" has no key "customr"' in result.stdout
    assert 'Missing key "quantity" for TypedDict "OrderPlaced"' in result.stdout
