"""Launcher helpers shared by the Triton kernels."""

from __future__ import annotations

import functools

import torch

# The interpreter (TRITON_INTERPRET=1, CPU tensors) has no real device; a modest SM count keeps the
# split-K heuristic exercised in CPU tests without exploding the grid.
_INTERPRETER_SM_COUNT = 8


def check_kv_cache(kv_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    """The layout every kernel assumes: [2, num_blocks, block_size, Hkv, D], contiguous."""
    assert kv_cache.dim() == 5 and kv_cache.shape[0] == 2, f"bad kv_cache shape {tuple(kv_cache.shape)}"
    assert kv_cache.shape[3:] == (num_kv_heads, head_size), (tuple(kv_cache.shape), num_kv_heads, head_size)
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
