"""Reading server-sent events the way a client does, for tests that look at the raw stream."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx


def events(response: httpx.Response) -> Iterator[dict[str, Any] | str]:
    """Each ``data:`` payload: a dict, or the string "[DONE]". Comments (keep-alives) are skipped."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        payload = line[len("data: ") :]
        yield payload if payload == "[DONE]" else json.loads(payload)


def text_of(chunks: list[dict[str, Any] | str]) -> str:
    out = []
    for chunk in chunks:
        if isinstance(chunk, dict):
            for choice in chunk.get("choices", []):
                out.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
    return "".join(out)
