"""A batch's input lines, read a few at a time.

A batch's progress runs every second for as long as the batch does, and each round submits a handful of
lines. Reading the whole input file for them (up to 200 MB) each round would make the round's cost grow
with the file, in Redis and on the gateway's event loop, where interactive requests wait behind it. At
creation, the gateway records where each request line starts in the file (``inflight:req:{batch}:index``,
a string of 8 hex digits a line: 400 KB for OpenAI's 50,000-line bound), and a round reads two short
ranges: the index's entries for its lines, then the file's bytes between them.

Lines are split at ``\\n`` (a ``\\r`` before it is JSON whitespace); blank lines are no requests and are
skipped, so line ``i`` of the batch is its ``i``-th non-blank line.
"""

from __future__ import annotations

from redis.asyncio import Redis

from services.common import keys
from services.gateway.files_routes import content_key

_WIDTH = 8  # hex digits an offset: files are bounded far below 4 GiB


def index_key(batch_id: str) -> str:
    return keys.record(batch_id) + ":index"


def line_starts(content: bytes) -> list[int]:
    """The byte offset of each non-blank line of ``content``."""
    starts, pos = [], 0
    for line in content.split(b"\n"):
        if line.strip():
            starts.append(pos)
        pos += len(line) + 1
    return starts


def encode_index(starts: list[int]) -> str:
    return "".join(f"{start:0{_WIDTH}x}" for start in starts)


async def read_lines(client: Redis, batch_id: str, file_id: str, start: int, stop: int) -> list[str]:
    """Request lines ``start`` to ``stop - 1`` of the batch's input file; "" for each one that is gone (the
    file was deleted, or expired)."""
    index = str(await client.getrange(index_key(batch_id), _WIDTH * start, _WIDTH * (stop + 1) - 1) or "")
    if not index:
        lines = await _whole_file(client, file_id)  # a batch from before the index: its file whole, as then
        return [*lines[start:stop], *[""] * (stop - min(stop, max(start, len(lines))))]
    bounds = [int(index[i : i + _WIDTH], 16) for i in range(0, len(index), _WIDTH)]
    # The start of line ``stop`` ends the range; the last line runs to the end of the file.
    end = bounds[stop - start] - 1 if len(bounds) > stop - start else -1
    text = str(await client.getrange(content_key(file_id), bounds[0], end) or "")
    lines = [line for line in text.split("\n") if line.strip()][: stop - start]
    return lines + [""] * (stop - start - len(lines))


async def _whole_file(client: Redis, file_id: str) -> list[str]:
    content = await client.get(content_key(file_id))
    return [] if content is None else [line for line in str(content).split("\n") if line.strip()]
