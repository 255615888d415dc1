"""Attention through the C++ CPU kernels: K/V read in place through the block tables.

Decodes (bandwidth-bound) and prefill chunks (compute-bound): no gather of whole contexts, no padding
to a bucket, no masking pass; each (request, kv head, query tile) is one work item of
``torch.ops.inflight_cpu.paged_attention`` (engine/kernels/cpu).

Long prefill chunks (>= ``PREFILL_SDPA_MIN`` query tokens) are compute-bound, O(L x context). They
go to the kernel too, or to torch's flash-attention SDPA where that is clearly faster on this host:
``engine/attention/cpu_prefill.py`` times both once per attention shape and picks.

The cache is head-major with key-interleaved K pages (``KVLayout.HEAD_MAJOR_KT``: each block's K and
V of one kv head contiguous, which the kernel streams, and a K page's lines each hold one dim of
consecutive keys, which it scores without horizontal sums) for the shapes the kernel takes. For the
others (float16 caches, head sizes that are not a multiple of 16) it is token-major and everything
goes through the torch backend, so this backend serves any model the engine loads and the fallback
only ever sees the layout it knows.

An 8-bit cache (``kv_cache_dtype`` int8 / fp8_e4m3, engine/kernels/kv_quant.py) is head-major
(``KVLayout.HEAD_MAJOR``: rows of D codes and a scale, a kv head's rows of a block contiguous) and goes
through its own kernels (engine/kernels/cpu/kv_quant.cpp), prefill chunks included; where they cannot
build, or the head size is not a multiple of 16, it is token-major and the torch backend reads it.
"""

from __future__ import annotations

import torch

from engine.attention import cpu_prefill
from engine.attention.backend import AttentionMetadata, KVLayout
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu as cpu_kernels
from engine.kernels import kv_quant

_KERNEL_DTYPES = (torch.float32, torch.bfloat16)
PREFILL_SDPA_MIN = 32  # query tokens from which a request's chunk may go to SDPA


def kernel_supports(dtype: torch.dtype, head_size: int, device: torch.device) -> bool:
    """Whether the C++ kernels take a cache of this dtype and head size (HEAD_MAJOR_KT, then)."""
    return device.type == "cpu" and dtype in _KERNEL_DTYPES and head_size % 16 == 0 and head_size <= 256


def quant_kernel_supports(dtype: torch.dtype, head_size: int, device: torch.device) -> bool:
    """Whether the 8-bit cache's C++ kernels take a cache of this dtype and head size (HEAD_MAJOR, then)."""
    return (
        device.type == "cpu"
        and kv_quant.is_quantized(dtype)
        and head_size % 16 == 0
        and cpu_kernels.load_kv_quant()
    )


def _on_kernel(kv_cache: torch.Tensor) -> bool:
    return kernel_supports(kv_cache.dtype, kv_cache.shape[-1], kv_cache.device)


def _on_quant_kernel(kv_cache: torch.Tensor) -> bool:
    return quant_kernel_supports(kv_cache.dtype, kv_quant.head_size_of(kv_cache), kv_cache.device)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        if not cpu_kernels.load():
            raise RuntimeError("the CPU attention kernels could not be built; use attention_backend='torch'")
        self._fallback = TorchAttentionBackend()

    def prepare(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        # At start-up, not in the first long prompt's step: the route's probe takes milliseconds.
        if kernel_supports(dtype, head_size, torch.device("cpu")):
            self._prefill_route(num_heads, num_kv_heads, head_size, dtype)

    def _prefill_route(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> str:
        return cpu_prefill.choose(cpu_prefill.PrefillShape(num_heads, num_kv_heads, head_size, dtype)).route

    def kv_layout(self, dtype: torch.dtype, head_size: int, device: torch.device) -> KVLayout:
        if quant_kernel_supports(dtype, head_size, device):
            return KVLayout.HEAD_MAJOR
        return KVLayout.HEAD_MAJOR_KT if kernel_supports(dtype, head_size, device) else KVLayout.TOKEN_MAJOR

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # HEAD_MAJOR_KT, else token-major
        metadata: AttentionMetadata,
    ) -> None:
        if _on_quant_kernel(kv_cache):
            if key.dtype not in _KERNEL_DTYPES:  # float16 models: quantized from float32 alike
                key, value = key.float(), value.float()
            torch.ops.inflight_cpu.store_kv_quant(key, value, kv_cache, metadata.slot_mapping)
            return
        if not _on_kernel(kv_cache):
            self._fallback.store_kv(key, value, kv_cache, metadata)
            return
        # The model's K/V are in the cache's dtype; a caller's other dtype is rounded as the torch path would.
        key, value = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        torch.ops.inflight_cpu.store_kv(key, value, kv_cache, metadata.slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # HEAD_MAJOR_KT, else token-major
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, Hq, D]
        if _on_quant_kernel(kv_cache):
            # The kernel takes float32 or bf16 queries; a float16 model's attend in float32.
            q = query if query.dtype in _KERNEL_DTYPES else query.float()
            out = torch.empty(q.shape, dtype=q.dtype)
            torch.ops.inflight_cpu.paged_attention_quant(
                out,
                q,
                kv_cache,
                metadata.query_start_loc,
                metadata.seq_lens,
                metadata.block_tables,
                scale,
                sliding_window or 0,  # the op's 0: off
                logits_soft_cap or 0.0,
            )
            return out.to(query.dtype)
        if not _on_kernel(kv_cache):
            return self._fallback.forward(
                query,
                kv_cache,
                metadata,
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
        if query.dtype != kv_cache.dtype:  # not the engine's case: attend in the cache's dtype
            out = self.forward(
                query.to(kv_cache.dtype),
                kv_cache,
                metadata,
                scale,
                sliding_window=sliding_window,
                logits_soft_cap=logits_soft_cap,
            )
            return out.to(query.dtype)
        # Every token of the step belongs to a request: the kernel writes the rows of all of them, or
        # of all but the long chunks, whose rows SDPA writes where it is the faster path here.
        num_kv_heads, head_size = kv_cache.shape[2], kv_cache.shape[4]
        sdpa = metadata.max_query_len >= PREFILL_SDPA_MIN and (
            self._prefill_route(query.shape[1], num_kv_heads, head_size, kv_cache.dtype) == "sdpa"
        )
        out = torch.empty(query.shape, dtype=query.dtype)
        torch.ops.inflight_cpu.paged_attention(
            out,
            query,
            kv_cache,
            metadata.query_start_loc,
            metadata.seq_lens,
            metadata.block_tables,
            scale,
            PREFILL_SDPA_MIN - 1 if sdpa else metadata.max_query_len,
            sliding_window or 0,  # the op's 0: off
            logits_soft_cap or 0.0,
        )
        if sdpa:
            starts, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
            # The step's K/V as stored (in the cache's dtype, as the query is here): a whole prompt's
            # context, attended without gathering it back from the cache.
            own = new_kv if new_kv is not None and new_kv[0].dtype == kv_cache.dtype else None
            for r in range(metadata.num_seqs):
                q_start, q_end = starts[r], starts[r + 1]
                if q_end - q_start >= PREFILL_SDPA_MIN:
                    # A prompt in one chunk attends its own K/V.
                    prompt_kv = own if own is not None and q_end - q_start == lens[r] else None
                    out[q_start:q_end] = cpu_prefill.sdpa_prefill(
                        query[q_start:q_end],
                        kv_cache,
                        metadata.block_tables[r],
                        lens[r],
                        scale,
                        sliding_window,
                        logits_soft_cap,
                        own_kv=None
                        if prompt_kv is None
                        else (prompt_kv[0][q_start:q_end], prompt_kv[1][q_start:q_end]),
                    )
        return out
