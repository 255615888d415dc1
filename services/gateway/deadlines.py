"""How long a request may wait for an engine: ``X-Request-Timeout``, capped by the server's bound.

A client says how long it will wait with ``X-Request-Timeout: <seconds>`` (a positive number; the
official OpenAI client sends no such header unless told to: ``extra_headers``). A request that no
engine has started by then is not run: the worker that takes it from Kafka fails it with code
``timeout`` instead of prefilling it for a client that has given up, and the gateway fails it while it
waits in Kafka. Synchronous requests get ``INFLIGHT_MAX_QUEUE_WAIT_S`` without the header, and at most
that with it; a job has no deadline but its record's lifetime unless its creator sends the header.
"""

from __future__ import annotations

import math

from fastapi import Request

from services.gateway.errors import APIError

TIMEOUT_HEADER = "X-Request-Timeout"


def start_within(request: Request, bound_s: float | None) -> float | None:
    """Seconds from now by which an engine must start this request (None: no deadline)."""
    raw = request.headers.get(TIMEOUT_HEADER)
    if raw is None:
        return bound_s
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds > 0 and math.isfinite(seconds)):
        message = f"{TIMEOUT_HEADER} must be a positive number of seconds, got {raw[:40]!r}"
        raise APIError(400, message, code="invalid_value", param=TIMEOUT_HEADER)
    return seconds if bound_s is None else min(seconds, bound_s)
