"""How long a request waits after its worker is SIGKILLed, until the surviving worker streams it again.

Two workers and a gateway on a loopback broker (tansu) and Redis. Each trial streams one long request
whose engine steps are paced (``INFLIGHT_FAULT_STEP_DELAY_S``, so it is certainly still running at the
kill on any host), waits until its owner has published a few tokens, SIGKILLs that owner (the request's
partition is the dead worker's), and times two moments from the kill:

- ``wire_s``: the first token event the survivor publishes (read from the request's Redis channel);
- ``client_s``: the first SSE chunk the client receives after that event.

The client then hangs up (the request is cancelled), a replacement worker starts, and the next trial
waits until the group has settled (every partition assigned to a live worker). Prints each trial and
min / median / max; ``--json`` writes them too.

    python -m bench.resume_after_kill --trials 10
    python -m bench.resume_after_kill --session-timeout-ms 6000 --lease-ttl-s 3   # another setting
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from harness.stack import ServiceProcess, Stack, build_stack
from services.common import keys
from services.common.wire import DeltaEvent, decode_event

MODEL_NAME = "tiny"
PARTITIONS = 4


@dataclass
class Trial:
    wire_s: float  # kill -> the survivor's first token event on the request's channel
    client_s: float  # kill -> the client's first SSE chunk after that event
    resumed_after_tokens: int  # tokens the dead worker had published


def _worker_id(worker: ServiceProcess) -> str:
    worker_id: str = httpx.get(f"{worker.url}/stats", timeout=10).json()["worker"]
    return worker_id


def _settled(stack: Stack) -> bool:
    """Every partition belongs to exactly one live, ready worker, and each worker holds some."""
    held: list[int] = []
    for worker in stack.workers:
        if worker.proc.poll() is not None:
            continue
        try:
            resp = httpx.get(f"{worker.url}/readyz", timeout=5)
        except httpx.HTTPError:
            return False
        parts = resp.json().get("partitions", [])
        if resp.status_code != 200 or not parts:
            return False
        held += parts
    return sorted(held) == list(range(PARTITIONS))


def _wait(predicate: Any, timeout_s: float, what: str, interval_s: float = 0.01) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval_s)
    raise TimeoutError(f"no {what} within {timeout_s:.0f}s")


class _Stream:
    """One streaming completion read on a thread, every chunk stamped with its arrival time."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        self.arrivals: list[float] = []
        self.request_id = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, args=(url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as resp:
                for line in resp.iter_lines():
                    if self._stop.is_set():
                        return  # leaving the stream hangs up: the gateway cancels the request
                    if line.startswith("data: {"):
                        if not self.request_id:
                            self.request_id = json.loads(line[6:])["id"]
                        self.arrivals.append(time.time())
        except httpx.HTTPError:
            pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


def one_trial(stack: Stack, body: dict[str, Any], kill_after_tokens: int, timeout_s: float) -> Trial:
    r = stack.redis_client()
    stream = _Stream(stack.url, body)
    try:
        request_id = _wait(lambda: stream.request_id, timeout_s, "first chunk")
        sub = r.pubsub(ignore_subscribe_messages=True)
        sub.subscribe(keys.events(request_id))
        _wait(lambda: r.llen(keys.log(request_id)) >= kill_after_tokens, timeout_s, "tokens before the kill")
        owner_id = r.get(keys.owner(request_id))
        (victim,) = [w for w in stack.workers if w.proc.poll() is None and _worker_id(w) == owner_id]
        victim.kill()
        killed = time.time()
        # The survivor's first event: the channel carries every event live; the dead worker's own
        # (published before the kill) are skipped by their worker id.
        resumed_at = None
        while resumed_at is None:
            if time.time() - killed > timeout_s:
                raise TimeoutError(f"the request did not resume within {timeout_s:.0f}s")
            msg = sub.get_message(timeout=0.5)
            if msg is None:
                continue
            event = decode_event(msg["data"])
            if isinstance(event, DeltaEvent) and event.worker != owner_id:
                resumed_at = time.time()
        sub.close()
        client_at = _wait(lambda: next((t for t in stream.arrivals if t >= resumed_at), None), 30, "chunk")
        dead_tokens = sum(
            len(e.token_ids)
            for e in map(decode_event, r.lrange(keys.log(request_id), 0, -1))
            if isinstance(e, DeltaEvent) and e.worker == owner_id
        )
        return Trial(resumed_at - killed, client_at - killed, dead_tokens)
    finally:
        stream.close()


def run(args: argparse.Namespace) -> list[Trial]:
    from engine.models.tiny import default_model_path

    env = {
        "INFLIGHT_SERVED_MODEL_NAME": MODEL_NAME,
        "INFLIGHT_KAFKA_PARTITIONS": str(PARTITIONS),
        "INFLIGHT_TORCH_THREADS": "1",
        "INFLIGHT_FAULT_STEP_DELAY_S": str(args.step_delay_s),
    }
    if args.session_timeout_ms is not None:
        env["INFLIGHT_KAFKA_SESSION_TIMEOUT_MS"] = str(args.session_timeout_ms)
    if args.lease_ttl_s is not None:
        env["INFLIGHT_LEASE_TTL_S"] = str(args.lease_ttl_s)
    # Paced, the request outlives the kill and the recovery on any host: max_tokens steps of at least
    # step_delay_s each.
    body = {
        "model": MODEL_NAME,
        "prompt": "Once upon a time, in a small village near the sea, there lived",
        "max_tokens": args.max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    trials: list[Trial] = []
    with tempfile.TemporaryDirectory(prefix="resume-after-kill-") as tmp:
        stack = build_stack(
            default_model_path(), Path(tmp), workers=2, tag="resume", env=env, ready_timeout_s=180
        )
        try:
            for i in range(args.trials):
                _wait(lambda: _settled(stack), 120, "settled group", interval_s=0.2)
                # A prompt of its own each time: its key picks the partition, so the doomed worker is
                # sometimes the older worker and sometimes the replacement.
                prompt = f"Trial {i}. {body['prompt']}"
                trial = one_trial(stack, {**body, "prompt": prompt}, args.kill_after_tokens, args.timeout_s)
                trials.append(trial)
                print(
                    f"trial {i + 1:2d}: resumed {trial.wire_s:6.2f} s after the kill on the wire, "
                    f"{trial.client_s:6.2f} s at the client ({trial.resumed_after_tokens} tokens before)",
                    flush=True,
                )
                stack.workers = [w for w in stack.workers if w.proc.poll() is None]
                stack.add_worker()
        finally:
            stack.close()
    return trials


def summary(trials: list[Trial]) -> dict[str, dict[str, float]]:
    out = {}
    for name in ("wire_s", "client_s"):
        values = [getattr(t, name) for t in trials]
        out[name] = {"min": min(values), "median": statistics.median(values), "max": max(values)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument(
        "--session-timeout-ms",
        type=int,
        default=None,
        help="INFLIGHT_KAFKA_SESSION_TIMEOUT_MS (default: the setting's)",
    )
    parser.add_argument(
        "--lease-ttl-s", type=float, default=None, help="INFLIGHT_LEASE_TTL_S (default: the setting's)"
    )
    parser.add_argument(
        "--step-delay-s", type=float, default=0.02, help="every engine step sleeps this long first"
    )
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument(
        "--kill-after-tokens", type=int, default=10, help="token events published before the kill"
    )
    parser.add_argument("--timeout-s", type=float, default=60.0, help="give a trial up after this long")
    parser.add_argument("--json", type=Path, default=None, help="also write the trials and summary here")
    args = parser.parse_args(argv)
    trials = run(args)
    stats = summary(trials)
    for name, s in stats.items():
        spread = f"min {s['min']:.2f}  median {s['median']:.2f}  max {s['max']:.2f} s"
        print(f"{name:9s} {spread}  ({len(trials)} kills)")
    if args.json is not None:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(
            json.dumps(
                {"settings": settings, "trials": [asdict(t) for t in trials], "summary": stats}, indent=2
            )
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
