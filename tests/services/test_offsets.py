"""The offset tracker commits only past requests that are all terminal, and forgets old assignments."""

from __future__ import annotations

from aiokafka.structs import TopicPartition

from services.worker.offsets import OffsetTracker

P0, P1 = TopicPartition("t", 0), TopicPartition("t", 1)


def test_commits_only_a_finished_prefix() -> None:
    t = OffsetTracker()
    t.reset([P0, P1])
    gens = [t.add(P0, o) for o in (10, 11, 12, 13)]
    assert t.committable() == {}
    t.done(P0, 10, gens[0])
    t.done(P0, 12, gens[2])
    t.done(P0, 13, gens[3])
    assert t.committable() == {P0: 11}  # 11 still runs: 12 and 13 wait for it
    t.mark_committed({P0: 11})
    assert t.committable() == {}
    t.done(P0, 11, gens[1])
    assert t.committable() == {P0: 14}
    t.mark_committed({P0: 14})
    assert t.committable() == {}  # nothing left in flight, nothing new to commit


def test_failed_commit_is_offered_again() -> None:
    t = OffsetTracker()
    t.reset([P0])
    t.done(P0, 5, t.add(P0, 5))
    assert t.committable() == {P0: 6}
    assert t.committable() == {P0: 6}  # not acknowledged: offered again
    t.mark_committed({P0: 6})
    assert t.committable() == {}


def test_new_assignment_forgets_old_offsets() -> None:
    t = OffsetTracker()
    t.reset([P0])
    old = t.add(P0, 57)
    t.reset([P0])  # a rebalance, or a broker that restarted with an empty log
    t.done(P0, 57, old)  # finishing under the old assignment commits nothing
    assert t.committable() == {}
    new = t.add(P0, 0)
    t.done(P0, 0, new)
    assert t.committable() == {P0: 1}


def test_revoked_partitions_are_dropped() -> None:
    t = OffsetTracker()
    t.reset([P0, P1])
    g = t.add(P1, 3)
    t.forget([P1])
    t.done(P1, 3, g)
    assert t.committable() == {}
