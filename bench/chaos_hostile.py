"""The soak's hostile crowd (bench/chaos.py): clients that try to make a gateway hold what it should not,
on a gateway of their own with an API key set, sharing the soak's broker, Redis and workers.

- random paths, with and without the key: each must cost no metric series (route templates only);
- unauthenticated bodies of 1 MiB: answered 401 from the headers (the body is never read);
- vanishing streams: a whole streaming request sent on a raw socket that closes at once; the request
  must be cancelled and everything it held (subscription, buffer, KV blocks) freed.

After the soak the leaks are counted: new metric series, Redis keys without a TTL, event subscriptions
still open, requests still running (the soak's KV check), and the gateway's RSS before and after.

``python -m bench.chaos_hostile --count 10000`` runs the crowd alone, as fast as it goes, on a stack of
one worker and the crowd's gateway, and prints what the gateway and Redis hold before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import socket
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx

from bench.chaos_slow import rss_mib
from harness.stack import ServiceProcess, Stack, build_stack, launch
from services.common import keys

KEY = "chaos-hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
UNAUTHENTICATED_BODY_BYTES = 1024 * 1024
SERIES = re.compile(r"^inflight:gateway_responses_total\{", re.MULTILINE)
KINDS = ("random_path", "random_path_keyed", "unauthenticated_body", "vanishing_stream")


@dataclass
class HostileSummary:
    sent: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    refused: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))  # 401 / 404 as due
    series_before: int = 0
    series_after: int = 0
    keys_without_ttl: list[str] = field(default_factory=list)
    subscriptions_left: int = -1
    subscribers_left: list[str] = field(default_factory=list)  # who holds them: Redis client, channel count
    rss_mib: dict[str, float | None] = field(default_factory=dict)  # the crowd's gateway: before, after
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        answered = all(self.refused[k] == self.sent[k] for k in KINDS if k != "vanishing_stream")
        # A handful of new series at most: each route template x status once, never one per path.
        return (
            answered
            and self.series_after - self.series_before <= 8
            and not self.keys_without_ttl
            and self.subscriptions_left == 0
        )


def start_gateway(stack: Stack) -> ServiceProcess:
    """The crowd's gateway: keys set, not in ``stack.gateways`` (the soak's clients send no key)."""
    gateway = launch("gateway", {**stack.env, "INFLIGHT_API_KEYS": KEY}, stack.log_dir)
    gateway.wait_ready()
    return gateway


def num_series(url: str) -> int:
    return len(SERIES.findall(httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text))


def run_crowd(
    url: str, model: str, rng: random.Random, count: int, duration_s: float, summary: HostileSummary
) -> None:
    """``count`` hostile clients spread over ``duration_s``, one at a time."""
    start = time.monotonic()
    for i in range(count):
        time.sleep(max(0.0, start + duration_s * i / max(1, count) - time.monotonic()))
        kind = KINDS[i % len(KINDS)]
        summary.sent[kind] += 1
        try:
            if _one(url, model, rng, kind):
                summary.refused[kind] += 1
            elif kind != "vanishing_stream":
                summary.problems.append(f"{kind} was not refused")
        except (httpx.HTTPError, OSError) as exc:
            summary.problems.append(f"{kind}: {exc!r}")


def _one(url: str, model: str, rng: random.Random, kind: str) -> bool:
    """One hostile client; True when the gateway refused it as it should."""
    if kind in ("random_path", "random_path_keyed"):
        path = "/v1/" + "/".join(
            uuid.UUID(int=rng.getrandbits(128)).hex[:8] for _ in range(rng.randint(1, 3))
        )
        keyed = kind == "random_path_keyed"
        resp = httpx.get(f"{url}{path}", headers=AUTH if keyed else {}, timeout=10)
        return resp.status_code == (404 if keyed else 401)
    if kind == "unauthenticated_body":
        status = _raw(url, "/v1/chat/completions", b"x" * UNAUTHENTICATED_BODY_BYTES, key=None, read=True)
        return status in (401, None)  # None: the gateway answered and closed before taking it all
    body = {"model": model, "prompt": "vanishing", "max_tokens": 64, "ignore_eos": True, "stream": True}
    _raw(url, "/v1/completions", json.dumps(body).encode(), key=KEY, read=False)
    return True


def _raw(url: str, path: str, body: bytes, key: str | None, read: bool) -> int | None:
    """A POST on a raw socket; ``read``: the response's status (None when the server closed first),
    else the socket closes right after the request is sent."""
    parts = urlsplit(url)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n" + (f"Authorization: Bearer {key}\r\n" if key else "") + "\r\n"
    )
    with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 80), timeout=10) as sock:
        with contextlib.suppress(OSError):  # refused before the whole body went out: what the guard is for
            sock.sendall(head.encode() + body)
        if not read:
            return None
        try:
            line = sock.makefile("rb").readline()
        except OSError:
            return None
    match = re.match(rb"HTTP/1\.[01] (\d{3})", line)
    return int(match.group(1)) if match else None


def leaks(stack: Stack, gateway: ServiceProcess, summary: HostileSummary, timeout_s: float = 30.0) -> None:
    """What is left once the soak is quiet: series, keys without a TTL, open event subscriptions."""
    redis = stack.redis_client()
    deadline = time.monotonic() + timeout_s
    while True:
        summary.subscriptions_left = len(redis.pubsub_channels(f"{keys.PREFIX}:events:*"))
        if summary.subscriptions_left == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if summary.subscriptions_left:
        # Which connections hold them (a gateway's hub, by its address and age), for the report.
        summary.subscribers_left = [
            f"{c.get('addr')} name={c.get('name') or '-'} age={c.get('age')}s sub={c.get('sub')}"
            for c in redis.client_list(_type="pubsub")
            if int(c.get("sub", 0)) > 0
        ]
    summary.keys_without_ttl = _keys_without_ttl(stack)[:20]
    summary.series_after = num_series(gateway.url)
    summary.rss_mib["after"] = rss_mib(gateway.proc.pid)


def _keys_without_ttl(stack: Stack) -> list[str]:
    """Keys with no TTL that still have none a second later (a key is written, then given its TTL, in
    one transaction or script: a second is far past any such window)."""
    redis = stack.redis_client()
    found = [str(n) for n in redis.scan_iter(count=1000) if redis.pttl(n) == -1]
    if found:
        time.sleep(1.0)
        found = [n for n in found if redis.pttl(n) == -1]
    return found


def snapshot(stack: Stack, gateway: ServiceProcess) -> dict[str, float]:
    """What is held right now: the crowd gateway's metric series and RSS, Redis keys without a TTL,
    open event subscriptions, and the requests the live workers hold (traffic may still be running:
    the last two are figures, the first three must not grow)."""
    running = 0
    for worker in stack.workers:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            running += len(httpx.get(f"{worker.url}/stats", timeout=5).json()["requests"])
    return {
        "series": num_series(gateway.url),
        "keys_without_ttl": len(_keys_without_ttl(stack)),
        "subscriptions": len(stack.redis_client().pubsub_channels(f"{keys.PREFIX}:events:*")),
        "running": running,
        "gateway_rss_mib": rss_mib(gateway.proc.pid) or -1.0,
    }


class Crowd:
    """The crowd on a thread of its own for the soak's fault phase."""

    def __init__(self, stack: Stack, model: str, seed: int, count: int, duration_s: float) -> None:
        self.gateway = start_gateway(stack)
        self.summary = HostileSummary()
        self.summary.series_before = num_series(self.gateway.url)
        self.summary.rss_mib["before"] = rss_mib(self.gateway.proc.pid)
        rng = random.Random(seed + 3)
        self._thread = threading.Thread(
            target=run_crowd, args=(self.gateway.url, model, rng, count, duration_s, self.summary)
        )

    def start(self) -> None:
        self._thread.start()

    def finish(self, stack: Stack) -> HostileSummary:
        self._thread.join()
        leaks(stack, self.gateway, self.summary)
        return self.summary

    def close(self) -> None:
        self.gateway.stop()


def _redis_used_mib(stack: Stack) -> float:
    return round(int(stack.redis_client().info("memory")["used_memory"]) / 2**20, 2)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.chaos_hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--count", type=int, default=10_000)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--out", default="", help="write the figures as JSON here")
    args = p.parse_args(argv)
    from engine.models.tiny import default_model_path

    log_dir = Path(tempfile.mkdtemp(prefix="inflight-hostile-"))
    env = {"INFLIGHT_SERVED_MODEL_NAME": "tiny", "INFLIGHT_TORCH_THREADS": "1"}
    stack = build_stack(default_model_path(), log_dir, workers=1, gateways=0, tag="hostile", env=env)
    crowd: Crowd | None = None
    try:
        crowd = Crowd(stack, "tiny", args.seed, args.count, 0.0)
        redis_before = _redis_used_mib(stack)
        began = time.monotonic()
        crowd.start()
        summary = crowd.finish(stack)
        figures = {
            "requests": args.count,
            "wall_s": round(time.monotonic() - began, 1),
            "sent": summary.sent,
            "refused": summary.refused,
            "new_metric_series": summary.series_after - summary.series_before,
            "keys_without_ttl": summary.keys_without_ttl,
            "subscriptions_left": summary.subscriptions_left,
            "subscribers_left": summary.subscribers_left,
            "gateway_rss_mib": summary.rss_mib,
            "redis_used_mib": {"before": redis_before, "after": _redis_used_mib(stack)},
            "problems": summary.problems[:20],
            "ok": summary.ok,
        }
    finally:
        if crowd is not None:
            crowd.close()
        stack.close()
    print(json.dumps(figures, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(figures, indent=2))
    return 0 if figures["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
