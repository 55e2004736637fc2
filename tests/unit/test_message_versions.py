"""Message versions: the contract form, validation by version, handler versions and upcasters,
and the assembly check (docs/explanation/receive.md, "Message versions")."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest

from framework import CommandHandler
from framework.cli import main as cli_main
from framework.contracts import load_registry
from framework.envelope import Message
from framework.errors import PayloadValidationError, PermanentError, VersionNotHandled
from framework.handlers import as_handled
from tests.apps import shelf

ORDERS = Path(__file__).resolve().parents[2] / "contracts"
V1 = {"sku": "SKU-1", "count": 3}
V2 = {"sku": "SKU-1", "quantity": 3, "location": "A-1"}


@pytest.fixture(scope="module")
def spec() -> Any:
    return load_registry(shelf.CONTRACTS).get("StockShelf")


def message(version: str, payload: dict[str, Any]) -> Message:
    return Message(
        message_id=uuid.uuid4(),
        message_type="StockShelf",
        aggregate_type="shelf",
        aggregate_id="7",
        payload=payload,
        message_version=version,
    )


def test_each_version_is_validated_against_its_own_schema(spec: Any) -> None:
    assert spec.versions == ("2", "1")
    spec.validate(V2, "2")
    spec.validate(V2)  # no version: the current one
    spec.validate(V1, "1")
    with pytest.raises(PayloadValidationError, match='"count" is a required property'):
        spec.validate(V2, "1")
    with pytest.raises(PayloadValidationError, match='"quantity" is a required property'):
        spec.validate(V1, "2")


def test_a_version_the_contract_does_not_declare_is_refused(spec: Any) -> None:
    with pytest.raises(PayloadValidationError, match=r"message_version: '3' is not declared by the contract \(2, 1\)"):
        spec.validate(V2, "3")


def test_a_contract_without_versions_takes_any_version() -> None:
    """As Mosaic's own libraries do: they send every message as version 1.1."""
    place_order = load_registry(ORDERS).get("PlaceOrder")
    assert place_order.versions == ()
    for version in ("1.0", "1.1", "7", ""):
        place_order.validate({"customer": "ada", "sku": "SKU-1", "quantity": 1}, version)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"x-previous-versions": {"1": {"type": "object"}}}, "needs `x-message-version` beside it"),
        ({"x-message-version": 2}, "give it as a string, quoted in YAML"),
        ({"x-message-version": "2", "x-previous-versions": ["1"]}, "must map each older version"),
        ({"x-message-version": "2", "x-previous-versions": {"2": {"type": "object"}}}, "leave out the current one"),
        ({"x-message-version": "2", "x-previous-versions": {"1": {"type": "nonsense"}}}, "not a valid draft-07 schema"),
    ],
)
def test_malformed_version_declarations_are_contract_errors(
    tmp_path: Path, fields: dict[str, Any], expected: str
) -> None:
    message = {"name": "DoThing", "tags": [{"name": "aggregate-type:thing"}], "payload": {"type": "object"}, **fields}
    doc = {"asyncapi": "2.0.0", "x-service-id": "thing", "channels": {"thing.do": {"publish": {"message": message}}}}
    (tmp_path / "thing.json").write_text(json.dumps(doc))
    registry = load_registry(tmp_path, strict=False)
    assert any(expected in p.message for p in registry.errors), registry.problems


def test_a_handler_takes_the_current_version_as_it_is(spec: Any) -> None:
    incoming = message("2", V2)
    assert as_handled(shelf.CurrentOnlyShelf(), incoming, spec) is incoming


def test_an_older_version_reaches_handle_upcast_to_the_current_one(spec: Any) -> None:
    upcast = as_handled(shelf.UpcastingShelf(), message("1", V1), spec)
    assert (upcast.message_version, upcast.payload) == ("2", {"sku": "SKU-1", "quantity": 3, "location": "unknown"})


def test_a_handler_that_names_its_versions_takes_them_as_they_are(spec: Any) -> None:
    incoming = message("1", V1)
    assert as_handled(shelf.BothVersionsShelf(), incoming, spec) is incoming


def test_a_version_without_a_way_in_is_a_permanent_failure_naming_the_fix(spec: Any) -> None:
    with pytest.raises(VersionNotHandled, match=r"does not take StockShelf version '1' \(it takes 2\): add") as err:
        as_handled(shelf.CurrentOnlyShelf(), message("1", V1), spec)
    assert isinstance(err.value, PermanentError)  # dead-lettered at once: a retry would not change it


def test_an_upcaster_whose_payload_the_current_schema_refuses_fails_permanently(spec: Any) -> None:
    class Sloppy(CommandHandler):
        message_type = "StockShelf"
        upcasters = {"1": lambda payload: {"sku": payload["sku"]}}

    with pytest.raises(PermanentError, match="upcaster of StockShelf version '1' returned a payload"):
        as_handled(Sloppy(), message("1", V1), spec)


def test_check_reports_a_received_version_the_handler_cannot_take() -> None:
    problems = [str(p) for p in shelf.service(shelf.CurrentOnlyShelf()).problems()]
    assert any("receives StockShelf version '1' but the handler cannot take it" in p for p in problems), problems
    assert shelf.service(shelf.UpcastingShelf()).problems() == []
    assert shelf.service(shelf.BothVersionsShelf()).problems() == []


def test_check_warns_of_a_version_the_contract_does_not_declare() -> None:
    class Typo(CommandHandler):
        message_type = "StockShelf"
        versions = frozenset({"2", "l"})
        upcasters = {"1": shelf.upcast_v1}

    (problem,) = shelf.service(Typo()).problems()
    assert problem.severity == "warning" and "version(s) 'l' that its contract does not declare" in problem.message


def test_txbox_check_fails_naming_the_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "--app", "tests.apps.shelf:current_only"]) == 1
    out = capsys.readouterr().out
    assert "receives StockShelf version '1' but the handler cannot take it" in out


def test_the_routing_report_lists_the_versions(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["contracts", "check", "--contracts-dir", str(shelf.CONTRACTS)]) == 0
    assert "accepts command StockShelf (versions 2, 1)" in capsys.readouterr().out


def test_service_check_passes_when_every_version_has_a_way_in() -> None:
    assert shelf.service(shelf.UpcastingShelf()).check() == []
