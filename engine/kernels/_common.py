"""Launcher helpers shared by the Triton kernels."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine.kernels import kv_quant

# The interpreter (TRITON_INTERPRET=1, CPU tensors) has no real device; a modest SM count keeps the
# split-K heuristic exercised in CPU tests without exploding the grid.
_INTERPRETER_SM_COUNT = 8


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    """The layout every kernel assumes: [2, num_blocks, block_size, Hkv, D], contiguous; an 8-bit
    cache's rows are D + 4 elements (engine/kernels/kv_quant.py)."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache shape {tuple(kv_cache.shape)}"
    row = kv_quant.row_elements(kv_cache.dtype, head_size)
    assert kv_cache.shape[3:] == (num_kv_heads, row), (tuple(kv_cache.shape), num_kv_heads, head_size)
    assert kv_cache.is_contiguous(), "kv_cache must be contiguous"
    block_size = kv_cache.shape[2]
    assert block_size >= 1 and block_size & (block_size - 1) == 0, f"block_size {block_size} not a power of 2"


def is_interpreted(t: torch.Tensor) -> bool:
    """Kernels only ever see CPU tensors under the Triton interpreter."""
    return t.device.type == "cpu"


@functools.lru_cache(maxsize=8)
def _cuda_sm_count(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return _INTERPRETER_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class DecodeConfig:
    """Launch parameters of the decode attention variant; None keeps the launcher's default.

    The defaults (BLOCK_N 64 at head 128 in 16 bits, 4 warps, Triton's default pipelining) were
    chosen before any GPU measured them: ``bench.kernel_bench --sweep`` times the alternatives per
    shape and prints the best, and the engine passes what it should use through the backend."""

    block_n: int | None = None  # KV positions per iteration: a power of two >= 16 (tl.dot's minimum)
    num_warps: int | None = None  # a power of two
    num_stages: int | None = None  # software-pipelining depth of the K/V loads (block-table gathers)

    def __post_init__(self) -> None:
        if self.block_n is not None and (self.block_n < 16 or self.block_n & (self.block_n - 1)):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps is not None and (self.num_warps < 1 or self.num_warps & (self.num_warps - 1)):
            raise ValueError(f"num_warps must be a power of two, got {self.num_warps}")
        if self.num_stages is not None and self.num_stages < 1:
            raise ValueError(f"num_stages must be >= 1, got {self.num_stages}")
