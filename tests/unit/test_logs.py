"""TXBOX_LOG_FORMAT: JSON lines with the context fields, text by default; neither carries secrets."""

from __future__ import annotations

import io
import json
import logging
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest

from framework import logs
from framework.errors import ConfigurationError
from tests.conftest import ROOT


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO, logging.Handler]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    logger = logging.getLogger("txbox.worker")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        yield logger, stream, handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
        logs.set_service("")
        logs.set_trace_id_source(None)


def test_json_line_has_the_fields_and_the_bound_context(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    logs.set_service("order-service")
    message_id = uuid.UUID("0b7c7b4e-6a43-4c4e-9d0e-2f1f5c7a9b11")  # bound as it is; written as text
    with logs.bind(batch_size=3), logs.bind(message_id=message_id):
        logger.info("handled %s", "PlaceOrder", extra={"trace_id": "abc123"})
    logger.warning("outside")
    first, second = (json.loads(line) for line in stream.getvalue().splitlines())
    assert first["level"] == "INFO" and first["logger"] == "txbox.worker" and first["message"] == "handled PlaceOrder"
    assert first["service"] == "order-service" and first["daemon"] == "worker"
    assert first["message_id"] == str(message_id) and first["batch_size"] == 3 and first["trace_id"] == "abc123"
    assert first["time"].endswith("+00:00")
    assert "message_id" not in second and "trace_id" not in second  # the block ended


def test_a_tenants_daemon_names_its_tenant_in_both_formats(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    """A tenant's daemon logs through :func:`logs.daemon_logger`; a handler's own logger
    names the tenant bound around its batch; a daemon of no tenant names none."""
    logger, stream, handler = captured
    tenants_logger = logs.daemon_logger("txbox.worker", "acme")
    handler.setFormatter(logs.JsonFormatter())
    tenants_logger.info("claimed", extra={"trace_id": "abc123"})
    with logs.bind(tenant="globex"):
        logging.getLogger("txbox.worker").info("handled")
    logs.daemon_logger("txbox.worker", None).info("alone")
    claimed, handled, alone = (json.loads(line) for line in stream.getvalue().splitlines())
    assert (claimed["tenant"], handled["tenant"]) == ("acme", "globex") and "tenant" not in alone
    assert claimed["trace_id"] == "abc123"  # the caller's extra kept beside the tenant
    stream.seek(0), stream.truncate()
    handler.setFormatter(logs.TextFormatter())
    tenants_logger.warning("claimed")
    logger.warning("alone")
    claimed_text, alone_text = stream.getvalue().splitlines()
    assert claimed_text.endswith("WARNING txbox.worker [tenant acme]: claimed")
    assert alone_text.endswith("WARNING txbox.worker: alone")


def test_trace_id_from_the_registered_source(captured: tuple[logging.Logger, io.StringIO, logging.Handler]) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    logs.set_trace_id_source(lambda: "0af7651916cd43dd8448eb211c80319c")
    logger.info("x")
    assert json.loads(stream.getvalue())["trace_id"] == "0af7651916cd43dd8448eb211c80319c"


def test_neither_format_carries_a_token_or_a_url_password(
    captured: tuple[logging.Logger, io.StringIO, logging.Handler],
) -> None:
    logger, stream, handler = captured
    for formatter in (logs.JsonFormatter(), logs.TextFormatter()):
        handler.setFormatter(formatter)
        try:
            raise ValueError('bad {"auth_token": "s3cr3t-tok"}')
        except ValueError:
            logger.exception("failed auth_token=s3cr3t-tok at amqp://app:hunter22@broker:5672/")
    text = stream.getvalue()
    assert "s3cr3t-tok" not in text and "hunter22" not in text
    assert text.count("[redacted]") >= 4 and "amqp://app:***@broker" in text


def test_a_huge_message_is_cut(captured: tuple[logging.Logger, io.StringIO, logging.Handler]) -> None:
    logger, stream, handler = captured
    handler.setFormatter(logs.JsonFormatter())
    logger.info("x" * (logs.MAX_MESSAGE_CHARS * 3))
    assert len(json.loads(stream.getvalue())["message"]) < logs.MAX_MESSAGE_CHARS + 20


def test_unknown_format_fails_naming_the_choices() -> None:
    with pytest.raises(ConfigurationError, match=r"TXBOX_LOG_FORMAT='xml'.*text or json"):
        logs.configure(logging.INFO, "xml")


def test_configure_installs_the_chosen_formatter() -> None:
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        logs.configure(logging.INFO, "json")
        assert isinstance(root.handlers[0].formatter, logs.JsonFormatter)
        logs.configure(logging.INFO, None)
        assert isinstance(root.handlers[0].formatter, logs.TextFormatter)
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)


def test_the_handler_writes_to_stderr_as_it_is_now(monkeypatch: pytest.MonkeyPatch) -> None:
    """A command run in-process leaves its handler behind: a later line must not go to (and
    fail on) the stream that was stderr when it was configured."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    then, now = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", then)
        logs.configure(logging.INFO, "text")
        then.close()  # as a test's capture is, once the test ends
        monkeypatch.setattr(sys, "stderr", now)
        logging.getLogger("txbox.test").info("after the capture closed")
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    [line] = now.getvalue().splitlines()  # not logging's "--- Logging error ---" report
    assert line.endswith("INFO txbox.test: after the capture closed"), line


def test_the_command_refuses_an_unknown_format_naming_the_fix() -> None:
    code = "import sys; from framework.cli import main; sys.exit(main(['migrate', '--sql']))"
    env = {"TXBOX_LOG_FORMAT": "xml", "TXBOX_SERVICE": "order-service", "PATH": ""}
    done = subprocess.run(
        [sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2 and "TXBOX_LOG_FORMAT='xml'" in done.stderr and "text or json" in done.stderr
