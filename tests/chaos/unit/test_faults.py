"""The chaos schedule is a pure function of the seed: replayable, and covering every fault kind."""

from __future__ import annotations

from collections import Counter

import pytest

from txbox_tools.chaos.faults import DAEMON_KINDS, Kind, in_one_process, plan


def test_same_seed_same_schedule_other_seed_other_schedule() -> None:
    assert plan(5, 16) == plan(5, 16)
    assert plan(5, 16) != plan(6, 16)


def test_a_long_run_covers_every_kind_with_at_least_ten_kills() -> None:
    schedule = plan(1, 16)
    kinds = Counter(f.kind for f in schedule)
    assert kinds[Kind.KILL] >= 10
    for kind in (Kind.RABBITMQ_RESTART, Kind.POSTGRES_RESTART, Kind.PG_TERMINATE, Kind.AMQP_CLOSE, Kind.POISON):
        assert kinds[kind] == 1, kind
    killed = {f.target.split("-", 1)[1] for f in schedule if f.kind is Kind.KILL}
    assert killed == set(DAEMON_KINDS)


def test_a_short_run_still_crashes_a_daemon_and_restarts_both_servers() -> None:
    kinds = Counter(f.kind for f in plan(3, 4))
    assert kinds == {Kind.KILL: 2, Kind.RABBITMQ_RESTART: 1, Kind.POSTGRES_RESTART: 1, Kind.POISON: 1}


def test_faults_fire_in_progress_order_inside_the_load() -> None:
    schedule = plan(9, 20, first=0.1, last=0.6)
    points = [f.at_progress for f in schedule]
    assert points == sorted(points)
    assert all(0.1 <= p <= 0.6 for p in points)


def test_no_poison_when_asked() -> None:
    assert all(f.kind is not Kind.POISON for f in plan(2, 8, poison=False))


def test_on_a_cluster_the_loss_of_a_node_comes_first_and_only_there() -> None:
    (only,) = plan(4, 1, poison=False, cluster=True)
    assert only.kind is Kind.RABBITMQ_NODE_KILL and only.down_seconds >= 3.0
    assert Kind.RABBITMQ_NODE_KILL in {f.kind for f in plan(4, 8, cluster=True)}
    assert all(f.kind is not Kind.RABBITMQ_NODE_KILL for seed in range(20) for f in plan(seed, 30))


def test_with_replicas_kills_pick_among_them_and_one_replica_keeps_the_old_schedule() -> None:
    targets = {f.target for f in plan(4, 40, replicas=2) if f.kind is Kind.KILL}
    assert any(t.endswith("-2") for t in targets) and any(not t.endswith("-2") for t in targets)
    assert plan(4, 40, replicas=1) == plan(4, 40)


def test_a_node_lost_for_good_ends_the_schedule_and_leaves_the_rest_as_it_was() -> None:
    before = plan(4, 8, cluster=True)
    after = plan(4, 8, cluster=True, lose_node=True)
    assert after[:-1] == before
    assert after[-1].kind is Kind.RABBITMQ_NODE_LOST
    assert after[-1].at_progress >= max(f.at_progress for f in before)


def test_a_node_lost_for_good_needs_a_cluster() -> None:
    with pytest.raises(ValueError, match="cluster"):
        plan(4, 1, lose_node=True)


def test_in_one_process_a_kill_of_any_daemon_kills_its_services_run_process() -> None:
    schedule = plan(4, 40, replicas=2)
    moved = in_one_process(schedule)
    kills = [(a, b) for a, b in zip(schedule, moved, strict=True) if a.kind is Kind.KILL]
    processes = {"orders-run", "inventory-run", "orders-run-2", "inventory-run-2"}
    assert kills and all(b.target in processes for _, b in kills)
    assert all(a.target.split("-")[0] == b.target.split("-")[0] for a, b in kills)  # the same service
    assert all(a.target.endswith("-2") == b.target.endswith("-2") for a, b in kills)  # the same replica
    assert [(f.kind, f.at_progress, f.down_seconds) for f in moved] == [
        (f.kind, f.at_progress, f.down_seconds) for f in schedule
    ]
