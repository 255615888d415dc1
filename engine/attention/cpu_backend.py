"""Attention through the C++ CPU kernels: K/V read in place through the block tables.

Decodes and short prefill chunks: no gather of whole contexts, no padding to a bucket, no masking
pass; each (request, kv head, query tile) is one work item of
``torch.ops.inflight_cpu.paged_attention`` (engine/kernels/cpu), bandwidth-bound like decode itself.

Long prefill chunks (>= ``PREFILL_SDPA_MIN`` query tokens) are compute-bound, O(L x context), where
torch's flash-attention SDPA (blocked GEMMs, AMX for bf16) is 2-3x faster than the kernel's
row-at-a-time loop: measured here for one 500-token prompt of SmolLM2's shape, 3.1 ms vs 8.5 ms in
bf16. For those the request's context is gathered once (O(context), small next to the attention)
and handed to SDPA with the bottom-right causal mask.

The cache is head-major (``KVLayout.HEAD_MAJOR``: each block's K and V of one kv head contiguous,
which the kernel streams) for the shapes the kernel takes. For the others (float16 caches, head sizes
that are not a multiple of 16) it is token-major and everything goes through the torch backend, so
this backend serves any model the engine loads and the fallback only ever sees the layout it knows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, KVLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu as cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PREFILL_SDPA_MIN = 32  # query tokens from which a request's chunk goes to SDPA


def kernel_supports(dtype: torch.dtype, head_size: int, device: torch.device) -> bool:
    """Whether the C++ kernels take a cache of this dtype and head size (head-major, then)."""
    return device.type == "cpu" and dtype in _KERNEL_DTYPES and head_size % 16 == 0 and head_size <= 256


def _on_kernel(kv_cache: torch.Tensor) -> bool:
    return kernel_supports(kv_cache.dtype, kv_cache.shape[-1], kv_cache.device)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the CPU attention kernels could not be built; use attention_backend='torch'")
        self._fallback = TorchAttentionBackend()

    def kv_layout(self, dtype: torch.dtype, head_size: int, device: torch.device) -> KVLayout:
        return KVLayout.HEAD_MAJOR if kernel_supports(dtype, head_size, device) else KVLayout.TOKEN_MAJOR

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # head-major [2, num_blocks, Hkv, block_size, D], else token-major
        metadata: AttentionMetadata,
    ) -> None:
        if not _on_kernel(kv_cache):
            self._fallback.store_kv(key, value, kv_cache, metadata)
            return
        # The model's K/V are in the cache's dtype; a caller's other dtype is rounded as the torch path would.
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        torch.ops.inflight_cpu.store_kv(key, value, kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # head-major [2, num_blocks, Hkv, block_size, D], else token-major
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        if not _on_kernel(kv_cache):
            return self._fallback.forward(query, kv_cache, metadata, scale)
        if query.dtype != kv_cache.dtype:  # not the engine's case: attend in the cache's dtype
            return self.forward(query.to(kv_cache.dtype), kv_cache, metadata, scale).to(query.dtype)
        # Every token of the step belongs to a request: the kernel writes the rows of short ones,
        # SDPA those of long chunks.
        out = torch.empty(query.shape, dtype=query.dtype)
        torch.ops.inflight_cpu.paged_attention(
            out,
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            PREFILL_SDPA_MIN - 1 if metadata.max_query_len >= PREFILL_SDPA_MIN else metadata.max_query_len,
        )
        if metadata.max_query_len >= PREFILL_SDPA_MIN:
            starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
            for r in range(metadata.num_seqs):
                q_start, q_end = starts[r], starts[r + 1]
                if q_end - q_start >= PREFILL_SDPA_MIN:
                    out[q_start:q_end] = _prefill_sdpa(
                        query[q_start:q_end], kv_cache, metadata.block_tables[r], lens[r], scale
                    )
        return out


def _prefill_sdpa(
    query: torch.Tensor,  # [L, Hq, D], the request's last L positions
    kv_cache: torch.Tensor,  # [2, num_blocks, Hkv, block_size, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [L, Hq, D]
    num_queries = query.shape[0]
    block_size = kv_cache.shape[3]
    blocks = block_table[: -(-seq_len // block_size)].long()
    # One copy of the context, whole pages: [2, Hkv, nb, block_size, D] -> [2, Hkv, N, D].
    kv = kv_cache.transpose(1, 2).index_select(2, blocks).flatten(2, 3)[:, :, :seq_len]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    if num_queries == seq_len:  # a whole prompt: the usual causal mask
        o = F.scaled_dot_product_attention(
            q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), is_causal=True, scale=scale, enable_gqa=True
        )
    else:  # a later chunk: query i sits at position N - L + i (bottom-right aligned)
        q_pos = torch.arange(seq_len - num_queries, seq_len)
        allowed = torch.arange(seq_len)[None, :] <= q_pos[:, None]
        o = F.scaled_dot_product_attention(
            q, kv[0].unsqueeze(0), kv[1].unsqueeze(0), attn_mask=allowed, scale=scale, enable_gqa=True
        )
    return o[0].transpose(0, 1)
