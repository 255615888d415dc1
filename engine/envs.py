"""The engine's own environment variables, declared in one place (the cache paths are read by
``engine/paths.py``, the others through the functions below).

The engine imports no service code, so it cannot use the services' settings module; the services'
settings (``services/common/settings.py``) import ``ENGINE_ENVS`` instead, so none of these is logged as
unknown, and the configuration reference (``docs/configuration.md``) lists them from here.

Each is read when asked for, not at import: tests and the benchmark harness set them per process.
Torch-free: the gateway imports this module through the settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine import paths

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class EnvVar:
    """One variable: its name, the kind of value it takes, its default as a user reads it, what it does."""

    name: str
    kind: str  # "path" | "bool" | "float32|bfloat16"
    default: str
    doc: str


HOME = EnvVar(
    paths.HOME_ENV,
    "path",
    "$XDG_CACHE_HOME/inflight, else ~/.cache/inflight",
    "Cache root: converted GGUF checkpoints (`models/gguf/`) and generated checkpoints such as the tiny "
    "model (`models/tiny-llama`). Read by `engine/paths.py`.",
)
CPU_AUTO_DTYPE = EnvVar(
    "INFLIGHT_CPU_AUTO_DTYPE",
    "float32|bfloat16",
    "(probe the CPU)",
    'What `dtype="auto"` means on a CPU. Unset, bfloat16 where the CPU has bf16 matmul units '
    "(AVX512_BF16 or AMX), float32 elsewhere: without them bf16 matmuls run hundreds of times slower.",
)
CPU_EXT_DIR = EnvVar(
    paths.CPU_EXT_ENV,
    "path",
    "$XDG_CACHE_HOME/inflight/cpu_ext, else ~/.cache/inflight/cpu_ext",
    "Build folders of the C++ CPU kernels (one per source, flags and torch version). Not under "
    "`INFLIGHT_HOME`, so a temporary model cache costs no rebuild. Read by `engine/paths.py`.",
)
DISABLE_CPU_KERNELS = EnvVar(
    "INFLIGHT_DISABLE_CPU_KERNELS",
    "bool",
    "false",
    'true: never build or load the C++ CPU kernels; `attention_backend="auto"` then runs the torch path.',
)
CPU_GEMM = EnvVar(
    "INFLIGHT_CPU_GEMM",
    "auto|inflight|onednn|torch",
    "auto",
    "The CPU engine's linear layers. `inflight`: weights packed once into column panels for the "
    "engine's own AVX-512 kernels (float32; bf16 with AVX512_BF16), faster than oneDNN's at decode "
    "sizes; `onednn`: weights packed into oneDNN's blocked layout (on AMD CPUs torch's float32 matmul, "
    "MKL's sgemm, is 2-2.5x slower); `torch`: plain weights and torch's own matmul. `auto`: `inflight` "
    "where the CPU has the instructions and no AMX (whose bf16 tiles oneDNN uses), else `onednn` where "
    "torch and the CPU can pack, else `torch`; on an AMX CPU `auto` also runs bf16 GEMMs of up to 64 "
    "rows (decode steps) on the engine's own AMX tile kernel over oneDNN's packed weights, in place, "
    "where `onednn` keeps oneDNN at every size.",
)
CPU_MALLOC = EnvVar(
    "INFLIGHT_CPU_MALLOC",
    "reuse|system",
    "reuse",
    "The CPU engine's process and glibc's malloc: `reuse` keeps freed memory mapped (mmap threshold 32 "
    "MiB, trim threshold 512 MiB) so each step's activations land on pages already mapped instead of "
    "page-faulting fresh ones; `system` leaves malloc as configured (a preloaded tcmalloc or jemalloc, or "
    "your own `MALLOC_*` variables, which also keep it untouched).",
)
CPU_HUGE_PAGES = EnvVar(
    "INFLIGHT_CPU_HUGE_PAGES",
    "madvise|off",
    "madvise",
    "The CPU engine's KV cache and packed linear weights: `madvise` puts each in its own mapping advised "
    "for transparent huge pages (2 MiB; the KV cache's scattered blocks then cost no TLB miss each, and "
    "decode attention read them 5-13% faster on a Zen 5 host), which the kernel honours in THP mode "
    "`always` or `madvise` (`/sys/kernel/mm/transparent_hugepage/enabled`); `off` keeps torch's own "
    "allocations on 4 KiB pages.",
)
CPU_PREFILL_ATTENTION = EnvVar(
    "INFLIGHT_CPU_PREFILL_ATTENTION",
    "auto|kernel|sdpa",
    "auto",
    "The CPU engine's attention for prefill chunks of 32 or more tokens: `auto` times the C++ kernel and "
    "torch's flash SDPA once per attention shape at start-up and takes SDPA only where it is clearly "
    "faster; `kernel` or `sdpa` forces one.",
)
QUANT_INT8_ACTIVATIONS = EnvVar(
    "INFLIGHT_QUANT_INT8_ACTIVATIONS",
    "bool",
    "false",
    "GGUF block-format weights on a CPU with AVX2: true rounds the rows multiplied by them to int8 blocks "
    "of 32 (llama.cpp's way) at every row count, and multiplies a few rows (a decode step; the bound per "
    "format is `INT8_ACTIVATION_MAX_ROWS` in `engine/quant/linear.py`) with integer dot products (AVX-512 "
    "VNNI, else AVX2), about 1.7x the batch-1 decode speed of Q4_0/Q4_1/Q8_0; more rows multiply the "
    "rounded rows in float, so a row's result does not depend on the batch it shares. Off by default: the "
    "rounding costs accuracy (perplexity +0.5% on the default model) and moves greedy text away from the "
    "float reference's where two tokens are near a tie; false multiplies the dequantized weight by the "
    "rows as they are.",
)

TP_TIMEOUT_S = EnvVar(
    "INFLIGHT_TP_TIMEOUT_S",
    "seconds",
    "120",
    "Tensor parallelism: the longest a rank waits in one collective (an all-reduce, the logits gather, "
    "start-up) before the engine fails; a rank that hangs ends the engine after this long.",
)

ENGINE_ENVS: tuple[EnvVar, ...] = (
    HOME,
    CPU_AUTO_DTYPE,
    CPU_EXT_DIR,
    DISABLE_CPU_KERNELS,
    CPU_GEMM,
    CPU_MALLOC,
    CPU_HUGE_PAGES,
    CPU_PREFILL_ATTENTION,
    QUANT_INT8_ACTIVATIONS,
    TP_TIMEOUT_S,
)


def cpu_gemm() -> str:
    """``INFLIGHT_CPU_GEMM``: who multiplies the CPU engine's linear layers (``auto``, ``inflight``,
    ``onednn`` or ``torch``; engine/models/cpu_gemm.py decides what ``auto`` means on this host)."""
    value = os.environ.get(CPU_GEMM.name, "").strip().lower() or CPU_GEMM.default
    if value not in ("auto", "inflight", "onednn", "torch"):
        raise ValueError(f"{CPU_GEMM.name} must be auto, inflight, onednn or torch, got {value!r}")
    return value


def cpu_malloc() -> str:
    """``INFLIGHT_CPU_MALLOC``: whether the CPU engine tunes glibc's malloc (``reuse``) or not."""
    value = os.environ.get(CPU_MALLOC.name, "").strip().lower() or CPU_MALLOC.default
    if value not in ("reuse", "system"):
        raise ValueError(f"{CPU_MALLOC.name} must be reuse or system, got {value!r}")
    return value


def cpu_huge_pages() -> bool:
    """``INFLIGHT_CPU_HUGE_PAGES``: whether the CPU engine asks for transparent huge pages."""
    value = os.environ.get(CPU_HUGE_PAGES.name, "").strip().lower() or CPU_HUGE_PAGES.default
    if value not in ("madvise", "off"):
        raise ValueError(f"{CPU_HUGE_PAGES.name} must be madvise or off, got {value!r}")
    return value == "madvise"


def cpu_prefill_attention() -> str:
    """``INFLIGHT_CPU_PREFILL_ATTENTION``: ``auto`` (time both paths), ``kernel`` or ``sdpa``."""
    value = os.environ.get(CPU_PREFILL_ATTENTION.name, "").strip().lower() or CPU_PREFILL_ATTENTION.default
    if value not in ("auto", "kernel", "sdpa"):
        raise ValueError(f"{CPU_PREFILL_ATTENTION.name} must be auto, kernel or sdpa, got {value!r}")
    return value


def cpu_auto_dtype() -> str | None:
    """``"float32"`` or ``"bfloat16"`` when set; None lets the engine probe the CPU."""
    value = os.environ.get(CPU_AUTO_DTYPE.name, "").strip()
    if not value:
        return None
    if value not in ("float32", "bfloat16"):
        raise ValueError(f"{CPU_AUTO_DTYPE.name} must be float32 or bfloat16, got {value!r}")
    return value


def cpu_kernels_disabled() -> bool:
    value = os.environ.get(DISABLE_CPU_KERNELS.name, "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{DISABLE_CPU_KERNELS.name} must be true or false, got {value!r}")


def quant_int8_activations() -> bool:
    """``INFLIGHT_QUANT_INT8_ACTIVATIONS``: whether block-format weights may take the integer path."""
    value = os.environ.get(QUANT_INT8_ACTIVATIONS.name, "").strip().lower() or QUANT_INT8_ACTIVATIONS.default
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"{QUANT_INT8_ACTIVATIONS.name} must be true or false, got {value!r}")


def tp_timeout_s() -> float:
    value = os.environ.get(TP_TIMEOUT_S.name, "").strip()
    if not value:
        return 120.0
    seconds = float(value)
    if not seconds > 0:
        raise ValueError(f"{TP_TIMEOUT_S.name} must be > 0, got {value!r}")
    return seconds
