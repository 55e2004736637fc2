"""The example services assemble and their models match their migrations."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from framework import Service

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("module", "name", "handled"),
    [
        ("examples.orders.app", "order-service", {"PlaceOrder", "StockReserved", "StockRejected"}),
        ("examples.inventory.app", "inventory-service", {"RestockItem", "OrderPlaced"}),
    ],
)
def test_example_service_assembles(module: str, name: str, handled: set[str]) -> None:
    service = importlib.import_module(module).service
    assert isinstance(service, Service)
    assert service.name == name
    assert service.check() == []  # no errors and not even a warning
    assert set(service.handlers) == handled


def test_examples_use_only_the_public_api() -> None:
    """A service is what a user writes, so it imports only `framework`'s top level.

    (The demo driver and the migration helper around the services are tooling.) Their tests
    may also use the test kit, ``framework.testing``, a public module of its own.
    """
    paths = [*(ROOT / "examples" / "orders").rglob("*.py"), *(ROOT / "examples" / "inventory").rglob("*.py")]
    assert len(paths) >= 6
    for path in paths:
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert not node.module.startswith("framework.") or _is_kit(path, node.module), (
                    f"{path}: imports {node.module}"
                )
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("framework.") and not _is_kit(path, a.name) for a in node.names), (
                    f"{path}"
                )


def _is_kit(path: Path, module: str) -> bool:
    return "tests" in path.parts and module.split(".")[:2] == ["framework", "testing"]


def test_example_env_overrides_the_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:5432/elsewhere"
    monkeypatch.setenv("TXBOX_DATABASE_URL", url)
    monkeypatch.setenv("TXBOX_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/other")
    from examples.orders import app

    fresh = importlib.reload(app)
    try:
        assert fresh.service.settings.database_url == url
        assert fresh.service.settings.amqp_url.endswith("/other")
        assert fresh.service.settings.contracts_dir.is_dir()
    finally:
        monkeypatch.delenv("TXBOX_DATABASE_URL")
        monkeypatch.delenv("TXBOX_AMQP_URL")
        importlib.reload(app)
