"""The `txbox` command.

Each sub-command lives in its own module exposing ``configure(parser)`` and
``run(args) -> int``; only the chosen one is imported, so `txbox --help` stays fast and
`txbox migrate` never loads Spark or the web stack.

Other distributions add sub-commands through the entry-point group :data:`COMMAND_GROUP`,
each entry naming such a module with a one-line ``HELP`` besides; the repository's
development tools (``bench``, ``chaos``, ``demo``) come that way, so the library's wheel
holds none of them (docs/explanation/development.md, "The development tools").
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
import threading
import traceback
import typing
from collections.abc import Sequence
from importlib.metadata import EntryPoint, PackageNotFoundError, entry_points, version
from types import ModuleType, TracebackType

from framework import logs, redaction
from framework.errors import TxboxError

# name → (module, one-line help). The public command names first.
COMMANDS: dict[str, tuple[str, str]] = {
    "migrate": ("framework.cli.migrate", "apply the framework's migrations (--sql prints them)"),
    "topology": ("framework.cli.topology", "declare exchanges, queues and bindings"),
    "tenants": ("framework.cli.tenants", "the tenant registry: init (its control table) / list"),
    "check": ("framework.cli.check", "assembly validation and contracts lint"),
    "contracts": ("framework.cli.check", "contracts check: lint the folder and show each message's routing"),
    "publisher": ("framework.cli.publisher", "run the outbox publisher daemon"),
    "receiver": ("framework.cli.receiver", "run the inbox receiver daemon"),
    "worker": ("framework.cli.worker", "run the inbox worker daemon"),
    "run": ("framework.cli.run", "run publisher, receiver and worker in one process"),
    "collector": ("framework.cli.collector", "drain <service>:dead_letter into txbox.dead_letters"),
    "dlq": ("framework.cli.dlq", "dead letters: list / show / replay / discard"),
    "outbox": ("framework.cli.pending", "what the outbox still holds: list (state, age, attempts, last error)"),
    "inbox": ("framework.cli.pending", "what the inbox still holds: list (state, age, attempts, last error)"),
    "dashboard": ("framework.cli.dashboard", "the dead-letter and health dashboard (web)"),
    "analyze": ("framework.cli.analyze", "the Spark reconciliation and analytics job"),
    "archive": ("framework.cli.archive", "move old processed/abandoned rows to Parquet"),
    "codegen": ("framework.cli.codegen", "typed payload classes (TypedDicts) from the contracts"),
    "new": ("framework.cli.new", "scaffold a service: contract, handler, migrations, tests"),
}

#: The entry-point group of sub-commands from other distributions (name = the command).
COMMAND_GROUP = "txbox.commands"
#: The development tools' commands: asked for without the tools installed, they say how to get them.
TOOL_COMMANDS = ("bench", "chaos", "demo")
_NO_TOOLS = (
    "is one of the development tools (distribution txbox-tools, the tools/ folder of the txbox repository), "
    "which are not installed; in a clone of the repository run `make setup` (or `pip install -e tools`)"
)


def _version() -> str:
    try:
        return version("txbox")
    except PackageNotFoundError:  # run from a source tree that was never installed
        from framework import __version__

        return __version__


def _added() -> dict[str, EntryPoint]:
    """The commands other distributions add (a built-in one is never replaced; the first entry wins)."""
    found: dict[str, EntryPoint] = {}
    for entry in entry_points(group=COMMAND_GROUP):
        if entry.name not in COMMANDS:
            found.setdefault(entry.name, entry)
    return found


def _load(entry: EntryPoint) -> ModuleType | Exception:
    """The command's module, or why it would not load (returned, not raised: `txbox --help` must still work)."""
    try:
        module = entry.load()
    except Exception as exc:  # whatever a broken distribution raises
        return exc
    return module if isinstance(module, ModuleType) else TypeError(f"{entry.value} is not a module")


def _describe(module: ModuleType | Exception) -> str:
    if isinstance(module, Exception):
        return f"(cannot be loaded: {type(module).__name__}: {module})"
    return str(getattr(module, "HELP", ""))


def _usage() -> str:
    listed = {name: help_ for name, (_, help_) in COMMANDS.items()}
    listed |= {name: _describe(_load(entry)) for name, entry in _added().items()}
    width = max(map(len, listed))
    lines = ["usage: txbox <command> [options]   (txbox <command> --help for its options; txbox --version)"]
    lines += ["", "commands:", *(f"  {name.ljust(width)}  {help_}" for name, help_ in listed.items())]
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    """argparse quotes a bad value in its error (``invalid int value: '<url>'``): masked here,
    and in every sub-command's parser (they are made of this class)."""

    def error(self, message: str) -> typing.NoReturn:
        super().error(redaction.mask_credentials(message))


def _write_masked(text: str) -> None:
    try:
        sys.stderr.write(redaction.redact_text(text))
        sys.stderr.flush()
    except Exception:  # the last resort: stderr closed, or the masker failing on odd input
        pass


def _excepthook(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    """An exception nobody caught in the main thread: the default's traceback, masked."""
    _write_masked("".join(traceback.format_exception(exc_type, exc, tb)))


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    """A thread that died of an exception (an application's own thread, a library's):
    the default's text, ``Exception in thread <name>:`` and the traceback, masked."""
    if args.exc_type is SystemExit:
        return  # as the default: a thread's sys.exit() is silent
    name = args.thread.name if args.thread is not None else threading.get_ident()
    lines = traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback)
    _write_masked(f"Exception in thread {name}:\n" + "".join(lines))


def _unraisablehook(unraisable: typing.Any) -> None:
    """An exception Python could not raise (in ``__del__``, a finalizer): masked as well."""
    where = f"{unraisable.err_msg or 'Exception ignored in'}: {unraisable.object!r}\n"
    lines = traceback.format_exception(unraisable.exc_type, unraisable.exc_value, unraisable.exc_traceback)
    _write_masked(where + "".join(lines))


def install_excepthooks() -> None:
    """Tracebacks that no log handler formats (an uncaught exception in the main thread or
    in any thread, an unraisable one) go to stderr through the same masker as the logs
    (redaction.redact_text): a driver's text quoting a URL or DSN loses its password
    there too (docs/explanation/operations.md, "Secrets"). Installed by :func:`main`, for the whole process."""
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook
    sys.unraisablehook = _unraisablehook


def main(argv: Sequence[str] | None = None) -> int:
    install_excepthooks()
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] in (["-V"], ["--version"]):
        print(f"txbox {_version()}")
        return 0
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    found = _command(args[0])
    if isinstance(found, int):
        return found
    module, description = found
    return _run(args[0], module, description, args[1:])


def _command(name: str) -> tuple[ModuleType, str] | int:
    """The module and description of command ``name``, or the exit status after saying why
    there is none."""
    if name in COMMANDS:
        return importlib.import_module(COMMANDS[name][0]), COMMANDS[name][1]
    if entry := _added().get(name):
        loaded = _load(entry)
        if isinstance(loaded, Exception):
            print(f"txbox {name}: error: {_describe(loaded)}; reinstall the distribution that adds it", file=sys.stderr)
            return 2
        return loaded, _describe(loaded)
    if name in TOOL_COMMANDS:
        print(f"txbox: {name} {_NO_TOOLS}", file=sys.stderr)
    else:
        print(f"txbox: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
    return 2


def _run(name: str, module: ModuleType, description: str, args: list[str]) -> int:
    """Parse ``args`` for command ``name`` and run it: its exit status."""
    parser = _Parser(prog=f"txbox {name}", description=description)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    module.configure(parser, name)
    ns = parser.parse_args(args)
    ns.command = name
    try:
        redaction.sensitive_keys()  # a bad TXBOX_SENSITIVE_KEYS fails at start, not at the first dead letter
        logs.configure(logging.DEBUG if ns.verbose else logging.INFO, os.environ.get("TXBOX_LOG_FORMAT"))
        if not ns.verbose:
            logging.getLogger("pika").setLevel(logging.WARNING)  # pika narrates every socket event
        result: int = module.run(ns)
        return result
    except TxboxError as exc:
        # Our errors carry the fix in their text; a stack trace would only hide it.
        # Masked: a driver's text can quote the DSN (docs/explanation/operations.md, "Secrets").
        print(f"txbox {name}: error: {redaction.mask_credentials(str(exc))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `txbox dlq list | head`: the reader left; say nothing more, like other Unix tools.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    raise SystemExit(main())
