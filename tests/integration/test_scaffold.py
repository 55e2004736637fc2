"""`txbox new SERVICE`: the scaffold assembles, its generated code is current, its own tests pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from framework.cli import main
from framework.errors import ConfigurationError
from framework.scaffold import create

BIN = Path(sys.executable).parent
# Nothing listens on port 1: a test that tried to reach RabbitMQ would fail.
NO_BROKER = "amqp://guest:guest@127.0.0.1:1/%2F"


def run(*command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TXBOX_AMQP_URL": NO_BROKER}
    env.pop("TXBOX_DATABASE_URL", None)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=240, check=False)


@pytest.mark.slow
def test_a_new_service_passes_its_own_tests_and_checks(tmp_path: Path) -> None:
    assert main(["new", "billing-service", "--dir", str(tmp_path / "billing")]) == 0

    tests = run(str(BIN / "pytest"), "-q", "-p", "no:cacheprovider", "billing", cwd=tmp_path)
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert "2 passed" in tests.stdout

    check = run(str(BIN / "txbox"), "check", "--app", "billing.app:service", "--generated", "billing/messages.py",
                cwd=tmp_path)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    assert "service billing-service (1 handlers): 0 error(s), 0 warning(s)" in check.stdout

    lint = run(str(BIN / "ruff"), "check", "--line-length", "120", "billing", cwd=tmp_path)
    assert lint.returncode == 0, lint.stdout


def test_the_scaffold_names_follow_the_service_id(tmp_path: Path) -> None:
    written = {p.relative_to(tmp_path / "shop").as_posix() for p in create(tmp_path / "shop", "shop-service")}
    assert {
        "contracts/shop-service/shop-service.yml",
        "contracts/shop-service/commands/create-shop.json",
        "migrations/versions/shop_0001.py",
        "messages.py",
        "tests/test_handlers.py",
    } <= written
    assert "class CreateShop(CommandHandler)" in (tmp_path / "shop" / "app.py").read_text()


@pytest.mark.parametrize(
    ("service", "folder", "error"),
    [
        ("Billing", "billing", "is not a service id"),
        ("billing-service", "billing-service", "cannot be a Python package"),
        ("billing-service", "class", "cannot be a Python package"),
    ],
)
def test_bad_names_are_refused_with_the_fix(tmp_path: Path, service: str, folder: str, error: str) -> None:
    with pytest.raises(ConfigurationError, match=error):
        create(tmp_path / folder, service)
    assert not (tmp_path / folder).exists()


def test_a_folder_with_files_is_never_written_into(tmp_path: Path) -> None:
    (tmp_path / "billing").mkdir()
    (tmp_path / "billing" / "app.py").write_text("mine = True\n")
    with pytest.raises(ConfigurationError, match="not empty"):
        create(tmp_path / "billing", "billing-service")
    assert (tmp_path / "billing" / "app.py").read_text() == "mine = True\n"
