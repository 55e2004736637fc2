"""Where the management API is, and what an operator is told to run (no broker needed)."""

from __future__ import annotations

import json
import shlex

from framework import delivery_limit, names
from framework.delivery_limit import Management
from framework.settings import Settings


def _settings(**overrides: object) -> Settings:
    values: dict[str, object] = {"service": "order-service", "database_url": "postgresql://x/y"}
    return Settings(**{**values, **overrides})  # type: ignore[arg-type]


def test_the_management_url_is_derived_from_the_amqp_url() -> None:
    plain = Management.from_settings(_settings(amqp_url="amqp://app:s%40cret@rabbit:5672/orders,amqp://other/"))
    assert plain == Management("http://rabbit:15672/api", "app", "s@cret", "orders")
    tls = Management.from_settings(_settings(amqp_url="amqps://app:pw@rabbit/%2F"))
    assert tls == Management("https://rabbit:15671/api", "app", "pw", "/")


def test_a_configured_url_keeps_its_own_credentials_or_borrows_the_amqp_ones() -> None:
    borrowed = Management.from_settings(
        _settings(amqp_url="amqp://app:pw@rabbit/%2F", amqp_management_url="https://mgmt.example/api/")
    )
    assert borrowed == Management("https://mgmt.example/api", "app", "pw", "/")
    own = Management.from_settings(
        _settings(amqp_url="amqp://app:pw@rabbit/%2F", amqp_management_url="http://admin:root@mgmt:8080/api")
    )
    assert own == Management("http://mgmt:8080/api", "admin", "root", "/")
    assert Management.from_settings(_settings(amqp_management_url="off")) is None


def test_a_bad_or_underivable_management_url_is_reported_with_the_command() -> None:
    for settings in (
        _settings(amqp_management_url="ftp://rabbit/api"),
        _settings(amqp_url="amqp://app:pw@rabbit:5800/%2F"),  # its management port is anyone's guess
    ):
        outcome = delivery_limit.ensure(settings)
        assert not outcome.held
        assert "TXBOX_AMQP_MANAGEMENT_URL" in outcome.message and "rabbitmqctl set_policy" in outcome.message


def test_the_command_sets_the_same_policy_the_api_would() -> None:
    words = shlex.split(delivery_limit.policy_command("orders"))
    assert words[:4] == ["rabbitmqctl", "set_policy", "-p", "orders"]
    wanted = delivery_limit.policy_definition()
    assert words[-3:] == [names.INBOX_LIMIT_POLICY, names.INBOX_QUEUE_PATTERN, json.dumps(wanted["definition"])]
    assert words[words.index("--apply-to") + 1] == wanted["apply-to"]
    assert int(words[words.index("--priority") + 1]) == wanted["priority"]


def test_classic_queues_are_told_they_have_no_limit() -> None:
    outcome = delivery_limit.ensure(_settings(queue_type="classic"))
    assert not outcome.held and "TXBOX_RECEIVER_REDELIVERY_LIMIT" in outcome.message
