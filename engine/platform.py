"""What the host can do, decided from the host: CPU features, the CPU's best dtype, thread count.

bfloat16 pays on a CPU only when it has bf16 matmul units: measured on 2-core hosts, one with
AVX512_BF16 ran bf16 matmuls 2.5x faster than fp32 and one with AMX 3x faster, while one with AVX2
only ran them at 0.3 GFLOP/s against 127 for fp32. So ``dtype="auto"`` on CPU asks the CPU.

The thread count (``host_torch_threads``): torch's own default is one thread per CPU the OpenMP
runtime sees, which ignores a container's CPU quota (a Kubernetes CPU limit, ``docker --cpus``) and
counts hyperthreads. OpenMP threads spin-wait for each other at every parallel region, so a thread
whose CPU time is throttled away, or that shares a core with its sibling, holds the whole team up.

Torch-free at import: the worker process (which never runs the model itself) decides its engine
core's thread count from here.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Flags that mean the CPU multiplies bf16 natively (oneDNN then uses them for bf16 GEMMs).
_BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")
# Lets an operator (or a test suite comparing against float32 references) override the probe.
AUTO_DTYPE_ENV = envs.CPU_AUTO_DTYPE.name


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in /proc/cpuinfo (empty where there is no such file)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


@functools.cache
def cpu_model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def cpu_has_bf16_matmul() -> bool:
    return any(flag in cpu_flags() for flag in _BF16_MATMUL_FLAGS)


@functools.cache
def cpu_auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU has bf16 matmul units, float32 elsewhere; logged once."""
    import torch

    forced = envs.cpu_auto_dtype()
    if forced:
        dtype = torch.float32 if forced == "float32" else torch.bfloat16
        log.info("dtype auto on CPU: %s (set by %s)", forced, AUTO_DTYPE_ENV)
        return dtype
    units = [flag for flag in _BF16_MATMUL_FLAGS if flag in cpu_flags()]
    dtype = torch.bfloat16 if units else torch.float32
    log.info(
        "dtype auto on CPU: %s (%s; bf16 matmul units: %s)",
        str(dtype).removeprefix("torch."),
        cpu_model_name(),
        ", ".join(units) or "none",
    )
    return dtype


def parse_cpu_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set of CPU numbers."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except (OSError, ValueError):
        return None


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


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it accepts on 64-bit hosts.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MMAP_THRESHOLD = 32 << 20
_TRIM_THRESHOLD = 512 << 20
# Set by the user: their malloc configuration stands.
_MALLOC_ENV = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


@functools.cache
def reuse_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse in this process; True when it now does.

    A step's activations are tensors of hundreds of KiB to tens of MiB. glibc serves those above its
    mmap threshold (128 KiB, raised only as such blocks are freed) with fresh mappings, and gives the
    top of its heap back once more than the trim threshold is free, so the next step touches new pages:
    on SmolLM2-135M, a 2,048-token prefill step took about 100,000 minor page faults (400 MB) and 9% of
    its time. With these two thresholds raised, the step runs on pages it already has. Memory held is
    the step's high-water mark, which the next step needs again anyway. Blocks over 32 MiB (the largest
    threshold glibc accepts) are still mapped per allocation. Once per process; off with
    ``INFLIGHT_CPU_MALLOC=system``, another allocator than glibc's, or ``MALLOC_*`` variables set.
    """
    import ctypes
    import platform

    if envs.cpu_malloc() != "reuse" or any(os.environ.get(name) for name in _MALLOC_ENV):
        return False
    if platform.libc_ver()[0] != "glibc" or "malloc" in os.environ.get("LD_PRELOAD", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD))
    ok = ok and bool(mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD))
    log.info("malloc: freed memory kept for reuse" if ok else "malloc: glibc refused the thresholds")
    return ok


def freeze_heap() -> int:
    """Take what a long-running process has built at start-up out of the cyclic collector's sight, and
    return how many objects that is.

    Python's full collection walks every tracked object. With torch and a model loaded that is about
    190,000 objects and 40-50 ms on one core, and it runs whenever enough new objects have survived,
    in the middle of whatever the process was doing: in the engine core, a stall of every running
    request's step; in a worker or gateway, a stalled event loop with tokens and requests behind it.
    Frozen objects are never collected and never walked again, so this runs once everything that lives
    as long as the process exists, after a collection that clears the garbage start-up left behind.
    """
    import gc

    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


_HUGE_PAGE = 2 << 20  # x86-64's transparent huge page
_THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_page_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor in fresh memory that Linux is asked to back with 2 MiB pages (``madvise``).

    For the KV cache. A decode step reads each sequence's blocks, pages of a few KiB scattered over a
    cache of hundreds of MiB or more: on 4 KiB pages nearly every block is a TLB miss and a page walk,
    and the attention kernel read K/V from memory 6-7% slower than from the same cache on huge pages at
    64 sequences of 300 tokens and 10-13% slower at 16 of 3,000 (SmolLM2's shape, one thread, a Zen 5
    host; ``python -m bench.cpu_attention_bench --small-pages``). Most distributions and Kubernetes
    nodes ship transparent huge pages in ``madvise`` mode, which gives them only to memory that asks
    before it is first touched: so the tensor gets its own mapping, not memory from malloc's heap that
    earlier allocations may have touched. Where the mode is ``never`` (or there is no such setting, or
    the tensor is under 2 MiB, or ``INFLIGHT_CPU_HUGE_PAGES=off``) this is ``torch.zeros``.
    """
    import torch

    fresh = _huge_page_tensor(shape, dtype)
    if fresh is None:
        return torch.zeros(shape, dtype=dtype)
    # Zeroing touches every page now: the memory is faulted in at start-up, not mid-step.
    return fresh.zero_()


def on_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of CPU tensor ``t`` on memory advised as ``huge_page_zeros``'s is; ``t`` itself
    where that cannot be (under 2 MiB, or no transparent huge pages here)."""
    fresh = _huge_page_tensor(tuple(t.shape), t.dtype)
    return t if fresh is None else fresh.copy_(t)


def _huge_page_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """An untouched tensor on its own huge-page-advised mapping, or None where that cannot be."""
    import mmap

    import torch

    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < _HUGE_PAGE or not envs.cpu_huge_pages() or not thp_available():
        return None
    # One huge page more than asked, to start on a huge page boundary; untouched, the slack costs
    # address space, not memory. The tensor holds the mapping: it is unmapped when the tensor goes.
    buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    try:
        buf.madvise(mmap.MADV_HUGEPAGE, start, nbytes - nbytes % _HUGE_PAGE)
    except OSError as exc:  # refused: the memory is still good, on 4 KiB pages
        log.debug("madvise(MADV_HUGEPAGE) refused: %s", exc)
    return raw[start : start + nbytes].view(dtype).view(shape)


@functools.cache
def thp_available() -> bool:
    """Whether this host's kernel gives transparent huge pages to memory that asks (mode ``always``
    or ``madvise``)."""
    import mmap

    mode = _read(_THP_MODE) or ""
    return hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)
