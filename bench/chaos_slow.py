"""The soak's slow readers, and the gateways' memory while they read (see bench/chaos.py).

Each slow reader streams a completion through a small socket receive buffer and reads one event at a
time with a pause after each, so the gateway's sends back up instead of vanishing into loopback's
buffers. A few stop reading for a long while after their first event (a client that went away without
closing). Every reader must end one of two ways: the whole text of an undisturbed run, or the
gateway's ``slow_reader`` error once more than its stream buffer waited for it. A broken connection
(its gateway killed) or another error event counts as a failure the client saw; no end at all is lost.

The gateways' resident memory is sampled from /proc before, during and after: it must stay bounded
however far behind the readers fall. On Linux the kernel absorbs a good part of a slow reader's backlog
first: it grows a connection's send buffer up to net.ipv4.tcp_wmem's maximum (4 MiB by default), and
the gateway holds events itself (up to INFLIGHT_STREAM_BUFFER_BYTES) only once that is full. A stream of
the tiny model (2048 positions) fits in it whole, so on loopback these readers complete: the cut-off is
for streams longer than that, or send buffers smaller.
"""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

# Small, so the server's sends back up after a few events (Linux doubles it and keeps a floor).
RECEIVE_BUFFER_BYTES = 4096
PROMPTS = ("slow reader one", "slow reader two", "slow reader three", "slow reader four")


@dataclass
class SlowSpec:
    index: int
    body: dict[str, Any]
    at_s: float  # when to start, from the start of the fault phase
    pause_s: float  # after every event
    stall_s: float  # after the first event (0: none)


@dataclass
class SlowResult:
    spec: SlowSpec
    outcome: str = "lost"  # completed | cut_off | failed | lost
    text: str | None = None
    detail: str = ""


def slow_bodies(model: str) -> list[dict[str, Any]]:
    """The few distinct requests slow readers send (greedy: one undisturbed text each)."""
    short = [
        {"model": model, "prompt": p, "max_tokens": 48, "temperature": 0.0, "ignore_eos": True}
        for p in PROMPTS
    ]
    # Long enough that a reader who stops has more than every buffer between it and the gateway's
    # bound waiting for it: loopback's socket buffers, uvicorn's write buffer, the stream buffer.
    long = {
        "model": model,
        "prompt": "slow reader who stops",
        "max_tokens": 1500,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    return [*short, long]


def make_slow_specs(seed: int, num: int, duration_s: float, model: str) -> list[SlowSpec]:
    """``num`` readers starting over the first half of the run; one in ten (from twenty readers on) stops
    reading for a while."""
    rng = random.Random(seed + 7)
    bodies = slow_bodies(model)
    specs = []
    for i in range(num):
        stops = num >= 20 and i % 10 == 9
        body = bodies[-1] if stops else bodies[i % (len(bodies) - 1)]
        specs.append(
            SlowSpec(i, body, rng.uniform(0, duration_s / 2), rng.uniform(0.05, 0.3), 25.0 if stops else 0.0)
        )
    return specs


def read_slowly(spec: SlowSpec, url: str, deadline_s: float) -> SlowResult:
    result = SlowResult(spec)
    transport = httpx.HTTPTransport(
        socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER_BYTES)]
    )
    parts: list[str] = []
    try:
        with (
            httpx.Client(
                base_url=url, transport=transport, timeout=httpx.Timeout(deadline_s, connect=5.0)
            ) as http,
            http.stream("POST", "/v1/completions", json={**spec.body, "stream": True}) as resp,
        ):
            if resp.status_code != 200:
                resp.read()
                result.outcome, result.detail = "failed", f"{resp.status_code} {resp.text[:200]}"
                return result
            num_events = 0
            # The read timeout alone never fires on a stream kept alive by comments: bound the whole.
            give_up = time.monotonic() + deadline_s
            for line in resp.iter_lines():
                if time.monotonic() > give_up:
                    result.outcome = "lost"
                    result.detail = f"the stream was still open after {deadline_s:.0f}s"
                    return result
                if line == "data: [DONE]":
                    result.outcome, result.text = "completed", "".join(parts)
                    return result
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    result.outcome = "cut_off" if error.get("code") == "slow_reader" else "failed"
                    result.detail = str(error)[:200]
                    return result
                parts.extend(c.get("text") or "" for c in event["choices"])
                num_events += 1
                if spec.stall_s:  # gone for a while after the first event, then back to read the rest
                    time.sleep(spec.stall_s if num_events == 1 else 0.0)
                else:
                    time.sleep(spec.pause_s)
        result.outcome, result.detail = "lost", "the stream ended without [DONE] or an error event"
    except httpx.TimeoutException as exc:
        result.outcome, result.detail = "lost", f"no answer in time: {exc!r}"
    except httpx.HTTPError as exc:
        result.outcome, result.detail = "failed", repr(exc)  # a broken connection: the client saw it
    return result


def rss_mib(pid: int) -> float | None:
    """A process's resident memory (VmRSS), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


class RssSampler(threading.Thread):
    """The peak VmRSS of each pid, sampled every ``interval_s`` until stopped."""

    def __init__(self, pids: list[int], interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.pids, self.interval_s = pids, interval_s
        self.peak: dict[int, float] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            for pid in self.pids:
                rss = rss_mib(pid)
                if rss is not None:
                    self.peak[pid] = max(self.peak.get(pid, 0.0), rss)
            self._halt.wait(self.interval_s)

    def stop(self) -> None:
        self._halt.set()
        self.join()
