"""Who keeps the host's cores busy: CPU seconds of process groups, of this process and of the rest of the
host, read from /proc (Linux), as cores kept busy over a stretch of wall time."""

from __future__ import annotations

import contextlib
import os
import resource
import time
from pathlib import Path
from typing import Any

_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
THIS_PROCESS = "this process"  # the clients on the stack's runs, the engine and its caller on the others
REST = "rest of the host"  # everything else that ran meanwhile: on a shared host, other tenants


def _host_busy_s() -> float:
    """CPU seconds the whole host has spent busy since boot, all cores (/proc/stat)."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = (
        int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / _CLOCK_TICKS


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of one live process (0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS


def descendants(pid: int) -> list[int]:
    """The live processes below ``pid`` (Linux: every thread's ``children`` list)."""
    found, todo = [], [pid]
    while todo:
        with contextlib.suppress(OSError, ValueError):
            for task in Path(f"/proc/{todo.pop()}/task").iterdir():
                children = [int(c) for c in (task / "children").read_text().split()]
                found += children
                todo += children
    return found


def stack_processes(stack: Any) -> dict[str, list[int]]:
    """A stack's processes by role; the worker's own process apart from its children (the engine core)."""
    workers = [w.proc.pid for w in stack.workers]
    servers = {"broker": stack.kafka.proc, "redis": stack.redis.proc}
    groups = {
        "gateway": [p for g in stack.gateways for p in (g.proc.pid, *descendants(g.proc.pid))],
        "worker": workers,
        "engine core": [p for pid in workers for p in descendants(pid)],
    }
    for name, proc in servers.items():
        groups[name] = [] if proc is None else [proc.pid, *descendants(proc.pid)]
    return groups


class CpuMeter:
    """CPU time of process groups and of this process from now on; ``cores()``: each as cores kept busy
    over the wall time since (1.0 = one core all the time). On a host with few cores this is where
    the stack competes with its own engine."""

    def __init__(self, groups: dict[str, list[int]]) -> None:
        self.groups = groups
        self.began = time.monotonic()
        self.before = self._read()

    def _read(self) -> dict[str, float]:
        out = {name: sum(cpu_s(pid) for pid in pids) for name, pids in self.groups.items()}
        usage = resource.getrusage(resource.RUSAGE_SELF)
        out[THIS_PROCESS] = usage.ru_utime + usage.ru_stime
        out[REST] = _host_busy_s()  # the whole host until cores() takes ours out
        return out

    def cores(self) -> dict[str, float]:
        wall = time.monotonic() - self.began
        after = self._read()
        cores = {name: (after[name] - self.before[name]) / wall for name in after}
        cores[REST] = max(0.0, cores[REST] - sum(v for name, v in cores.items() if name != REST))
        return cores
