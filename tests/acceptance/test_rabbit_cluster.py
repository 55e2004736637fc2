"""A RabbitMQ cluster loses the node that leads the inbox queues mid-run: nothing is lost.

The example saga runs with every daemon given all three nodes' URLs (TXBOX_AMQP_URL as a
comma-separated list); `txbox chaos --rabbit-nodes 3` kills -9 the node leading the
inbox queues, brings it back, and judges the run from both services' databases
(docs/explanation/operations.md, "A RabbitMQ cluster"). `make test` runs 1,000 orders (about a
minute, most of it booting the three nodes); `make rabbit-cluster` 3,000
(``TXBOX_RABBIT_CLUSTER_ORDERS``). The fault, which fires at a share of the expected
progress, and the assertions are the same at any size. Timings are printed, never asserted.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from txbox_tools.processes import txbox_command

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SEED = int(os.environ.get("TXBOX_CHAOS_SEED", "3"))
ORDERS = int(os.environ.get("TXBOX_RABBIT_CLUSTER_ORDERS", "1000"))


@pytest.mark.timeout(720)
def test_losing_the_inbox_leader_node_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    args = [
        *txbox_command(),
        "chaos",
        "--rabbit-nodes",
        "3",
        "--messages",
        str(ORDERS),
        "--rate",
        "300",
        "--faults",
        "1",  # on a cluster the first fault is the loss of the inbox leader's node
        "--no-poison",
        "--no-analyze",
        "--seed",
        str(SEED),
        "--json",
        "--log-dir",
        str(tmp_path / "logs"),
    ]
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = proc.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        proc.terminate()  # SIGTERM: the run stops its daemons and private servers
        stdout, stderr = proc.communicate(timeout=60)
    sys.stdout.write(stdout[-4000:])
    output = f"{stdout[-6000:]}\n{stderr[-3000:]}"
    assert proc.returncode == 0, f"txbox chaos failed ({proc.returncode}):\n{output}"
    assert "kill -9 of txbox-chaos-" in stdout, output
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert figures["ok"] is True
    assert figures["rabbitmq_node_kills"] == 1
    assert figures["messages"] >= 3 * ORDERS  # PlaceOrder + OrderPlaced + stock result per order
    assert (figures["lost"], figures["duplicated"], figures["abandoned"]) == (0, 0, 0)
