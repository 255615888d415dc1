"""Which implementation the layers of one engine run: decided once by the model runner, read by each
layer when it is built (``CustomOp.__init__``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.models import amx_gemm, cpu_gemm, onednn


@dataclass
class Kernels:
    """``triton``: a GPU engine's Triton kernels; ``cpu``: the C++ CPU kernels (engine/kernels/cpu, for
    float32 and bfloat16 models); neither: torch, the reference."""

    triton: bool = False
    cpu: bool = False
    # On CPU, who multiplies the linear layers (engine/models/cpu_gemm.py): the engine's own kernels on
    # column-panel weights ("inflight"), oneDNN's packed weights ("onednn"), or torch's matmul.
    gemm: cpu_gemm.Gemm = "torch"
    # oneDNN's packing (the engine's choice, or where its own kernels cannot take a weight): 0 = off;
    # else the batch size it targets. In bf16 a decode step's small GEMMs otherwise repack every
    # weight on every call: 1.4-1.6x slower at 16-64 rows, measured on SmolLM2's shapes.
    prepack_rows: int = 0
    # With oneDNN's packed weights, a step's row count is rounded up to whole GEMM tiles (engine/models/
    # onednn.py) up to this many rows (the token budget); None: not padded.
    row_padding: onednn.RowPadding | None = None
    # On an AMX CPU, bf16 GEMMs of up to this many rows read oneDNN's packed weights on the engine's own
    # tile kernel (engine/models/amx_gemm.py); 0: oneDNN at every size.
    amx_rows: int = 0

    @property
    def label(self) -> str:
        """Who multiplies the linear layers, as the engine's start-up line says it."""
        return f"{self.gemm} (AMX tiles up to {self.amx_rows} rows)" if self.amx_rows else self.gemm

    @property
    def packed(self) -> bool:
        return self.gemm == "inflight" or self.prepack_rows > 0

    def pack(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` [out, in] in the layout this engine's linear kernel reads (unchanged off CPU)."""
        if self.gemm == "inflight" and cpu_gemm.packable(weight):
            return cpu_gemm.pack(weight)
        if not self.prepack_rows or weight.dim() != 2 or weight.dtype not in (torch.float32, torch.bfloat16):
            return weight
        packed = onednn.pack(weight, self.prepack_rows)
        if self.amx_rows:
            amx_gemm.attach(packed, weight)
        return packed

    def padded_rows(self, n: int) -> int:
        return n if self.row_padding is None else self.row_padding.padded(n)


TORCH = Kernels()


class CustomOp:
    """A layer with one implementation per device: ``forward_native`` (torch, the reference),
    ``forward_cpu`` (the C++ kernels) and ``forward_cuda`` (Triton). ``__call__`` is bound to one of
    them when the layer is built, so a step pays no dispatch."""

    def __init__(self, kernels: Kernels) -> None:
        self.kernels = kernels
        impl: Callable[..., Any] = self.forward_native
        if kernels.cpu:
            impl = self.forward_cpu
        elif kernels.triton:
            impl = self.forward_cuda
        self._impl = impl

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._impl(*args, **kwargs)

    def forward_native(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError

    def forward_cpu(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)

    def forward_cuda(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward_native(*args, **kwargs)
