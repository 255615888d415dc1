"""A batch's progress reads only what a round needs, against a real Redis: its input lines through the
line index (services/gateway/batch_lines.py) and its counts from the lines still in flight (``tally``)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from harness.servers import ServerProcess, start_redis
from services.common import keys
from services.common.wire import COMPLETED
from services.gateway.batch_lines import encode_index, index_key, line_starts, read_lines
from services.gateway.batches import lines_key, tally
from services.gateway.files_routes import content_key

pytestmark = pytest.mark.timeout(60)

# Blank lines, a CRLF ending, multi-byte characters and no newline at the end.
CONTENT = '\n{"a": "é"}\r\n\n  \n{"b": "日本"}\n{"c": 3}\n\n{"d": "last"}'
LINES = ['{"a": "é"}\r', '{"b": "日本"}', '{"c": 3}', '{"d": "last"}']


@pytest.fixture(scope="module")
def own_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with start_redis(workdir=tmp_path_factory.mktemp("batch-lines-redis")) as server:
        yield server


@pytest.fixture
async def client(own_redis: ServerProcess) -> AsyncIterator[aioredis.Redis]:
    redis = aioredis.Redis.from_url(own_redis.url, decode_responses=True)
    await redis.flushall()
    yield redis
    await redis.aclose()


def test_line_starts_are_byte_offsets_of_the_non_blank_lines() -> None:
    data = CONTENT.encode()
    starts = line_starts(data)
    assert len(starts) == len(LINES)
    assert [data[s:].split(b"\n")[0].decode() for s in starts] == LINES


async def test_any_range_of_lines_reads_as_the_whole_file_split(client: aioredis.Redis) -> None:
    await client.set(content_key("file-1"), CONTENT.encode())
    await client.set(index_key("batch_1"), encode_index(line_starts(CONTENT.encode())))
    for start in range(len(LINES)):
        for stop in range(start + 1, len(LINES) + 1):
            assert await read_lines(client, "batch_1", "file-1", start, stop) == LINES[start:stop]


async def test_a_batch_without_an_index_reads_its_file_whole(client: aioredis.Redis) -> None:
    await client.set(content_key("file-1"), CONTENT.encode())
    assert await read_lines(client, "batch_old", "file-1", 1, 3) == LINES[1:3]


async def test_a_deleted_file_reads_as_empty_lines(client: aioredis.Redis) -> None:
    await client.set(index_key("batch_1"), encode_index(line_starts(CONTENT.encode())))
    assert await read_lines(client, "batch_1", "file-gone", 0, 2) == ["", ""]
    assert await read_lines(client, "batch_old", "file-gone", 0, 2) == ["", ""]


async def test_counts_move_past_the_lines_that_have_all_ended(client: aioredis.Redis) -> None:
    """Lines 0-5: completed, refused (no job), failed, running, completed, queued."""
    statuses = [COMPLETED, None, "failed", "running", COMPLETED, "queued"]
    for i, status in enumerate(statuses):
        entry = {"custom_id": f"c{i}", "job": f"job-{i}"} if status else {"custom_id": None, "error": "x"}
        await client.rpush(lines_key("batch_1"), json.dumps(entry))
        if status:
            await client.hset(keys.record(f"job-{i}"), "status", status)
    record = {"id": "batch_1", "total": "8"}
    first = await tally(client, record)
    assert first.counts == {"total": 8, "completed": 2, "failed": 2}
    assert (first.ended_below, first.ended_completed, first.ended_failed) == (3, 1, 2)
    assert not first.all_ended
    # The record keeps what lies below line 3; line 0's status is not read again (changing it shows).
    record |= {"ended_below": "3", "ended_completed": "1", "ended_failed": "2"}
    await client.hset(keys.record("job-0"), "status", "failed")
    await client.hset(keys.record("job-3"), "status", COMPLETED)
    await client.hset(keys.record("job-5"), "status", "cancelled")
    second = await tally(client, record)
    assert second.counts == {"total": 8, "completed": 3, "failed": 3}
    assert (second.ended_below, second.ended_completed, second.ended_failed) == (6, 3, 3)
    assert second.all_ended
