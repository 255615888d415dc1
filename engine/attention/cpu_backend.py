"""Attention through the C++ CPU kernels: K/V read in place through the block tables.

No gather of whole contexts, no padding to a bucket, no masking pass: each (request, kv head, query
tile) is one work item of ``torch.ops.inflight_cpu.paged_attention`` (engine/kernels/cpu). Shapes
the kernel does not take (float16 caches, head sizes that are not a multiple of 16) go through the
torch backend, so this backend serves any model the engine loads.
"""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu as cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)


def kernel_supports(kv_cache: torch.Tensor) -> bool:
    return (
        kv_cache.device.type == "cpu"
        and kv_cache.dtype in _KERNEL_DTYPES
        and kv_cache.shape[-1] % 16 == 0
        and kv_cache.shape[-1] <= 256
    )


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the CPU attention kernels could not be built; use attention_backend='torch'")
        self._fallback = TorchAttentionBackend()

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> None:
        if not kernel_supports(kv_cache) or key.dtype != kv_cache.dtype:
            self._fallback.store_kv(key, value, kv_cache, metadata)
            return
        torch.ops.inflight_cpu.store_kv(key, value, kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        if not kernel_supports(kv_cache) or query.dtype != kv_cache.dtype:
            return self._fallback.forward(query, kv_cache, metadata, scale)
        # Every token of the step belongs to a request, so the kernel writes every row.
        out = torch.empty(query.shape, dtype=query.dtype)
        torch.ops.inflight_cpu.paged_attention(
            out,
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
        )
        return out
