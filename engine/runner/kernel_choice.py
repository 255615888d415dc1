"""Which kernels an engine's layers run (``Kernels``), decided once from its configuration, its device
and the host: Triton on a GPU; on a CPU the C++ ops, who multiplies the linear layers (the engine's own
panels, oneDNN, torch: engine/models/cpu_gemm.py), whether oneDNN packs, whether a step's rows are
padded to whole GEMM tiles, and up to how many rows the AMX tile kernel takes (engine/models/amx_gemm.py).
"""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.layers.kernels import Kernels
from engine.models import amx_gemm, cpu_gemm, onednn


def choose_kernels(config: EngineConfig, device: torch.device, kept_quantized: bool) -> Kernels:
    """``kept_quantized``: some weights stay in a block or int8 format (their kernels take any row
    count, so the step's rows are not padded)."""
    use_triton_ops = config.attention_backend == "triton" and device.type == "cuda"
    # The C++ pointwise ops come with the C++ attention (same build), for the dtypes they take.
    use_cpu_kernels = config.attention_backend == "cpu" and config.dtype in (torch.float32, torch.bfloat16)
    gemm = cpu_gemm.choose(config.dtype, cpu_kernels=True) if use_cpu_kernels else "torch"
    # oneDNN packs what the engine's own kernels do not take (all of it when it is the choice).
    prepack = gemm != "torch" and onednn.can_prepack(config.dtype)
    max_rows = max(config.max_num_batched_tokens, config.max_num_seqs)
    return Kernels(
        triton=use_triton_ops,
        cpu=use_cpu_kernels,
        gemm=gemm,
        prepack_rows=config.max_num_seqs if prepack else 0,
        amx_rows=amx_gemm.MAX_ROWS if use_cpu_kernels and prepack and amx_gemm.enabled(config.dtype) else 0,
        row_padding=(
            onednn.RowPadding(onednn.row_grain(config.dtype), max_rows)
            if prepack and gemm == "onednn" and not kept_quantized
            else None
        ),
    )
