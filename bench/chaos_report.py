"""The soak's end-state checks and its table (see bench/chaos.py)."""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from bench.chaos_hostile import KINDS, HostileSummary
from bench.chaos_traffic import Result
from services.common import keys

if TYPE_CHECKING:
    from harness.stack import Stack


@dataclass
class Fault:
    name: str
    at_s: float  # from the start of the fault phase
    # Until the fleet served again (bench/chaos_faults.py says what that means for each fault).
    recovery_s: float
    lasted_s: float = 0.0  # a spell's length; for a stalled core, until its worker exited
    ok: bool = True  # the fault did what it should (a stall detected, writes refused) and was recovered from
    detail: str = ""
    # Taken once it was recovered from (bench/chaos_hostile.py snapshot): metric series, Redis keys without a
    # TTL, open event subscriptions, requests the workers hold, the crowd gateway's RSS (MiB).
    leaks: dict[str, float] = field(default_factory=dict)


@dataclass
class SlowSummary:
    """The slow readers: how each ended, and the gateways' memory (MiB) around them."""

    sent: int = 0
    completed: int = 0  # with the undisturbed run's text
    cut_off: int = 0  # the gateway's slow_reader error event
    failed: int = 0  # another error the client saw (its gateway killed)
    lost: int = 0
    wrong_text: int = 0
    rss_mib: list[dict[str, float | None]] = field(default_factory=list)  # per gateway: before, peak, after


@dataclass
class Report:
    faults: list[Fault]
    sent: int = 0
    accepted: int = 0  # the gateway took it (the client got a request id)
    completed: int = 0  # with the undisturbed run's text
    cancelled: int = 0
    failed: int = 0  # accepted, then an error the client saw
    refused: int = 0  # not accepted: an error at the door (broker or Redis down, gateway dead)
    lost: int = 0  # accepted, and the client never learned how it ended
    duplicated: int = 0  # ran (or published) twice
    relogged: int = 0  # events a retried publish logged again, byte for byte (readers drop them by seq)
    wrong_text: int = 0
    hostile_sent: int = 0
    hostile_rejected: int = 0
    server_errors: int = 0  # any 500 answer
    kv_free: bool = False
    pending_left: int = -1
    workers_down: int = 0  # workers not alive and ready at the end, apart from those the faults killed
    slow: SlowSummary = field(default_factory=SlowSummary)
    crowd: HostileSummary | None = None  # the hostile crowd and what it left behind (chaos_hostile.py)
    wall_s: float = 0.0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        bad = self.lost or self.duplicated or self.wrong_text or self.server_errors or self.workers_down
        slow_bad = self.slow.lost or self.slow.wrong_text
        return (
            not (bad or slow_bad)
            and self.hostile_rejected == self.hostile_sent
            and all(f.ok for f in self.faults)
            and self.kv_free
            and self.pending_left == 0
            and (self.crowd is None or self.crowd.ok)
        )

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def _quiet(stack: Stack, problems: list[str], timeout_s: float = 30.0) -> tuple[bool, int]:
    """Wait until no worker holds a request and the pending set is empty; then report both."""
    deadline = time.monotonic() + timeout_s
    kv_free, pending = False, -1
    stats: list[dict[str, Any] | None] = []
    while time.monotonic() < deadline:
        stats = []
        for worker in stack.workers:
            try:
                stats.append(httpx.get(f"{worker.url}/stats", timeout=5).json())
            except httpx.HTTPError:
                stats.append(None)
        kv_free = all(
            s is not None and not s["requests"] and s["kv"]["num_free_blocks"] == s["kv"]["num_total_blocks"]
            for s in stats
        )
        # Live reservations only, as admission counts them (store.num_pending): a SIGKILLed gateway's
        # entries stop being refreshed and lapse after pending_ttl_s; the next admit trims them.
        pending = int(stack.redis_client().zcount(keys.PENDING, int(time.time() * 1000), "+inf"))
        if kv_free and pending == 0:
            break
        time.sleep(0.5)
    if not kv_free:
        problems.extend(
            f"worker {w.port}: {s and {k: s[k] for k in ('requests', 'kv', 'num_waiting', 'num_running')}}"
            for w, s in zip(stack.workers, stats, strict=True)
        )
    return kv_free, pending


def _ran_twice(stack: Stack, request_id: str) -> tuple[str | None, int]:
    """Whether the request's log shows it ran (or published) twice, and how many of its events were
    logged again as they were.

    A pipelined publish that Redis took only in part (the OOM bound reached midway, a connection
    dropped after the scripts ran) is sent again whole, so some events are logged twice, byte for byte;
    readers drop them by seq (services/gateway/token_streams.py). Running twice shows differently: one seq
    with two different events (other tokens, another worker), a gap, or more than one terminal event.
    """
    raw = stack.redis_client().lrange(keys.log(request_id), 0, -1)
    if not raw:
        return None, 0  # a short-lived record (cancelled in the queue) or an expired one: nothing to check
    by_seq: dict[int, set[str]] = {}
    for r in raw:
        by_seq.setdefault(json.loads(r)["seq"], set()).add(r)
    seqs = sorted(by_seq)
    dones = sum(1 for r in set(raw) if json.loads(r)["type"] == "done")
    relogged = len(raw) - len(by_seq)
    if any(len(v) > 1 for v in by_seq.values()) or seqs != list(range(1, len(seqs) + 1)) or dones > 1:
        return f"{request_id}: seqs {[json.loads(r)['seq'] for r in raw][:20]}, {dones} done events", relogged
    return None, relogged


def _workers_down(stack: Stack, problems: list[str], timeout_s: float = 180.0) -> int:
    """Workers that are not alive and ready (a restarted one may still be loading its model)."""
    deadline = time.monotonic() + timeout_s
    down = 0
    for worker in stack.workers:
        while not worker.ready() and worker.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.5)
        if not worker.ready():
            down += 1
            problems.append(
                f"worker {worker.port} down (exit code {worker.proc.poll()}): {worker.tail_log(300)}"
            )
    return down


def _unhandled_errors(stack: Stack, lines: int = 30) -> list[str]:
    """The tracebacks the gateways logged for the errors they answered 500 (errors.py logs each as
    "unhandled error"): what a 500 in the report was, without the logs at hand (a CI run's)."""
    out = []
    for gateway in stack.gateways:
        with contextlib.suppress(OSError):
            text = gateway.log_path.read_text(errors="replace").splitlines()
            for i, line in enumerate(text):
                if "unhandled error" in line:
                    out.append("\n".join(text[i : i + lines]))
    return out


def check(
    stack: Stack, results: list[Result], expected: dict[int, str], faults: list[Fault], slow: SlowSummary
) -> Report:
    report = Report(faults, sent=len(results), slow=slow)
    report.workers_down = _workers_down(stack, report.problems)
    report.kv_free, report.pending_left = _quiet(stack, report.problems)
    report.problems.extend(f"{f.name}: {f.detail}" for f in faults if not f.ok)
    for r in results:
        if r.spec.kind == "hostile":
            if r.outcome == "refused":
                continue  # its gateway was gone: no answer to judge
            report.hostile_sent += 1
            if r.outcome == "rejected":
                report.hostile_rejected += 1
            else:
                report.problems.append(f"#{r.spec.index} poison {r.spec.label!r}: {r.detail}")
            if r.detail.startswith("500"):
                report.server_errors += 1
            continue
        if r.detail.startswith("500"):
            report.server_errors += 1
            report.problems.append(f"#{r.spec.index} {r.spec.kind}: {r.detail}")
        if r.request_id is None:
            report.refused += 1
            continue
        report.accepted += 1
        if r.outcome == "completed":
            if r.text == expected[r.spec.index]:
                report.completed += 1
            else:
                report.wrong_text += 1
                report.problems.append(
                    f"#{r.spec.index} {r.request_id}: {r.text!r} != {expected[r.spec.index]!r}"
                )
        elif r.outcome == "cancelled":
            report.cancelled += 1
        elif r.outcome == "lost" or r.extra.get("silent_end"):
            report.lost += 1
            report.problems.append(f"#{r.spec.index} {r.spec.kind} {r.request_id}: {r.detail}")
        else:
            report.failed += 1
        dup, relogged = _ran_twice(stack, r.request_id)
        report.relogged += relogged
        if dup:
            report.duplicated += 1
            report.problems.append(dup)
    if report.server_errors:
        report.problems.extend(_unhandled_errors(stack))
    return report


def _crowd_count(crowd: HostileSummary, kind: str) -> str:
    if kind == "vanishing_stream":  # nothing to refuse: what they held is checked below and by the KV check
        return f"{crowd.sent[kind]} sent and gone"
    return f"{crowd.refused[kind]} of {crowd.sent[kind]} refused"


def _crowd_rows(crowd: HostileSummary | None) -> list[tuple[str, object]]:
    if crowd is None:
        return []
    return [
        *((f"hostile: {k.replace('_', ' ')}", _crowd_count(crowd, k)) for k in KINDS),
        ("  new metric series", crowd.series_after - crowd.series_before),
        ("  Redis keys without a TTL", len(crowd.keys_without_ttl)),
        ("  event subscriptions left", crowd.subscriptions_left),
        *(("    held by", who) for who in crowd.subscribers_left),
        (
            "  its gateway's RSS MiB before/after",
            f"{crowd.rss_mib.get('before')}/{crowd.rss_mib.get('after')}",
        ),
    ]


def print_table(report: Report) -> None:
    print("fault               at (s)   lasted (s)   recovered in (s)   ok")
    for f in report.faults:
        print(f"{f.name:<18} {f.at_s:>7.1f}   {f.lasted_s:>10.1f}   {f.recovery_s:>16.1f}   {f.ok}")
    for f in report.faults:
        if f.detail:
            print(f"  {f.name}: {f.detail}")
    if any(f.leaks for f in report.faults):
        print("after each fault      series   keys without TTL   subscriptions   running   gateway RSS MiB")
        for f in report.faults:
            got = f.leaks
            print(
                f"{f.name:<18} {got.get('series', -1):>9.0f}   {got.get('keys_without_ttl', -1):>16.0f}   "
                f"{got.get('subscriptions', -1):>13.0f}   {got.get('running', -1):>7.0f}   "
                f"{got.get('gateway_rss_mib', -1):>15.1f}"
            )
    slow = report.slow
    rows = [
        ("faults injected", len(report.faults)),
        ("requests sent", report.sent),
        ("accepted", report.accepted),
        ("completed (same text)", report.completed),
        ("cancelled", report.cancelled),
        ("failed with an error the client saw", report.failed),
        ("refused at the door (client saw it)", report.refused),
        ("lost", report.lost),
        ("duplicated", report.duplicated),
        ("events logged again by a retried publish", report.relogged),
        ("wrong text", report.wrong_text),
        ("poison refused with 4xx", f"{report.hostile_rejected} of {report.hostile_sent}"),
        ("500 answers", report.server_errors),
        ("slow readers", slow.sent),
        ("  completed (same text)", slow.completed),
        ("  cut off (slow_reader error)", slow.cut_off),
        ("  failed with another error", slow.failed),
        ("  lost / wrong text", f"{slow.lost} / {slow.wrong_text}"),
        *(
            (
                f"gateway {i} RSS MiB before/peak/after",
                "/".join(str(rss.get(k)) for k in ("before", "peak", "after")),
            )
            for i, rss in enumerate(slow.rss_mib)
        ),
        *_crowd_rows(report.crowd),
        ("workers down at the end", report.workers_down),
        ("KV blocks all free", report.kv_free),
        ("pending set left", report.pending_left),
        ("wall time (s)", report.wall_s),
    ]
    for name, value in rows:
        print(f"{name:<38} {value}")
    crowd_problems = report.crowd.problems if report.crowd is not None else []
    for problem in [*report.problems, *crowd_problems][:20]:
        print(f"  ! {problem}")
    print("PASS" if report.ok else "FAIL")
