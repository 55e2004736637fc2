"""A private node that dies while it boots (txbox_tools.chaos.instances.PrivateRabbit): the error
carries the end of its log, because its folder is gone once the run closes it, and a
restart starts such a node once more, keeping the first failure for the run's report.
No broker is started: the node is a process that has already exited, or its start and
stop are replaced."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from txbox_tools.chaos.instances import NodeExited, PrivateRabbit
from txbox_tools.errors import InstanceError


def test_a_node_that_exits_while_starting_is_reported_with_the_end_of_its_log(tmp_path: Path) -> None:
    node = PrivateRabbit(base_dir=tmp_path, management=False)
    early = "".join(f"boot step {n}\n" for n in range(100))
    node.log_file.write_text(early + "ERROR: node with name txbox-chaos already running\n")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    node._proc = dead
    with pytest.raises(InstanceError, match="exited with 0 during start") as raised:
        node.wait_ready(timeout=5)
    text = str(raised.value)
    assert text.endswith("ERROR: node with name txbox-chaos already running")
    assert "boot step 99" in text and "boot step 10\n" not in text  # the end only


def _restartable(tmp_path: Path, failing_starts: int) -> PrivateRabbit:
    node = PrivateRabbit(base_dir=tmp_path, management=False)
    left = [failing_starts]

    def start(timeout: float = 90) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise NodeExited(f"RabbitMQ node {node.node} exited with 0 during start; the end of its log: boom")

    node.stop = lambda timeout=60: None  # type: ignore[method-assign]
    node.start = start  # type: ignore[method-assign]
    return node


def test_a_restarted_node_that_dies_while_booting_is_started_once_more_and_the_failure_kept(tmp_path: Path) -> None:
    node = _restartable(tmp_path, failing_starts=1)
    node.restart()
    assert node.restarts == 1
    assert len(node.boot_failures) == 1 and node.boot_failures[0].endswith("boom")


def test_a_node_that_dies_twice_while_booting_fails_the_restart(tmp_path: Path) -> None:
    node = _restartable(tmp_path, failing_starts=2)
    with pytest.raises(NodeExited):
        node.restart()
    assert node.restarts == 0
