"""The live view's wire message: what each worker's engine did in its last few steps.

Workers publish one ``LiveSteps`` message at most every ``interval`` seconds on ``LIVE_CHANNEL`` (Redis
pub/sub: nobody listening costs nothing, nothing is stored); the gateway relays them to browsers as
server-sent events. Compact on purpose: a step at 64 running requests is 64 short rows.

    {"v": 1, "worker": "w-1", "t": 1717000000.1, "dropped": 0,
     "running": 3, "waiting": 1, "kv_usage": 0.12,
     "steps": [{"n": 41, "ms": 18.2, "tokens": 66,
                "batch": [["chatcmpl-1a2b3c4d#0", 64, 0], ["cmpl-9f8e7d6c#0", 1, 12], ...]}, ...]}

A batch row is (short request id, tokens scheduled this step, tokens computed before it): more than
one scheduled token is a prefill chunk, one is a decode (a prompt chunk of exactly one token, which a
nearly spent budget can leave, shows as a decode). Ids are shortened to the id's first 8 hex digits:
the live view tells requests apart, it does not address them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.common.keys import PREFIX

LIVE_CHANNEL = f"{PREFIX}:live"
LIVE_VERSION = 1


@dataclass(frozen=True)
class LiveStep:
    n: int  # the engine's step number
    ms: float  # schedule + execute time
    tokens: int  # tokens computed in the step
    batch: list[tuple[str, int, int]]  # (short id, scheduled, computed before), in batch order


@dataclass(frozen=True)
class LiveSteps:
    worker: str
    t: float  # wall-clock time of publishing
    running: int  # after the newest step (0 when idle)
    waiting: int
    kv_usage: float  # fraction of KV blocks in use
    steps: list[LiveStep] = field(default_factory=list)
    dropped: int = 0  # steps since the previous message that did not fit in this one

    def encode(self) -> str:
        # vars(), not asdict(): asdict deep-copies every row of every step (thousands of tuples a message
        # at a full batch), and json writes the tuples as the same lists.
        body = {"v": LIVE_VERSION, **vars(self), "steps": [vars(s) for s in self.steps]}
        return json.dumps(body, separators=(",", ":"))

    @classmethod
    def decode(cls, raw: str | bytes) -> LiveSteps:
        data: dict[str, Any] = json.loads(raw)
        if data.pop("v", None) != LIVE_VERSION:
            raise ValueError(f"unknown live message version in {str(raw)[:80]!r}")
        steps = [
            LiveStep(int(s["n"]), float(s["ms"]), int(s["tokens"]), [tuple(r) for r in s["batch"]])  # type: ignore[misc]
            for s in data.pop("steps")
        ]
        return cls(steps=steps, **data)


def short_id(request_id: str) -> str:
    """'chatcmpl-1a2b3c4d5e...#0' -> 'chatcmpl-1a2b3c4d#0' (kind, first 8 hex digits, choice index)."""
    head, _, index = request_id.partition("#")
    kind, dash, rest = head.rpartition("-")
    short = f"{kind}{dash}{rest[:8]}" if dash else head[:16]
    return f"{short}#{index}" if index else short
