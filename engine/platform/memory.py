"""Memory as a long-running serving process wants it: freed memory kept for reuse (glibc's malloc), the
start-up heap frozen out of the cyclic collector's walks, and big tensors on transparent huge pages.

Torch-free at import: the gateway and the worker freeze their heaps from here.
"""

from __future__ import annotations

import functools
import logging
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING

from engine import envs
from engine.platform._files import read_host_file as _read

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

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
