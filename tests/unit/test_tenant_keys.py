"""Multi-tenant routing keys (docs/explanation/receive.md, "Multi-tenant routing keys"): filling,
matching and reading Mosaic's `*.*` placeholders."""

from __future__ import annotations

import pytest

from framework import names

PATTERN = "ax-image-service.*.*.image_types.declare"


def test_the_placeholders_take_the_tenant_then_the_environment() -> None:
    key = names.tenant_routing_key(PATTERN, "t-1", "e_2")
    assert key == "ax-image-service.t-1.e_2.image_types.declare"
    assert names.tenancy(PATTERN, key) == ("t-1", "e_2")


@pytest.mark.parametrize("tenant", ["", "a.b", "*", "#", "x" * 65, "é", "a b"])
def test_a_tenant_that_is_not_one_word_is_refused(tenant: str) -> None:
    with pytest.raises(ValueError, match="tenant_id"):
        names.tenant_routing_key(PATTERN, tenant, "e")


@pytest.mark.parametrize(
    "key",
    [
        PATTERN,  # the placeholders themselves name no tenant
        "ax-image-service.t.image_types.declare",
        "ax-image-service.t.e.x.image_types.declare",
        "ax-image-service.t.e.image_types.declared",
        "other-service.t.e.image_types.declare",
        "ax-image-service.t.#.image_types.declare",
    ],
)
def test_only_the_pattern_with_two_words_in_its_placeholders_matches(key: str) -> None:
    assert not names.placeholders_match(PATTERN, key)
    assert names.tenancy(PATTERN, key) is None


def test_contracts_take_mosaic_placeholders_only_at_the_front(tmp_path: object) -> None:
    from pathlib import Path

    from framework.contracts import load_registry

    folder = Path(str(tmp_path))

    def contract(channel: str) -> Path:
        (folder / "thing.json").write_text('{"type": "object", "title": "declare_thing_command"}')
        (folder / "svc.yml").write_text(
            "asyncapi: 2.0.0\nx-service-id: ax-svc\ninfo: {title: Svc, version: '1'}\n"
            f"channels:\n  '{channel}':\n    publish:\n      message: {{$ref: '#/components/messages/m'}}\n"
            "components:\n  messages:\n    m:\n      tags: [{name: 'aggregate-type:thing'}]\n"
            "      payload: {$ref: 'thing.json'}\n"
        )
        return folder

    spec = load_registry(contract("*.*.thing.declare")).get("DeclareThing")
    assert spec.routing_key == "ax-svc.*.*.thing.declare" and spec.tenant_scoped
    assert spec.routes("ax-svc.t.e.thing.declare") and not spec.routes(spec.routing_key)
    for channel in ("thing.*.declare", "*.thing.declare", "*.*.*.thing.declare", "#.thing.declare"):
        with pytest.raises(Exception, match="channel name"):
            load_registry(contract(channel))
