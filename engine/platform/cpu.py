"""The CPU's features and its best dtype.

bfloat16 pays on a CPU only when it has bf16 matmul units: measured on 2-core hosts, one with
AVX512_BF16 ran bf16 matmuls 2.5x faster than fp32 and one with AMX 3x faster, while one with AVX2
only ran them at 0.3 GFLOP/s against 127 for fp32. So ``dtype="auto"`` on CPU asks the CPU.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


def release_freed_heap() -> None:
    """Hands the pages glibc's heap holds free back to the OS (``malloc_trim``). Loading leaves many:
    a checkpoint's float tensors quantized and dropped, kernel and packing scratch, each a few MB and
    interleaved with live allocations, which glibc keeps for reuse. Measured on the default model with
    ``quantization="fp8"``: the heap after start-up 234-556 MiB across runs, 211 MiB after this; the
    process's resident memory is then what it serves with, run to run. A no-op off glibc."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Any:
    import ctypes

    try:
        return ctypes.CDLL(None).malloc_trim  # the process's own symbols: libc's where it is glibc
    except (OSError, AttributeError):  # musl and others have no malloc_trim
        return None
