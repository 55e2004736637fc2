"""A private node's cluster join (txbox_tools.chaos.instances.PrivateRabbit.join): a join whose
``start_app`` fails is tried once more from a reset node, and a second failure is reported.
rabbitmqctl is replaced by a recorder: what is checked is the order of the commands."""

from __future__ import annotations

from pathlib import Path

import pytest

from txbox_tools.chaos.instances import PrivateRabbit
from txbox_tools.errors import InstanceError


def _node(tmp_path: Path, failing_starts: int) -> tuple[PrivateRabbit, list[str]]:
    node = PrivateRabbit(base_dir=tmp_path, management=False)
    calls: list[str] = []
    left = [failing_starts]

    def ctl(*args: str, timeout: float = 120) -> str:
        calls.append(" ".join(args))
        if args[0] == "start_app" and left[0] > 0:
            left[0] -= 1
            raise InstanceError("rabbitmqctl start_app failed: {:rabbit, {{:badmatch, ...}}}")
        return ""

    node.ctl = ctl  # type: ignore[method-assign]
    node.wait_ready = lambda timeout=90: None  # type: ignore[method-assign]
    return node, calls


def test_a_join_whose_start_fails_is_tried_again_from_a_reset_node(tmp_path: Path) -> None:
    node, calls = _node(tmp_path, failing_starts=1)
    node.join("seed@localhost")
    join = ["stop_app", "join_cluster seed@localhost", "start_app"]
    assert calls == [*join, "stop_app", "reset", *join]


def test_a_join_that_fails_twice_is_reported(tmp_path: Path) -> None:
    node, calls = _node(tmp_path, failing_starts=2)
    with pytest.raises(InstanceError, match="start_app"):
        node.join("seed@localhost")
    assert calls.count("reset") == 1
