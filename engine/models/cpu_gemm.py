"""Linear layers on CPU through the engine's own packed kernels (engine/kernels/cpu/gemm.cpp), and
which linear path a CPU engine takes.

Why its own. A decode step multiplies each weight by a few to a few tens of rows, so it streams every
weight from memory once; oneDNN's packed kernels read them slower than a core can stream them there.
Measured on a 2-core AMD EPYC (Zen 5, AVX512_BF16, no AMX), SmolLM2-135M's linear layers and LM head
at one thread (``python -m bench.cpu_gemm_bench``), bf16: oneDNN 10.1 / 14.6 / 19.4 / 46.6 ms at
1 / 8 / 16 / 64 rows, these kernels 7.6 / 10.6 / 15.6 / 43.6 ms; float32: 17.9 / 25.4 / 32.6 / 86.4
against 15.2 / 20.7 / 28.4 / 82.9. At prefill sizes (256-1,024 rows) the multiply units bound both,
within 1-3% of each other. No row padding either: nothing is built per row count.

Which path (``INFLIGHT_CPU_GEMM``, default ``auto``): these kernels where the CPU has their
instructions (AVX-512 for float32; AVX512_BF16 for bf16), except bf16 on an AMX CPU: there oneDNN
multiplies bf16 on AMX's tiles, and these kernels fall behind from 16 rows on (an AMX Xeon, one thread:
38.7 ms at 16 rows against oneDNN's 13.0; 19.5 against 16.4 at one row), and at decode sizes the
engine's tile kernel reads oneDNN's packed weights (engine/models/amx_gemm.py); else oneDNN's packed
weights where torch and the CPU can pack (engine/models/onednn.py); else torch's own matmul. A weight
whose out features are not a multiple of 16 stays with oneDNN (or torch) under any choice.
"""

from __future__ import annotations

from typing import Literal

import torch

from engine import envs
from engine.models import onednn
from engine.platform.cpu import cpu_flags
from engine.platform.memory import on_huge_pages

Gemm = Literal["inflight", "onednn", "torch"]

_FLAGS: dict[torch.dtype, tuple[str, ...]] = {
    torch.float32: ("avx512f",),
    torch.bfloat16: ("avx512f", "avx512_bf16"),
}


def supported(dtype: torch.dtype) -> bool:
    """The packed kernels run here for ``dtype``: the C++ ops are loaded and the CPU has the
    instructions (asked of both /proc/cpuinfo and the compiled code's own CPU check)."""
    if dtype not in _FLAGS or not all(f in cpu_flags() for f in _FLAGS[dtype]):
        return False
    return hasattr(torch.ops.inflight_cpu, "packed_linear_supported") and bool(
        torch.ops.inflight_cpu.packed_linear_supported(dtype)
    )


def choose(dtype: torch.dtype, cpu_kernels: bool) -> Gemm:
    """The linear path of a CPU engine of ``dtype``; ``cpu_kernels``: the C++ ops are loaded."""
    wanted = envs.cpu_gemm()
    if wanted == "torch":
        return "torch"
    own = cpu_kernels and supported(dtype)
    if wanted == "inflight" and own:
        return "inflight"
    amx = dtype == torch.bfloat16 and "amx_bf16" in cpu_flags()
    if wanted == "auto" and own and not amx:
        return "inflight"
    return "onednn" if onednn.can_prepack(dtype) else "torch"


def packable(weight: torch.Tensor) -> bool:
    """Whole vectors of out features, and (bf16) whole pairs of in features, so that ``features``
    reads both back from the panels."""
    if weight.dim() != 2 or weight.dtype not in _FLAGS or weight.shape[0] % 16:
        return False
    return weight.dtype == torch.float32 or weight.shape[1] % 2 == 0


def features(weight: torch.Tensor) -> tuple[int, int]:
    """(out, in) features of a weight as a model holds it: plain, packed by oneDNN (which keeps the
    shape) or in column panels."""
    if weight.dim() == 3:
        return weight.shape[0] * 16, weight.shape[1] * (2 if weight.dtype == torch.bfloat16 else 1)
    return weight.shape[0], weight.shape[1]


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in column panels: a 3-D carrier tensor (gemm.cpp says what it holds), which
    is how ``ModelOps.linear`` tells it from a plain or oneDNN-packed weight."""
    packed: torch.Tensor = torch.ops.inflight_cpu.pack_linear(weight)
    # Every step streams each weight front to back: on 2 MiB pages (where the host gives them) that
    # stream runs 1-10% faster at 1-16 rows (SmolLM2's layers, Zen 5), one TLB miss per 2 MiB, not 4 KiB.
    return on_huge_pages(packed)


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    out: torch.Tensor = torch.ops.inflight_cpu.packed_linear(x, packed, bias)
    return out
