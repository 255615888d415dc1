"""Which offset each partition may commit: only past requests that are all terminal.

A partition's requests run concurrently and finish in any order, so the committable offset is the
lowest offset still in flight (Kafka's committed offset is "the next one to read"):

    offsets taken:  10  11  12  13
    done:            y   n   y   y      -> commit 11 (12 and 13 wait for 11)
    11 done:                            -> commit 14

After a rebalance the tracker starts over for the partitions now assigned: an offset from an earlier
assignment must never be committed, because the broker may have been restarted (a fresh log) or the
partition may now belong to another worker.
"""

from __future__ import annotations

from collections.abc import Iterable

from aiokafka.structs import TopicPartition


class OffsetTracker:
    def __init__(self) -> None:
        self._inflight: dict[TopicPartition, dict[int, bool]] = {}  # offset -> done, insertion-ordered
        self._position: dict[TopicPartition, int] = {}  # next offset to read, past the finished prefix
        self._committed: dict[TopicPartition, int] = {}
        self._keys: dict[TopicPartition, dict[int, bytes | None]] = {}  # message keys, while in flight
        self._last: dict[TopicPartition, tuple[int, bytes | None]] = {}  # the finished prefix's last
        self._generation = 0  # bumped on every reset; a stale handle cannot mark anything

    @property
    def generation(self) -> int:
        return self._generation

    def reset(self, assigned: Iterable[TopicPartition]) -> None:
        self._generation += 1
        self._inflight = {tp: {} for tp in assigned}
        self._position = {}
        self._committed = {}
        self._keys = {}
        self._last = {}

    def add(self, tp: TopicPartition, offset: int, key: bytes | None = None) -> int:
        """Track a consumed offset; returns the generation to pass back to ``done``."""
        self._inflight.setdefault(tp, {})[offset] = False
        self._keys.setdefault(tp, {})[offset] = key
        return self._generation

    def done(self, tp: TopicPartition, offset: int, generation: int) -> None:
        if generation != self._generation:
            return  # taken under an earlier assignment: leave it to the partition's new reader
        offsets = self._inflight.get(tp)
        if offsets is not None and offset in offsets:
            offsets[offset] = True

    def committable(self) -> dict[TopicPartition, int]:
        """Offsets to commit now: positions past a finished prefix, not yet acknowledged."""
        out: dict[TopicPartition, int] = {}
        for tp, offsets in self._inflight.items():
            for offset in sorted(offsets):
                if not offsets[offset]:
                    break
                self._position[tp] = offset + 1
                self._last[tp] = (offset, self._keys.get(tp, {}).pop(offset, None))
                del offsets[offset]  # the finished prefix is summed up by the position
            position = self._position.get(tp)
            if position is not None and position > self._committed.get(tp, -1):
                out[tp] = position
        return out

    def mark_committed(self, offsets: dict[TopicPartition, int]) -> None:
        """The broker acknowledged these; a failed commit is simply offered again next time."""
        for tp, position in offsets.items():
            if tp in self._inflight:
                self._committed[tp] = max(position, self._committed.get(tp, -1))

    def last_finished(self, tp: TopicPartition) -> tuple[int, bytes | None] | None:
        """Offset and key of the last message a commit of ``tp`` would pass."""
        return self._last.get(tp)

    def forget(self, partitions: Iterable[TopicPartition]) -> None:
        for tp in partitions:
            for table in (self._inflight, self._position, self._committed, self._keys, self._last):
                table.pop(tp, None)
