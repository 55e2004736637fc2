from pathlib import Path

import pytest

from framework.errors import ConfigurationError
from framework.settings import Settings, load, parse_duration

BASE = {"TXBOX_SERVICE": "order-service", "TXBOX_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1/orders"}


def test_reads_every_variable() -> None:
    s = Settings.from_env(
        {
            **BASE,
            "TXBOX_AMQP_URL": "amqp://u:p@mq:5672/v",
            "TXBOX_CONTRACTS_DIR": "c",
            "TXBOX_SCHEMA": "msg",
            "TXBOX_QUEUE_TYPE": "classic",
        }
    )
    assert (s.service, s.amqp_url, s.contracts_dir, s.schema, s.queue_type) == (
        "order-service",
        "amqp://u:p@mq:5672/v",
        Path("c"),
        "msg",
        "classic",
    )


def test_defaults() -> None:
    s = Settings.from_env(BASE)
    assert s.schema == "txbox" and s.queue_type == "quorum" and s.contracts_dir == Path("contracts")


def test_flags_override_environment() -> None:
    s = Settings.from_env(BASE, service="inventory-service", queue_type=None)
    assert s.service == "inventory-service" and s.queue_type == "quorum"


def test_is_frozen() -> None:
    s = Settings.from_env(BASE)
    with pytest.raises(AttributeError):
        s.service = "x"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("env", "variable", "example"),
    [
        ({"TXBOX_DATABASE_URL": BASE["TXBOX_DATABASE_URL"]}, "TXBOX_SERVICE", "TXBOX_SERVICE=order-service"),
        ({"TXBOX_SERVICE": "a"}, "TXBOX_DATABASE_URL", "TXBOX_DATABASE_URL=postgresql+psycopg://"),
        ({**BASE, "TXBOX_QUEUE_TYPE": "lazy"}, "TXBOX_QUEUE_TYPE", "TXBOX_QUEUE_TYPE=quorum"),
        ({**BASE, "TXBOX_SERVICE": "Order Service"}, "TXBOX_SERVICE", "TXBOX_SERVICE=order-service"),
        ({**BASE, "TXBOX_SCHEMA": "drop table;"}, "TXBOX_SCHEMA", "TXBOX_SCHEMA=txbox"),
        ({**BASE, "TXBOX_DATABASE_URL": "mysql://x"}, "TXBOX_DATABASE_URL", "TXBOX_DATABASE_URL=postgresql"),
        ({**BASE, "TXBOX_AMQP_URL": "http://x"}, "TXBOX_AMQP_URL", "TXBOX_AMQP_URL=amqp://"),
    ],
)
def test_bad_or_missing_value_names_variable_and_example(env: dict[str, str], variable: str, example: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        Settings.from_env(env)
    assert variable in str(err.value)
    assert example in str(err.value)


def test_password_is_masked_in_errors() -> None:
    with pytest.raises(ConfigurationError) as err:
        Settings.from_env({**BASE, "TXBOX_AMQP_URL": "http://user:secret@host"})
    assert "secret" not in str(err.value)


@pytest.mark.parametrize(("text", "seconds"), [("250ms", 0.25), ("10s", 10), ("5m", 300), ("2h", 7200), ("7d", 604800)])
def test_durations(text: str, seconds: float) -> None:
    assert parse_duration(text) == seconds


def test_bad_duration() -> None:
    with pytest.raises(ValueError):
        parse_duration("soon")


def test_retention_defaults_follow_the_dedup_window_and_a_shorter_inbox_retention_fails_naming_the_fix() -> None:
    from framework.settings import RetentionSettings

    day = 86400.0
    defaults = RetentionSettings.from_env()
    assert (defaults.outbox_retention, defaults.abandoned_retention) == (day, 30 * day)
    assert defaults.inbox_horizon(7 * day) == 7 * day
    assert defaults.inbox_horizon(14 * day) == 14 * day  # unset: never inside the window
    assert RetentionSettings(inbox_retention=0).inbox_horizon(7 * day) == 0  # off
    with pytest.raises(ConfigurationError, match=r"TXBOX_INBOX_RETENTION=86400s is shorter than TXBOX_DEDUP_WINDOW"):
        load(RetentionSettings, {"TXBOX_INBOX_RETENTION": "1d"}).inbox_horizon(7 * day)
    with pytest.raises(ConfigurationError, match="TXBOX_OUTBOX_RETENTION=-1s must not be negative"):
        RetentionSettings(outbox_retention=-1)  # type: ignore[arg-type]
