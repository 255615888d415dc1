"""The torch thread count, decided from what this process may use of the host.

Torch's own default is one thread per CPU the OpenMP runtime sees, which ignores a container's CPU quota
(a Kubernetes CPU limit, ``docker --cpus``) and counts hyperthreads. OpenMP threads spin-wait for each
other at every parallel region, so a thread whose CPU time is throttled away, or that shares a core with
its sibling, holds the whole team up.

Torch-free at import: the worker process (which never runs the model itself) decides its engine core's
thread count from here.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.platform._files import read_host_file as _read

log = logging.getLogger(__name__)


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity mask, which taskset and a container's cpuset
    (``docker --cpuset-cpus``, Kubernetes' static CPU manager) narrow."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def core_groups(cpus: set[int], root: Path = Path("/")) -> list[frozenset[int]] | None:
    """``cpus`` grouped by physical core (hyperthread siblings together), from sysfs's
    thread_siblings_list; None where sysfs does not say (a sandbox without /sys)."""
    groups: set[frozenset[int]] = set()
    for cpu in cpus:
        text = _read(root / f"sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
        if text is None:
            return None
        try:
            siblings = parse_cpu_list(text)
        except ValueError:
            return None
        groups.add(frozenset((siblings | {cpu}) & cpus))
    return sorted(groups, key=min)


def physical_cores() -> int:
    """Cores this process may run on (affinity), counting each physical core once where visible."""
    cpus = allowed_cpus()
    groups = core_groups(cpus)
    return max(1, len(cpus) if groups is None else len(groups))


def cpu_quota(root: Path = Path("/")) -> float | None:
    """CPUs' worth of time this process's cgroup may use per period (cgroup v2 ``cpu.max``, v1
    ``cpu.cfs_quota_us``), the tightest along its cgroup's path; None where there is no limit or no
    cgroup file to read."""
    text = _read(root / "proc/self/cgroup")
    if text is None:
        return None
    limits: list[float] = []
    base = root / "sys/fs/cgroup"
    for line in text.splitlines():
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue
        _, controllers, path = fields
        rel = Path(path.strip().lstrip("/"))
        ancestors = [rel, *rel.parents]  # limits nest: a parent's quota bounds its children
        if controllers == "":  # cgroup v2: "0::/path"
            for d in ancestors:
                fields = (_read(base / d / "cpu.max") or "").split()
                if len(fields) == 2:
                    _add_limit(limits, fields[0], fields[1])
        elif "cpu" in controllers.split(","):  # cgroup v1: mounted as "cpu,cpuacct" or "cpu"
            for mount in dict.fromkeys((controllers, "cpu")):
                for d in ancestors:
                    quota = _read(base / mount / d / "cpu.cfs_quota_us")
                    period = _read(base / mount / d / "cpu.cfs_period_us")
                    if quota and period:
                        _add_limit(limits, quota, period)
    return min(limits) if limits else None


def _add_limit(limits: list[float], quota: str, period: str) -> None:
    """Appends quota / period where both are positive integers ("max" and -1 mean no limit)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return
    if q > 0 and p > 0:
        limits.append(q / p)


def numa_nodes(root: Path = Path("/")) -> list[set[int]]:
    """The CPUs of each NUMA node (empty where sysfs has no node directory)."""
    nodes = []
    for node in sorted((root / "sys/devices/system/node").glob("node[0-9]*")):
        text = _read(node / "cpulist")
        if text:
            nodes.append(parse_cpu_list(text))
    return nodes


@dataclass(frozen=True)
class ThreadChoice:
    threads: int
    reason: str  # what bounded the count, for the start-up log


def decide_torch_threads(cpus: set[int], root: Path = Path("/")) -> ThreadChoice:
    """The torch thread count for a process allowed ``cpus``; the host's files are read under ``root``
    (tests give a fake one). The smallest of:

    * the physical cores among ``cpus`` (one thread per core: a hyperthread sibling shares the
      core's vector units, which a matmul already keeps busy);
    * the cgroup's CPU quota, rounded down (at least 1): a thread beyond it is throttled, and every
      other OpenMP thread waits for it at the next barrier;
    * the allowed cores of the largest NUMA node, where they span several: torch's threads are not
      pinned to nodes nor its memory placed on them, so a team over two nodes reads half its weights
      from the far node's memory (vLLM's CPU backend likewise binds each rank to one node).
    """
    groups = core_groups(cpus, root)
    cores = len(cpus) if groups is None else len(groups)
    threads = max(1, cores)
    if groups is None:
        reason = f"{len(cpus)} CPUs allowed (hyperthreads not told apart: no sysfs topology)"
    elif len(groups) < len(cpus):
        reason = f"{cores} physical cores among the {len(cpus)} CPUs allowed"
    else:
        reason = f"{cores} cores allowed"
    quota = cpu_quota(root)
    if quota is not None and math.floor(quota) < threads:
        threads = max(1, math.floor(quota))
        reason = f"CPU quota {quota:g} of the {reason}"
    node_cores = []
    for node in numa_nodes(root):
        mine = node & cpus
        if mine:
            in_node = [g for g in groups if g <= node] if groups is not None else mine
            node_cores.append(len(in_node))
    if len(node_cores) > 1 and max(node_cores) < threads:
        threads = max(node_cores)
        reason = f"the largest NUMA node's share of the {reason} ({len(node_cores)} nodes)"
    return ThreadChoice(threads, reason)


@functools.cache
def host_torch_threads() -> ThreadChoice:
    """``decide_torch_threads`` for this process (its affinity and cgroup do not change under it)."""
    return decide_torch_threads(allowed_cpus())


def torch_threads(requested: int | None, source: str = "INFLIGHT_TORCH_THREADS", reserve: int = 0) -> int:
    """The thread count a serving process gives its engine: ``requested`` (an operator's setting,
    named by ``source`` in the log) when set, else the host's choice less ``reserve`` cores left to the
    process's own work, where the host has more than that; logged, so call it once at start."""
    if requested:
        log.info("torch threads: %d (set by %s)", requested, source)
        return requested
    choice = host_torch_threads()
    threads, reason = choice.threads, choice.reason
    if reserve and threads > reserve:
        threads -= reserve
        reason = f"{reason}, {reserve} left to the serving process"
    log.info("torch threads: %d (%s; %s overrides)", threads, reason, source)
    return threads


def limit_torch_threads() -> int:
    """The offline engine's rule: lower this process's torch thread count to the host's choice when
    it is higher (torch's default counts hyperthreads and ignores a CPU quota); a lower count set
    beforehand (``torch.set_num_threads``) stands, and so does any count when ``OMP_NUM_THREADS``
    is set. Returns the count in use."""
    import torch

    current = torch.get_num_threads()
    if os.environ.get("OMP_NUM_THREADS"):
        return current
    choice = host_torch_threads()
    if choice.threads < current:
        log.info("torch threads: %d instead of torch's %d (%s)", choice.threads, current, choice.reason)
        torch.set_num_threads(choice.threads)
        return choice.threads
    return current
