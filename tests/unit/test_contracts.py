import json
from pathlib import Path

import pytest
import yaml

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
    spec = reg.get("CreateExample")  # Mosaic's generator: schema title without "command"
    assert (spec.kind, spec.channel, spec.routing_key, spec.service, spec.aggregate_type) == (
        "command",
        "example.create",
        "ax-service-example.example.create",  # <consumer id>.<channel>, as Mosaic sends it
        "ax-service-example",
        "example",
    )
    # The seed's envelope names it after the component key: an alias of the same type.
    assert reg.get("ExampleCreateCommand") is spec
    spec.validate({"title": "Example Title 1", "count": 3})
    with pytest.raises(PayloadValidationError):
        spec.validate({"title": "x"})
    assert not reg.problems


def test_mosaic_catalog_contract_loads_and_checks_clean() -> None:
    reg = load_registry(FIXTURES / "mosaic-catalog")
    assert not reg.problems, [str(p) for p in reg.problems]
    failed, success = reg.get("EntityPublishFailed"), reg.get("EntityPublishSuccess")
    assert (failed.kind, failed.service, failed.routing_key) == (
        "event",
        "catalog-service",  # top-level x-service-id
        "catalog-service.entity.entity_publish_failed",
    )
    assert success.routing_key == "catalog-service.entity.entity_publish_success"
    assert reg.get("EntityPublishFailedEvent") is failed  # component key alias
    failed.validate({"content_id": "1", "message": "no"})


def _component(name: str | None = None, schema: str = "s.json") -> dict[str, object]:
    out: dict[str, object] = {"tags": [{"name": "aggregate-type:widget"}], "payload": {"$ref": schema}}
    if name:
        out["name"] = name
    return out


def _write_widget_contract(folder: Path, *, as_json: bool, service_at: str = "top") -> None:
    schema = {"type": "object", "title": "create_widget_command"}
    (folder / "s.json").write_text(json.dumps(schema))
    (folder / "e.json").write_text(json.dumps({"type": "object", "title": "widget_created_event"}))
    doc: dict[str, object] = {
        "asyncapi": "2.0.0",
        "info": {"title": "Anything", "version": "1"},
        "channels": {
            "widget.create": {"publish": {"message": {"$ref": "#/components/messages/create-widget-command"}}},
            "widget.created": {"subscribe": {"message": {"$ref": "#/components/messages/widget-created-event"}}},
        },
        "components": {
            "messages": {
                "create-widget-command": _component(),
                "widget-created-event": _component(schema="e.json"),
            }
        },
    }
    if service_at == "top":
        doc["x-service-id"] = "mosaic-peer"
    else:
        doc["info"] = {"title": "Anything", "version": "1", "x-service-id": "mosaic-peer"}
    if as_json:
        (folder / "peer.json").write_text(json.dumps(doc))
    else:
        (folder / "peer.yml").write_text(yaml.safe_dump(doc))


@pytest.mark.parametrize(("as_json", "service_at"), [(True, "top"), (False, "top"), (False, "info"), (True, "info")])
def test_contract_as_mosaic_writes_it(tmp_path: Path, as_json: bool, service_at: str) -> None:
    _write_widget_contract(tmp_path, as_json=as_json, service_at=service_at)
    reg = load_registry(tmp_path)
    create, created = reg.get("CreateWidget"), reg.get("WidgetCreated")
    assert (create.service, create.kind, create.routing_key) == ("mosaic-peer", "command", "mosaic-peer.widget.create")
    assert (created.kind, created.routing_key) == ("event", "mosaic-peer.widget.created")
    assert reg.get("CreateWidgetCommand") is create and reg.get("WidgetCreatedEvent") is created
    assert sorted(reg.messages) == ["CreateWidget", "WidgetCreated"]


def test_explicit_name_wins_and_an_ambiguous_alias_is_dropped(tmp_path: Path) -> None:
    (tmp_path / "s.json").write_text(json.dumps({"type": "object", "title": "thing_result_event"}))
    (tmp_path / "c.yml").write_text(
        """
asyncapi: 2.0.0
x-service-id: things
info: {title: Things, version: '1'}
channels:
  thing.kept: {subscribe: {message: {$ref: '#/components/messages/thing-kept'}}}
  thing.lost: {subscribe: {message: {$ref: '#/components/messages/thing-lost'}}}
components:
  messages:
    thing-kept: {name: ThingKept, tags: [{name: "aggregate-type:thing"}], payload: {$ref: s.json}}
    thing-lost: {name: ThingLost, tags: [{name: "aggregate-type:thing"}], payload: {$ref: s.json}}
"""
    )
    reg = load_registry(tmp_path)
    assert sorted(reg.messages) == ["ThingKept", "ThingLost"]
    with pytest.raises(UnknownMessageType):
        reg.get("ThingResult")  # both share the schema: the generated name is nobody's alias


def test_service_id_problems_are_errors(tmp_path: Path) -> None:
    _write_widget_contract(tmp_path, as_json=False)
    doc = yaml.safe_load((tmp_path / "peer.yml").read_text())
    doc["info"]["x-service-id"] = "someone-else"
    (tmp_path / "peer.yml").write_text(yaml.safe_dump(doc))
    reg = load_registry(tmp_path, strict=False)
    assert any("differs from info.x-service-id" in p.message for p in reg.errors)
    doc["info"].pop("x-service-id")
    doc["x-service-id"] = "Not.A.Service"
    (tmp_path / "peer.yml").write_text(yaml.safe_dump(doc))
    reg = load_registry(tmp_path, strict=False)
    assert any("is not a service id" in p.message for p in reg.errors)


def test_a_channel_that_repeats_the_service_id_is_flagged(tmp_path: Path) -> None:
    (tmp_path / "c.yml").write_text(
        """
asyncapi: 2.0.0
x-service-id: shop
info: {title: Shop, version: '1'}
channels:
  shop.cart.open: {publish: {message: {name: OpenCart, tags: [{name: "aggregate-type:cart"}], payload: {type: object}}}}
"""
    )
    reg = load_registry(tmp_path, strict=False)
    assert reg.get("OpenCart").routing_key == "shop.shop.cart.open"
    assert [p.severity for p in reg.problems] == ["warning"]
    assert "drop the leading 'shop'" in reg.problems[0].message


def test_example_services_make_a_saga(registry) -> None:  # type: ignore[no-untyped-def]
    assert set(registry.services) == {"order-service", "inventory-service"}
    place = registry.get("PlaceOrder")
    assert (place.kind, place.service, place.routing_key) == ("command", "order-service", "order-service.order.place")
    placed = registry.get("OrderPlaced")
    assert placed.kind == "event" and registry.subscribers(placed) == ["inventory-service"]
    assert registry.subscribers(registry.get("StockReserved")) == ["order-service"]
    assert (placed.channel, placed.routing_key) == ("order.placed", "order-service.order.placed")
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
    assert "components.messages.thing-create" in text and "aggregate-type" in text  # a warning: the tag is older
    assert "bad key with spaces" in text
    assert len(reg.errors) >= 4
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
    assert names.mosaic_message_type("create_widget_command") == "CreateWidget"
    assert names.mosaic_message_type("entity_publish_failed_event") == "EntityPublishFailed"
    assert names.mosaic_message_type("Create Example Command") == "CreateExample"
    assert names.mosaic_message_type("command") == "Command"
    assert names.wire_routing_key("ax-service-example", "example.create") == "ax-service-example.example.create"
    assert names.delay_queue(10) == "delay:10s:at-least-once" and names.mosaic_delay_queue(10) == "delay:10s"
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


def test_contracts_check_explains_the_routing_rule(capsys: pytest.CaptureFixture[str]) -> None:
    from framework.cli import main as txbox

    assert txbox(["contracts", "check", "--contracts-dir", str(FIXTURES / "seed003")]) == 0
    out = capsys.readouterr().out
    assert "`<consumer service id>.<channel>`" in out and "`<producer service id>.<channel>`" in out
    assert "CreateExample (also accepted as ExampleCreateCommand): command / ax-service-example.example.create" in out
    assert "0 error(s), 0 warning(s)" in out
    assert txbox(["contracts", "check", "--strict", "--contracts-dir", str(FIXTURES / "old-style")]) == 1
    assert "travels as 'shop-service.shop-service.cart.open'" in capsys.readouterr().out


def test_a_handler_named_after_an_alias_is_told_the_one_type() -> None:
    from framework import CommandHandler, Service

    class ExampleCreateCommand(CommandHandler):
        message_type = "ExampleCreateCommand"

    service = Service(name="ax-service-example", database_url="postgresql://x/y", contracts_dir=FIXTURES / "seed003")
    service.register(ExampleCreateCommand())
    text = "\n".join(str(p) for p in service.problems())
    assert "an alias of 'CreateExample'" in text and "set message_type = 'CreateExample'" in text


def test_a_bad_name_or_an_overlong_routing_key_is_an_error(tmp_path: Path) -> None:
    def channel(name: object) -> dict[str, object]:
        return {"publish": {"message": {"name": name, "tags": [{"name": "aggregate-type:t"}], "payload": {}}}}

    doc = {
        "asyncapi": "2.0.0",
        "x-service-id": "things",
        "info": {"title": "Things", "version": "1"},
        "channels": {"thing.make": channel(["Make"]), "thing." + "x" * 250: channel("MakeLong")},
    }
    (tmp_path / "c.json").write_text(json.dumps(doc))
    reg = load_registry(tmp_path, strict=False)
    text = "\n".join(str(p) for p in reg.errors)
    assert "['Make'] is not a message type" in text
    assert "longer than AMQP's 255 bytes" in text
    assert not reg.messages
