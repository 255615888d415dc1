"""Attention through the C++ CPU kernels: K/V read in place through the block tables.

Decodes and short prefill chunks: no gather of whole contexts, no padding to a bucket, no masking
pass; each (request, kv head, query tile) is one work item of
``torch.ops.inflight_cpu.paged_attention`` (engine/kernels/cpu), bandwidth-bound like decode itself.

Long prefill chunks (>= ``PREFILL_SDPA_MIN`` query tokens) are compute-bound, O(L x context), where
torch's flash-attention SDPA (blocked GEMMs, AMX for bf16) is 2-3x faster than the kernel's
row-at-a-time loop: measured here for one 500-token prompt of SmolLM2's shape, 3.1 ms vs 8.5 ms in
bf16. For those the request's context is gathered once (O(context), small next to the attention)
and handed to SDPA with the bottom-right causal mask.

Shapes the kernel does not take (float16 caches, head sizes that are not a multiple of 16) go
through the torch backend, so this backend serves any model the engine loads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu as cpu_kernels

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PREFILL_SDPA_MIN = 32  # query tokens from which a request's chunk goes to SDPA


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
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
) -> torch.Tensor:  # [L, Hq, D]
    num_queries = query.shape[0]
    block_size = kv_cache.shape[2]
    blocks = block_table[: -(-seq_len // block_size)].long()
    # One copy of the context: [2, nb, block_size, Hkv, D] -> [2, Hkv, N, D].
    kv = kv_cache.index_select(1, blocks).flatten(1, 2)[:, :seq_len].transpose(1, 2)
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
