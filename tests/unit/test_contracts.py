from pathlib import Path

import pytest

from framework import names
from framework.contracts import load_registry, topic_matches
from framework.errors import ContractError, PayloadValidationError, UnknownMessageType

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture(scope="module")
def registry():  # type: ignore[no-untyped-def]
    return load_registry(ROOT / "contracts")


def test_seed_003_example_loads_as_printed() -> None:
    reg = load_registry(FIXTURES / "seed003")
    spec = reg.get("ExampleCreateCommand")  # component key in PascalCase
    assert (spec.kind, spec.routing_key, spec.service, spec.aggregate_type) == (
        "command",
        "example.create",
        "ax-service-example",
        "example",
    )
    spec.validate({"title": "Example Title 1", "count": 3})
    with pytest.raises(PayloadValidationError):
        spec.validate({"title": "x"})
    # A routing key outside the three-part convention is a warning, not an error.
    assert not reg.errors
    assert any("example.create" in p.where and p.severity == "warning" for p in reg.problems)


def test_example_services_make_a_saga(registry) -> None:  # type: ignore[no-untyped-def]
    assert set(registry.services) == {"order-service", "inventory-service"}
    place = registry.get("PlaceOrder")
    assert (place.kind, place.service, place.routing_key) == ("command", "order-service", "order-service.order.place")
    placed = registry.get("OrderPlaced")
    assert placed.kind == "event" and registry.subscribers(placed) == ["inventory-service"]
    assert registry.subscribers(registry.get("StockReserved")) == ["order-service"]
    assert registry.binding_keys("inventory-service") == [
        (names.COMMAND_EXCHANGE, "inventory-service.stock.restock"),
        (names.EVENT_EXCHANGE, "order-service.order.placed"),
    ]
    accepted = {s.message_type for s in registry.accepted_types("order-service")}
    assert accepted == {"PlaceOrder", "StockReserved", "StockRejected"}
    assert not registry.problems


def test_validation_lists_every_violation(registry) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PayloadValidationError) as err:
        registry.get("PlaceOrder").validate({"sku": "lower case", "quantity": 0, "extra": 1})
    text = str(err.value)
    assert "customer" in text and "sku" in text and "quantity" in text and "extra" in text


def test_validator_is_compiled_once(registry) -> None:  # type: ignore[no-untyped-def]
    assert registry.get("PlaceOrder").validator is registry.get("PlaceOrder").validator


def test_unknown_type(registry) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(UnknownMessageType, match="NoSuchThing"):
        registry.get("NoSuchThing")


def test_lint_reports_every_problem_with_file_and_path() -> None:
    reg = load_registry(FIXTURES / "broken", strict=False)
    text = "\n".join(map(str, reg.problems))
    assert "broken-service.yml: channels.broken-service.thing.create.publish.message" in text
    assert "missing-message" in text
    assert "does-not-exist.json" in text and "does not resolve" in text
    assert "invalid-schema.json" in text and "strng" in text
    assert "components.messages.thing-create" in text and "aggregate-type" in text
    assert "bad key with spaces" in text
    assert len(reg.errors) >= 5
    with pytest.raises(ContractError, match="contracts do not load"):
        load_registry(FIXTURES / "broken")


def test_naming_conventions_and_duplicates(tmp_path: Path) -> None:
    (tmp_path / "s.yml").write_text(
        """
asyncapi: 2.0.0
info: {title: Shop Service, version: '1'}
channels:
  shop-service.cart.checked-out:
    publish:
      message: {name: CheckedOut, tags: [{name: "aggregate-type:cart"}], payload: {type: object}}
  shop-service.cart.open:
    subscribe:
      message: {name: OpenCart, tags: [{name: "aggregate-type:cart"}], payload: {type: object}}
  shop-service.cart.again:
    subscribe:
      message: {name: OpenCart, tags: [{name: "aggregate-type:cart"}], payload: {type: object}}
"""
    )
    reg = load_registry(tmp_path, strict=False)
    assert "shop-service" in reg.services  # info.title in lower-kebab-case
    text = "\n".join(map(str, reg.problems))
    assert "warning" in text and "imperatively" in text and "past tense" in text
    assert "also declared" in text


def test_missing_folder_says_how_to_fix(tmp_path: Path) -> None:
    with pytest.raises(ContractError, match="TXBOX_CONTRACTS_DIR"):
        load_registry(tmp_path / "nope")


@pytest.mark.parametrize(
    ("pattern", "key", "match"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.b.c", True),
        ("a.#", "a.b.c", True),
        ("#", "a", True),
        ("a.*", "a.b.c", False),
        ("a.b", "a.b.c", False),
        ("#.c", "c", True),
    ],
)
def test_topic_matching(pattern: str, key: str, match: bool) -> None:
    assert topic_matches(pattern, key) is match


def test_names_derivation() -> None:
    assert names.kebab_case("Example Service") == "example-service"
    assert names.kebab_case("OrderService") == "order-service"
    assert names.pascal_case("example-create-command") == "ExampleCreateCommand"
    assert names.inbox_queue("order-service") == "order-service:inbox"
    assert names.retry_routing_key("s", "a.b.c") == "s:inbox.a.b.c"


def test_fast_validation_agrees_with_the_reference_and_words_errors_like_it(registry) -> None:  # type: ignore[no-untyped-def]
    spec = registry.get("PlaceOrder")
    assert spec._fast is not None, "the example schemas must compile with jsonschema-rs (the fast path)"
    cases = [
        {"customer": "ada", "sku": "SKU-1", "quantity": 2},
        {"customer": "ada", "sku": "SKU-1", "quantity": 0},
        {"customer": "ada", "sku": "lower case", "quantity": 1},
        {"customer": "ada", "sku": "SKU-1"},
        {"customer": "ada", "sku": "SKU-1", "quantity": 1, "extra": True},
        [],
    ]
    for payload in cases:
        assert spec._fast.is_valid(payload) == spec.validator.is_valid(payload), payload
    spec.validate(cases[0])
    with pytest.raises(PayloadValidationError, match="quantity"):
        spec.validate(cases[1])
    with pytest.raises(PayloadValidationError, match="does not match"):
        spec.validate(cases[2])
    # A value that is not JSON at all still gets the reference validator's verdict.
    with pytest.raises(PayloadValidationError):
        spec.validate({"customer": object(), "sku": "SKU-1", "quantity": 1})
