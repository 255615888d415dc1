"""Attention through the Triton kernels: one launch stores K/V, one (two with split-K) attends.

No zero-fill of the output when the step has no padding tokens (every row is then written)."""

from __future__ import annotations

import torch

from engine.attention.backend import AttentionMetadata, KVLayout
from engine.kernels._common import DecodeConfig
from engine.kernels.cache import store_kvcache
from engine.kernels.paged_attention import paged_attention


class TritonAttentionBackend:
    name = "triton"

    def __init__(self, decode_config: DecodeConfig | None = None) -> None:
        # The decode variant's launch (BLOCK_N, warps, stages); None: the launcher's defaults.
        self.decode_config = decode_config

    def prepare(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        pass  # nothing measured: every choice here is fixed or made per step

    def kv_layout(self, dtype: torch.dtype, head_size: int, device: torch.device) -> KVLayout:
        return KVLayout.TOKEN_MAJOR  # what the Triton store and attention kernels index

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> None:
        store_kvcache(key, value, kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # unused: the cache is read
    ) -> torch.Tensor:  # [T, Hq, D]; padding rows are zero
        # The host-side maxima size the grid without a device sync (and keep CUDA graphs capturable).
        return paged_attention(
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            max_query_len=metadata.max_query_len,
            max_seq_len=metadata.max_seq_len,
            all_rows_owned=metadata.query_start_loc_cpu[-1] == metadata.num_tokens,
            decode_config=self.decode_config,
            sliding_window=sliding_window,
            logits_soft_cap=logits_soft_cap,
        )
