"""TXBOX_AMQP_URL with the nodes of a cluster: parsed, validated, tried in a per-process order.

docs/explanation/operations.md, "A RabbitMQ cluster".
"""

from __future__ import annotations

import pytest

from framework import amqp
from framework.errors import ConfigurationError
from framework.settings import MAX_AMQP_URLS, Settings, amqp_urls

NODES = ",".join(f"amqp://u:secret@mq{n}:5672/%2F" for n in range(1, 4))
BASE = {"TXBOX_SERVICE": "a", "TXBOX_DATABASE_URL": "postgresql+psycopg://postgres@127.0.0.1/a"}


def test_one_url_or_several_separated_by_commas() -> None:
    assert amqp_urls("amqp://h/%2F") == ["amqp://h/%2F"]
    assert amqp_urls(" amqp://a/%2F , amqps://b/%2F,") == ["amqp://a/%2F", "amqps://b/%2F"]
    assert Settings.from_env({**BASE, "TXBOX_AMQP_URL": NODES}).amqp_url == NODES


@pytest.mark.parametrize(
    "value",
    [
        "amqp://u:secret@mq1/%2F,http://u:secret@mq2/",  # one entry is no AMQP URL
        " , ",  # nothing at all
        ",".join(["amqp://h/%2F"] * (MAX_AMQP_URLS + 1)),  # not a cluster: a pasting accident
    ],
)
def test_a_bad_list_fails_at_start_with_an_example_and_no_password(value: str) -> None:
    with pytest.raises(ConfigurationError) as err:
        Settings.from_env({**BASE, "TXBOX_AMQP_URL": value})
    assert "TXBOX_AMQP_URL" in str(err.value) and "Example:" in str(err.value)
    assert "secret" not in str(err.value)


def test_every_node_is_tried_in_an_order_drawn_once_per_process() -> None:
    first = [(p.host, p.client_properties) for p in amqp.parameters_list(NODES, name="x")]
    assert sorted(host for host, _ in first) == ["mq1", "mq2", "mq3"]
    assert all(props == {"connection_name": "x", "product": "txbox"} for _, props in first)
    for _ in range(5):  # the same order every time in this process: it keeps its node
        assert [p.host for p in amqp.parameters_list(NODES)] == [host for host, _ in first]


def test_orders_differ_between_processes() -> None:
    """Drawn per process, so the daemons of a deployment spread over the nodes."""
    orders = set()
    for _ in range(40):
        amqp._process_order.cache_clear()  # what a new process starts with
        orders.add(tuple(p.host for p in amqp.parameters_list(NODES)))
    assert len(orders) > 1


def test_the_login_user_comes_from_the_first_url() -> None:
    assert amqp.username(NODES) == "u"
