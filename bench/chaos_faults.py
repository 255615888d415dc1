"""The soak's faults (see bench/chaos.py): each one injected into a running stack, and its recovery timed.

What "recovered" means depends on the fault:

- a process killed or a server restarted: from the fault until a canary request succeeds end to end
  (through a live gateway, a worker, the broker and Redis);
- a Redis spell (over ``maxmemory`` with ``noeviction``, or demoted to a replica so that writes answer
  READONLY): from the end of the spell until a canary succeeds again;
- a stalled engine core (SIGSTOP): from the stop until every request the core held streams again (its
  log gains a token from another worker) or has ended. On the way the stall watchdog must kill the core
  and the worker must exit, as a readiness probe sees it; the soak then restarts it, as a Deployment would.
- a poison request (a job whose engine dies each time it runs: the soak SIGKILLs the engine core of every
  worker that publishes a token of it, as an OOM or a crashing kernel would): from its submission until it
  has failed with ``engine_failed`` after the bound's number of engines, its dead letter is written, and a
  canary succeeds on the restarted workers.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import httpx
import redis as redis_lib

from bench.chaos_report import Fault
from harness.servers import free_port
from harness.stack import ServiceProcess, Stack, launch
from services.common import keys
from services.common.wire import DeltaEvent, DoneEvent, decode_event

FAULTS = (
    "kill worker",
    "restart broker",
    "restart redis",
    "stall core",
    "redis oom",
    "redis readonly",
    "poison request",
    "kill gateway",  # last: it is not restarted
)
POISON_BODY: dict[str, Any] = {
    "prompt": "A poison request: every engine that runs it dies. Once upon a time",
    "max_tokens": 200,  # paced steps: each kill finds it still running
    "temperature": 0.0,
    "ignore_eos": True,
}
ENGINE_FAILURE_BOUND = 3  # INFLIGHT_MAX_ENGINE_FAILURES's default, which the soak's stack keeps
RECOVERY_LIMIT_S = 90.0  # a fault not recovered from by then is reported as such (recovery_s = the limit)


def canary(stack: Stack, model: str) -> bool:
    """A canary request succeeds end to end (through a live gateway, a worker, the broker and Redis)."""
    body = {"model": model, "prompt": "canary", "max_tokens": 2}
    for url in stack.live_gateways():
        try:
            if httpx.post(f"{url}/v1/completions", json=body, timeout=10).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
    return False


def _wait(predicate: Callable[[], bool], limit_s: float = RECOVERY_LIMIT_S, interval_s: float = 0.25) -> bool:
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(interval_s)
    return True


def _stats(worker: ServiceProcess) -> dict[str, Any]:
    """The worker's /stats; empty while it cannot answer (a restarted one still loading its model)."""
    try:
        with urllib.request.urlopen(f"{worker.url}/stats", timeout=5) as resp:
            stats: dict[str, Any] = json.loads(resp.read())
    except OSError:
        return {}
    return stats


class Witness(threading.Thread):
    """A greedy stream read to its end; the stall fault stops the core that serves it."""

    def __init__(self, url: str, body: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.url, self.body = url, body
        self.request_id = ""
        self.num_chunks = 0
        self.text: str | None = None  # set once [DONE] arrived
        self.error = ""

    def run(self) -> None:
        parts: list[str] = []
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/completions", json={**self.body, "stream": True}, timeout=120
            ) as resp:
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.text = "".join(parts)
                        return
                    if line.startswith("data: "):
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.error = str(event["error"])[:200]
                            return
                        self.request_id = event["id"]
                        parts.extend(c.get("text") or "" for c in event["choices"])
                        self.num_chunks += 1
            self.error = f"HTTP {resp.status_code}, no [DONE]"
        except httpx.HTTPError as exc:
            self.error = repr(exc)


class FaultRunner:
    """Injects the schedule's faults one after another and times each recovery.

    ``retired`` collects the worker processes deliberately killed or stalled (replaced in
    ``stack.workers`` by a restarted one); ``stopped_pids`` the cores it SIGSTOPped, killed at the end in
    case the watchdog did not.
    """

    def __init__(
        self, stack: Stack, model: str, rng: random.Random, start: float, witness: tuple[dict[str, Any], str]
    ) -> None:
        self.stack, self.model, self.rng, self.start = stack, model, rng, start
        self.witness_body, self.witness_text = witness
        self.retired: list[ServiceProcess] = []
        self.stopped_pids: list[int] = []
        self.spell_s = 3.0
        # What is left after each fault (chaos_hostile.snapshot), when the soak has a crowd gateway.
        self.snapshot: Callable[[], dict[str, float]] | None = None

    def run(self, schedule: list[tuple[float, str]]) -> list[Fault]:
        faults = []
        for at_s, name in schedule:
            time.sleep(max(0.0, self.start + at_s - time.monotonic()))
            began = time.monotonic()
            try:
                fault = self.inject(name, began)
            except Exception as exc:  # reported as a failed fault; the soak and its checks go on
                fault = Fault(name, 0.0, round(time.monotonic() - began, 1), ok=False, detail=repr(exc)[:300])
            fault.at_s = round(began - self.start, 1)
            if self.snapshot is not None:
                try:
                    fault.leaks = self.snapshot()
                except Exception as exc:  # a figure missing from the table, not a failed soak
                    fault.detail = f"{fault.detail}; no leak snapshot: {exc!r}"[:400]
            faults.append(fault)
        return faults

    def inject(self, name: str, began: float) -> Fault:
        if name == "stall core":
            return self.stall_core()
        if name in ("redis oom", "redis readonly"):
            return self.redis_spell(name)
        if name == "poison request":
            return self.poison_request(began)
        self.crash(name)
        ok = _wait(lambda: canary(self.stack, self.model))
        return Fault(name, 0.0, round(time.monotonic() - began, 1), ok=ok)

    def close(self) -> None:
        for pid in self.stopped_pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    # ---- processes and servers going away --------------------------------------------------------
    def crash(self, name: str) -> None:
        stack = self.stack
        if name == "kill worker":
            victim = self.rng.randrange(len(stack.workers))
            stack.workers[victim].kill()
            self._replace(victim)
        elif name == "restart broker":
            stack.kafka.restart(down_s=0.5)
        elif name == "restart redis":
            # A Redis with persistence comes back with its data. SHUTDOWN SAVE writes it and exits in one
            # step: a SAVE and then a stop lost whatever Redis acknowledged in between (a job finished in
            # that window came back "in_progress" with its Kafka offset committed: stuck for good), which
            # a deployment's Redis, saving on shutdown or logging every write, never does.
            with contextlib.suppress(redis_lib.ConnectionError):  # the connection closes as it exits
                stack.redis_client().shutdown(save=True)
            stack.redis.restart(down_s=0.5)
        elif name == "kill gateway":
            stack.gateways[0].kill()  # not restarted: its clients see the failure, the other serves on
        else:
            raise ValueError(name)

    def poison_request(self, began: float) -> Fault:
        gateways = self.stack.live_gateways()
        if not gateways:
            return Fault("poison request", 0.0, 0.0, ok=False, detail="no live gateway")
        body = {"endpoint": "/v1/completions", "body": {**POISON_BODY, "model": self.model}}
        resp = httpx.post(f"{gateways[0]}/v1/jobs", json=body, timeout=30)
        if resp.status_code not in (200, 202):
            return Fault("poison request", 0.0, 0.0, ok=False, detail=f"not accepted: {resp.status_code}")
        job_id = str(resp.json()["id"])
        redis = self.stack.redis_client()
        killed: list[str] = []
        status, code = "", ""
        deadline = time.monotonic() + RECOVERY_LIMIT_S
        while time.monotonic() < deadline:
            record = redis.hgetall(keys.record(job_id))
            status, code = str(record.get("status", "")), str(record.get("code", ""))
            if status in ("completed", "failed", "cancelled"):
                break
            raw = redis.lrange(keys.log(job_id), -1, -1)
            last = decode_event(raw[0]) if raw else None
            # Only the engine of the worker that holds the job now: the last token may be from a claim
            # already handed back, and killing that worker's engine would count against its neighbours
            # and not against the job.
            owner = redis.get(keys.owner(job_id))
            if isinstance(last, DeltaEvent) and last.worker == owner and last.worker not in killed:
                self._kill_engine_of(last.worker)
                killed.append(last.worker)
            time.sleep(0.05)
        dead_letter = bool(redis.exists(keys.dead_letter(job_id)))
        failed = status == "failed" and code == "engine_failed"
        served = _wait(lambda: canary(self.stack, self.model))
        ok = failed and dead_letter and len(killed) == ENGINE_FAILURE_BOUND and served
        detail = (
            f"{len(killed)} engines died under it; it ended {status or 'unfinished'} ({code or 'no code'}); "
            f"dead letter {'kept' if dead_letter else 'missing'}"
        )
        return Fault("poison request", 0.0, round(time.monotonic() - began, 1), ok=ok, detail=detail)

    def _kill_engine_of(self, worker_id: str) -> None:
        """SIGKILL the engine core of the worker named ``worker_id``; once that worker has seen it die
        (its liveness probe fails), restart it as a Deployment would."""
        for index, worker in enumerate(self.stack.workers):
            stats = _stats(worker)
            if stats.get("worker") != worker_id:
                continue
            with contextlib.suppress(ProcessLookupError, KeyError, TypeError):
                os.kill(int(stats["engine_pid"]), signal.SIGKILL)
            _wait(lambda w=worker: not _alive_probe(w), 30, 0.2)  # type: ignore[misc]
            worker.kill()
            self._replace(index)
            return

    def _replace(self, index: int) -> None:
        """The Deployment restarts a worker that is gone (not waited for: traffic goes on meanwhile)."""
        self.retired.append(self.stack.workers[index])
        self.stack.workers[index] = launch("worker", self.stack.env, self.stack.log_dir)

    # ---- an engine core that stops stepping --------------------------------------------------------
    def stall_core(self) -> Fault:
        """SIGSTOP the core serving a witness stream (paced steps keep it running whatever the host's
        speed); the watchdog kills the core, the worker exits once a probe saw it not ready, a restarted
        worker joins, and every request the core held resumes elsewhere."""
        stack = self.stack
        url = (stack.live_gateways() or [stack.gateways[-1].url])[-1]
        witness = Witness(url, self.witness_body)
        witness.start()
        if not _wait(lambda: witness.num_chunks >= 3 or not witness.is_alive(), 60, 0.02):
            return Fault("stall core", 0.0, RECOVERY_LIMIT_S, ok=False, detail="the witness never streamed")
        owner_id = stack.redis_client().get(keys.owner(witness.request_id))
        found = [
            i
            for i, w in enumerate(stack.workers)
            if w.proc.poll() is None and _stats(w).get("worker") == owner_id
        ]
        if not found or not witness.is_alive():
            detail = f"the witness was not running on a live worker ({witness.error or 'finished'})"
            return Fault("stall core", 0.0, RECOVERY_LIMIT_S, ok=False, detail=detail)
        victim = stack.workers[found[0]]
        core_pid = int(_stats(victim).get("engine_pid") or 0)
        if not core_pid:
            return Fault("stall core", 0.0, RECOVERY_LIMIT_S, ok=False, detail="no engine core pid in /stats")
        os.kill(core_pid, signal.SIGSTOP)  # alive, holding its requests, stepping no more
        stopped = time.monotonic()
        self.stopped_pids.append(core_pid)
        held = list(_stats(victim).get("requests", [witness.request_id]))  # the worker itself still answers
        # The kubelet's readiness probe: the worker exits once it has seen the probe fail.
        exited = _wait(lambda: not _probe(victim), RECOVERY_LIMIT_S, 0.5) and _wait(
            lambda: victim.proc.poll() is not None, 30, 0.2
        )
        exit_s = time.monotonic() - stopped
        code = victim.proc.poll()
        if victim.proc.poll() is None:
            victim.kill()
        self._replace(found[0])
        resumed = _wait(lambda: all(self._moved_on(r, str(owner_id)) for r in held))
        recovery_s = time.monotonic() - stopped
        witness.join(RECOVERY_LIMIT_S)
        same = witness.text == self.witness_text
        # 3: exited for a restart. 4: leaving the group hung in a rebalance the broker did not finish
        # (a loaded host), so the worker exited without it, which frees its partitions just the same.
        handed_over = code == 3 or (code == 4 and "the group could not be left" in victim.tail_log(20_000))
        ok = exited and handed_over and resumed and same
        if same:
            seen = "same text"
        elif witness.text is None:
            seen = f"unfinished ({witness.error or 'still streaming'})"
        else:
            seen = f"different text ({len(witness.text)} vs {len(self.witness_text)} characters)"
        detail = (
            f"{len(held)} held requests resumed elsewhere in {recovery_s:.1f}s; worker exited with {code} "
            f"after {exit_s:.1f}s; witness {seen}"
        )
        return Fault("stall core", 0.0, round(recovery_s, 1), round(exit_s, 1), ok, detail)

    def _moved_on(self, request_id: str, stalled_worker: str) -> bool:
        """A token of the request from another worker, or its end, is in its log."""
        try:
            raw = self.stack.redis_client().lrange(keys.log(request_id), 0, -1)
        except redis_lib.RedisError:
            return False
        events = [decode_event(r) for r in raw]
        return any(
            isinstance(e, DoneEvent) or (isinstance(e, DeltaEvent) and e.worker != stalled_worker)
            for e in events
        )

    # ---- Redis refusing writes ----------------------------------------------------------------------
    def redis_spell(self, name: str) -> Fault:
        """For ``spell_s``, Redis answers writes with OOM (``maxmemory`` of one byte with ``noeviction``:
        every write is refused, however much the traffic frees meanwhile; a bound just above the memory in
        use let writes through once finished requests' keys were freed during the spell) or READONLY (a
        replica of a master that is not there: it keeps its data, unlike a replica that syncs, and pub/sub
        still works, as on a real replica after a failover)."""
        r = self.stack.redis_client()
        began = time.monotonic()
        if name == "redis oom":
            r.config_set("maxmemory-policy", "noeviction")
            r.config_set("maxmemory", 1)
        else:
            r.execute_command("REPLICAOF", "127.0.0.1", str(free_port()))
        refused = ""
        try:
            time.sleep(self.spell_s)
            refused = _write_refused(r)
        finally:
            if name == "redis oom":
                r.config_set("maxmemory", 0)
            else:
                r.execute_command("REPLICAOF", "NO", "ONE")
            r.delete("chaos:probe")
        ended = time.monotonic()
        ok = _wait(lambda: canary(self.stack, self.model))
        detail = f"writes answered {refused}" if refused else "writes were not refused"
        return Fault(
            name,
            0.0,
            round(time.monotonic() - ended, 1),
            round(ended - began, 1),
            ok and bool(refused),
            detail,
        )


def _write_refused(r: Any) -> str:
    """The error a write gets now ('' if it succeeds): two writes, so a Redis just under its
    ``maxmemory`` is pushed over by the first and refuses the second."""
    try:
        r.set("chaos:probe", "x" * 128 * 1024)
        r.set("chaos:probe", "y")
    except redis_lib.exceptions.OutOfMemoryError:
        return "OOM"
    except redis_lib.exceptions.ReadOnlyError:
        return "READONLY"
    except redis_lib.ResponseError as exc:
        return type(exc).__name__
    return ""


def _alive_probe(worker: ServiceProcess) -> bool:
    """The liveness probe: /healthz answers 500 once the worker's engine is dead."""
    try:
        return httpx.get(f"{worker.url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _probe(worker: ServiceProcess) -> bool:
    try:
        return httpx.get(f"{worker.url}/readyz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def make_schedule(seed: int, duration_s: float, names: list[str] | None = None) -> list[tuple[float, str]]:
    """Each fault once, in a seeded order at seeded times; a gateway kill last (it is not restarted)."""
    rng = random.Random(seed)
    chosen = list(names or FAULTS)
    last = [n for n in chosen if n == "kill gateway"]
    rest = [n for n in chosen if n != "kill gateway"]
    rng.shuffle(rest)
    order = rest + last
    slot = duration_s / len(order)
    return [(round(i * slot + rng.uniform(0.1, 0.4) * slot, 1), n) for i, n in enumerate(order)]
