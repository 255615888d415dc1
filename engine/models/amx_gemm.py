"""bf16 linear layers at decode sizes on AMX tiles (engine/kernels/cpu/amx_gemm.cpp), over the very
memory of oneDNN's packed weights: no second copy.

Why. On an AMX CPU oneDNN's tile kernels take the prefill's many rows, but at a decode step's few rows
they read the weights slower than one core streams them; this kernel streams each weight once per
call. SmolLM2-135M's linear layers and LM head, one thread, an AMX Xeon (``python -m
bench.cpu_gemm_bench``): docs/benchmarks.md has the figures by row count; ``MAX_ROWS`` is where oneDNN
catches up.

How the weights are shared. oneDNN keeps a packed weight in an opaque tensor; its memory, for the
shapes a linear layer has, is a run of column panels in the pair layout AMX's B tiles read. ``attach``
views that memory as a plain [panels, k / 2, width, 2] tensor and proves the layout before it trusts
it: the view must equal the plain weight rearranged, element for element. A weight whose packing is
anything else (another oneDNN version, a shape it blocks otherwise) keeps oneDNN at every size.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from engine import envs
from engine.platform.cpu import cpu_flags

# Rows up to which a step's linear runs here (a multiple of 16: AMX's tile rows, and the grain the
# engine pads a step's rows to on these CPUs). Past it oneDNN's blocking of the rows wins.
MAX_ROWS = 64
TILE_ROWS = 16  # the kernel takes rows in whole tiles
_WIDTHS = (32, 64, 16, 48)  # panel widths to try, the one oneDNN picked for SmolLM2's shapes first
_ATTR = "_inflight_amx_panels"


@functools.cache
def supported() -> bool:
    """The C++ op is loaded, the CPU has AMX's bf16 tiles and the kernel gave them to this process."""
    return (
        "amx_bf16" in cpu_flags()
        and hasattr(torch.ops.inflight_cpu, "amx_linear_supported")
        and bool(torch.ops.inflight_cpu.amx_linear_supported())
    )


def enabled(dtype: torch.dtype) -> bool:
    """A CPU engine of ``dtype`` whose oneDNN-packed weights run here at decode sizes: bf16, where the
    kernel runs, unless ``INFLIGHT_CPU_GEMM`` names a path (``onednn`` then means oneDNN at every size)."""
    return dtype == torch.bfloat16 and envs.cpu_gemm() == "auto" and supported()


def _view(packed: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's packed bytes as a flat bf16 tensor sharing them (None where torch cannot say where)."""
    try:
        nbytes = int(torch.ops.mkldnn._nbytes(packed))
        address = int(torch.ops.mkldnn.data_ptr(packed))
    except (AttributeError, RuntimeError):
        return None
    if nbytes <= 0 or address == 0:
        return None
    buffer = (ctypes.c_char * nbytes).from_address(address)
    return torch.frombuffer(buffer, dtype=torch.bfloat16)


def attach(packed: torch.Tensor, weight: torch.Tensor) -> bool:
    """Let ``packed`` (``weight`` [out, in] packed by oneDNN) run here at decode sizes; False (and
    nothing changed) where its layout is not the panels this kernel reads."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or not packed.is_mkldnn:
        return False
    n, k = weight.shape
    if k % 32 or n % 16:
        return False
    flat = _view(packed)
    if flat is None or flat.numel() != n * k:
        return False
    for width in _WIDTHS:
        if n % width:
            continue
        panels = flat.view(n // width, k // 2, width, 2)
        # The panel layout, read from the plain weight: [n / width, width, k / 2, 2] -> pairs outer.
        if torch.equal(panels, weight.view(n // width, width, k // 2, 2).transpose(1, 2)):
            setattr(packed, _ATTR, panels)
            return True
    return False


def panels_for(packed: torch.Tensor, rows: int, max_rows: int) -> torch.Tensor | None:
    """The panels of ``packed`` where a GEMM of ``rows`` rows runs here (whole tiles, at most
    ``max_rows``), else None: oneDNN's."""
    if rows > max_rows or rows % TILE_ROWS:
        return None
    return panels_of(packed)


def panels_of(packed: torch.Tensor) -> torch.Tensor | None:
    """The panels ``attach`` proved for ``packed``, or None. They are ``packed``'s own memory and do not
    keep it alive (a reference back would make a cycle of every weight): use them while holding
    ``packed``, as a layer does."""
    found: torch.Tensor | None = getattr(packed, _ATTR, None)
    return found


def linear(x: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if x.stride(-1) != 1:
        x = x.contiguous()
    out: torch.Tensor = torch.ops.inflight_cpu.amx_linear(x, panels, bias)
    return out
