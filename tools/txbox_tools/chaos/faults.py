"""The fault schedule of a chaos run: which faults, against what, and when — all from one seed.

A run is only worth something if a failure can be replayed, so every random choice
(kinds, targets, moments, restart delays) comes from ``random.Random(seed)``; the
same seed and the same ``--faults`` give the same schedule.

Moments are points of *progress* (share of the expected messages handled), not
seconds: on a noisy shared machine a seconds-based schedule would fire its faults
after the work was done on a slow day and before it began on a fast one, while a
progress point always lands in the middle of the load.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum


class Kind(StrEnum):
    KILL = "kill"  # kill -9 of one daemon process, restarted by the supervisor
    RABBITMQ_RESTART = "rabbitmq_restart"  # the broker node stops and starts again
    POSTGRES_RESTART = "postgres_restart"  # immediate shutdown (crash) + WAL recovery
    PG_TERMINATE = "pg_terminate"  # pg_terminate_backend on every client connection
    AMQP_CLOSE = "amqp_close"  # management API closes every client connection
    POISON = "poison"  # a message whose handler kills its own process
    #: kill -9 of the cluster node leading the inbox queues, started again later
    #: (a run on a RabbitMQ cluster only: ``--rabbit-nodes 3``)
    RABBITMQ_NODE_KILL = "rabbitmq_node_kill"
    #: kill -9 of the cluster node leading the inbox queues, never started again; the last
    #: fault of a run (``--rabbit-nodes 3 --lose-node``): no node fault can follow it
    RABBITMQ_NODE_LOST = "rabbitmq_node_lost"


DAEMON_KINDS = ("publisher", "receiver", "worker")
SERVICES = ("orders", "inventory")

#: Kinds in the order a short run takes them: the first ``--faults`` of this list run,
#: so even four faults hit a daemon crash, both server restarts and a second crash.
PRIORITY: tuple[tuple[Kind, str], ...] = (
    (Kind.KILL, "worker"),
    (Kind.RABBITMQ_RESTART, ""),
    (Kind.POSTGRES_RESTART, ""),
    (Kind.KILL, "receiver"),
    (Kind.KILL, "publisher"),
    (Kind.PG_TERMINATE, ""),
    (Kind.AMQP_CLOSE, ""),
)
#: On a RabbitMQ cluster the loss of a node comes first: ``--faults 1`` is just that.
CLUSTER_PRIORITY: tuple[tuple[Kind, str], ...] = ((Kind.RABBITMQ_NODE_KILL, ""), *PRIORITY)


@dataclass(frozen=True)
class Fault:
    kind: Kind
    #: ``orders-worker`` for a kill, empty for server-wide faults.
    target: str
    #: Share of the expected messages handled when the fault fires (0..1).
    at_progress: float
    #: For kills: seconds the crashed daemon (or RabbitMQ node) stays down before it is restarted.
    down_seconds: float = 0.0

    def __str__(self) -> str:
        what = f"{self.kind} {self.target}".strip()
        return f"{what} @ {self.at_progress:.0%}"


def plan(
    seed: int,
    faults: int,
    *,
    poison: bool = True,
    daemons: tuple[str, ...] = DAEMON_KINDS,
    first: float = 0.05,
    last: float = 0.75,
    cluster: bool = False,
    replicas: int = 1,
    lose_node: bool = False,
) -> list[Fault]:
    """The schedule: ``faults`` faults (plus the poison message) sorted by progress point.

    The first seven (eight on a RabbitMQ ``cluster``) follow :data:`PRIORITY`
    (:data:`CLUSTER_PRIORITY`); every further one is a ``kill -9``, cycling
    through the daemon kinds so that each kind is killed about equally often. Targets
    (which service's daemon and, with ``replicas`` > 1, which replica of it:
    :func:`replica_name`) and moments are drawn from the seed. ``lose_node`` (a cluster
    only) adds the loss of a node for good at ``last``, after every other fault, and
    draws nothing from the seed: the rest of the schedule is the same without it.
    """
    if faults < 0:
        raise ValueError("faults must be >= 0")
    rng = random.Random(seed)
    chosen: list[tuple[Kind, str]] = list((CLUSTER_PRIORITY if cluster else PRIORITY)[:faults])
    extra = faults - len(chosen)
    cycle = [d for d in daemons]
    rng.shuffle(cycle)
    for i in range(extra):
        chosen.append((Kind.KILL, cycle[i % len(cycle)]))
    if poison:
        chosen.append((Kind.POISON, "orders-worker"))
    moments = sorted(rng.uniform(first, last) for _ in chosen)
    rng.shuffle(chosen)
    out: list[Fault] = []
    for (kind, target), moment in zip(chosen, moments, strict=True):
        if kind is Kind.KILL:
            target = f"{rng.choice(SERVICES)}-{target}"
            if replicas > 1:  # drawn only then: the schedules of earlier seeds stay as they were
                target = replica_name(target, rng.randint(1, replicas))
            out.append(Fault(kind, target, round(moment, 4), down_seconds=round(rng.uniform(0.0, 1.5), 2)))
        elif kind is Kind.RABBITMQ_NODE_KILL:
            # Down long enough for the daemons on the other nodes to carry the load alone.
            out.append(Fault(kind, target, round(moment, 4), down_seconds=round(rng.uniform(3.0, 8.0), 2)))
        else:
            out.append(Fault(kind, target, round(moment, 4)))
    if lose_node:
        if not cluster:
            raise ValueError("losing a node for good needs a RabbitMQ cluster")
        out.append(Fault(Kind.RABBITMQ_NODE_LOST, "", round(max([last, *(f.at_progress for f in out)]), 4)))
    return out


def in_one_process(schedule: list[Fault]) -> list[Fault]:
    """``schedule`` for services that each run as one `txbox run` process (``orders-run``):
    a kill of one of a service's daemons kills that process, with all its daemons. The
    rest is unchanged, so a seed's moments and restart delays stay those of its run with
    one process per daemon."""
    out = []
    for fault in schedule:
        if fault.kind is Kind.KILL:
            service, daemon = fault.target.split("-", 1)  # orders-worker, orders-worker-2
            _, _, replica = daemon.partition("-")
            target = replica_name(f"{service}-run", int(replica) if replica else 1)
            fault = Fault(fault.kind, target, fault.at_progress, fault.down_seconds)
        out.append(fault)
    return out


def replica_name(daemon: str, n: int) -> str:
    """The supervisor's name of replica ``n`` (from 1) of ``orders-worker``: the first has no suffix."""
    return daemon if n == 1 else f"{daemon}-{n}"


def describe(schedule: list[Fault]) -> str:
    return ", ".join(map(str, schedule))
