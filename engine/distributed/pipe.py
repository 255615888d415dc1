"""Length-prefixed pickled messages over a pipe: how rank 0 hands each step's plain-data input to the
other ranks. A pipe, not a collective, because an idle engine may wait for its next step forever,
while every collective has a timeout; and a pipe ends with its writer (EOF: the ranks exit)."""

from __future__ import annotations

import pickle
import struct
from typing import IO, Any

_HEADER = struct.Struct("<Q")


def write_message(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def read_message(stream: IO[bytes]) -> Any | None:
    """The next message; None at end of stream (the writer is gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)
