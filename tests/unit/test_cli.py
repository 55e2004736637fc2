import sys
import types
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from framework import CommandHandler, Service
from framework.cli import main as txbox

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_fixed_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert txbox(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("migrate", "topology", "check", "publisher", "receiver", "worker", "run", "dlq", "dashboard"):
        assert f"  {command} " in out
    for command in ("analyze", "bench"):
        assert f"  {command} " in out


def test_unknown_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert txbox(["publish"]) == 2
    assert "unknown command 'publish'" in capsys.readouterr().err


def test_check_lints_the_contracts_folder(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TXBOX_SERVICE", raising=False)
    assert txbox(["check", "--contracts-dir", str(ROOT / "contracts")]) == 0
    assert "0 error(s)" in capsys.readouterr().out
    assert txbox(["check", "--contracts-dir", str(ROOT / "tests/fixtures/broken")]) == 1
    out = capsys.readouterr().out
    assert "broken-service.yml: channels.broken-service.thing.create.publish.message" in out


def test_check_warnings_fail_only_when_strict(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TXBOX_SERVICE", raising=False)
    folder = str(ROOT / "tests/fixtures/old-style")
    assert txbox(["check", "--contracts-dir", folder]) == 0
    assert txbox(["check", "--contracts-dir", folder, "--strict"]) == 1
    assert "warning" in capsys.readouterr().out


def test_check_an_app_reports_assembly_errors(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    class PlaceOrder(CommandHandler):
        message_type = "PlaceOrder"

    app = types.ModuleType("txbox_test_app")
    app.service = Service(  # type: ignore[attr-defined]
        name="order-service", database_url="postgresql://x/y", contracts_dir=ROOT / "contracts"
    )
    app.service.register(PlaceOrder())  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "txbox_test_app", app)
    assert txbox(["check", "--app", "txbox_test_app:service"]) == 1
    out = capsys.readouterr().out
    assert "subscribes to event StockReserved but no handler" in out


@pytest.mark.parametrize(
    ("app", "message"),
    [
        ("no_colon", "must be module:attribute"),
        ("no_such_module_xyz:service", "cannot import"),
        ("framework:nothing", "has no attribute"),
        ("framework:Message", "not a txbox Service"),
    ],
)
def test_bad_app_is_one_clear_line(app: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert txbox(["check", "--app", app]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_setting_fails_at_start_with_the_fix(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TXBOX_DATABASE_URL", raising=False)
    assert txbox(["migrate", "--service", "order-service"]) == 2
    err = capsys.readouterr().err
    assert "TXBOX_DATABASE_URL is not set" in err and "Example: TXBOX_DATABASE_URL=postgresql" in err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert txbox(["--version"]) == 0
    import framework

    assert capsys.readouterr().out.strip() == f"txbox {framework.__version__}"  # the metadata's, from pyproject.toml


def test_commands_added_through_entry_points(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import argparse

    from framework import cli

    command = types.ModuleType("txbox_test_command")
    command.HELP = "greet someone"  # type: ignore[attr-defined]
    command.configure = lambda parser, name: parser.add_argument("--who", default="world")  # type: ignore[attr-defined]

    def run(args: argparse.Namespace) -> int:
        print(f"hello {args.who}")
        return 0

    command.run = run  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "txbox_test_command", command)
    added = [
        EntryPoint("hello", "txbox_test_command", cli.COMMAND_GROUP),
        EntryPoint("broken", "no_such_module_xyz", cli.COMMAND_GROUP),
        EntryPoint("migrate", "no_such_module_xyz", cli.COMMAND_GROUP),  # a built-in command is never replaced
    ]
    monkeypatch.setattr(cli, "entry_points", lambda group: added if group == cli.COMMAND_GROUP else [])

    assert txbox(["--help"]) == 0
    out = capsys.readouterr().out
    assert "  hello      greet someone" in out
    assert "  broken     (cannot be loaded: ModuleNotFoundError" in out
    assert txbox(["hello", "--who", "txbox"]) == 0
    assert capsys.readouterr().out == "hello txbox\n"
    assert txbox(["broken"]) == 2
    assert "reinstall the distribution" in capsys.readouterr().err
    assert txbox(["migrate", "--sql"]) == 0
    assert "CREATE TABLE" in capsys.readouterr().out
    # The development tools, asked for where they are not installed, say how to get them.
    assert txbox(["bench", "relay"]) == 2
    assert "make setup" in capsys.readouterr().err
