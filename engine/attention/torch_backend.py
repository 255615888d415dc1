"""Attention in plain torch: the CPU engine's hot path, and the fallback anywhere triton is absent.

It reads the step's shape from the host-side metadata lists, so it never synchronises with the
device. Decodes are batched: requests whose contexts round up to the same number of blocks (within
25%) share one gather and one matmul, padded positions masked. Prefill chunks run one request at a
time through SDPA, so nothing is padded to the longest prompt. Softmax is in float32 throughout.

A sliding window gathers each request's keys from the block of its first query's window start on (a
decode: of its own window start), so blocks before it are never read; a soft cap, which SDPA does
not take, runs the same masks through an explicit matmul and softmax.

An 8-bit cache (``engine/kernels/kv_quant.py``) is quantized row by row on store and dequantized to
float32 right after each gather, so only the rows a step reads are expanded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionMetadata, KVLayout
from engine.kernels import kv_quant, reference
from engine.kernels.reference import window_start


def attend_masked(
    q: torch.Tensor,  # [B, Hq, L, D] float32
    k: torch.Tensor,  # [B, Hkv, N, D] float32
    v: torch.Tensor,  # [B, Hkv, N, D] float32
    allowed: torch.Tensor,  # bool, broadcastable to [B, Hq, L, N]; every row allows at least one key
    scale: float,
    logits_soft_cap: float | None,
) -> torch.Tensor:  # [B, Hq, L, D] float32
    """Masked attention: SDPA, or with a soft cap (which SDPA does not take) matmul, cap, mask, softmax."""
    gqa = q.shape[1] != k.shape[1]
    if logits_soft_cap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = reference.soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, logits_soft_cap)
    return torch.matmul(scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def _decode_buckets(
    rows: list[int], seq_lens: list[int], block_size: int, max_blocks: int
) -> dict[int, list[int]]:
    """Groups decode requests by block count, rounded up so padding wastes at most a quarter.

    A request with nb blocks, 2^k <= nb < 2^(k+1), rounds up to a multiple of 2^(k-2): e.g. 9..10
    blocks share the 10-block bucket and 11..12 the 12-block one; 1..7 blocks are exact.
    """
    buckets: dict[int, list[int]] = {}
    for r in rows:
        num_blocks = -(-seq_lens[r] // block_size)
        quantum = 1 << max(0, num_blocks.bit_length() - 3)
        bucket = min(-(-num_blocks // quantum) * quantum, max_blocks)
        buckets.setdefault(bucket, []).append(r)
    return buckets


class TorchAttentionBackend:
    name = "torch"

    def prepare(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        pass  # nothing measured: every choice here is fixed or made per step

    def kv_layout(self, dtype: torch.dtype, head_size: int, device: torch.device) -> KVLayout:
        # A token's heads side by side: the store is one indexed copy per half, and the decode gather
        # keeps whole blocks.
        return KVLayout.TOKEN_MAJOR

    def store_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        metadata: AttentionMetadata,
    ) -> None:
        reference.store_kvcache(key, value, kv_cache, metadata.slot_mapping)

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
        out = torch.zeros(query.shape, dtype=query.dtype, device=query.device)
        starts = metadata.query_start_loc_cpu
        seq_lens = metadata.seq_lens_cpu
        decodes: list[int] = []
        for r in range(metadata.num_seqs):
            query_len = starts[r + 1] - starts[r]
            if query_len == 1:
                decodes.append(r)
            elif query_len > 1:
                q_start, q_end = starts[r], starts[r + 1]
                out[q_start:q_end] = self._prefill(
                    query[q_start:q_end],
                    kv_cache,
                    metadata.block_tables[r],
                    seq_lens[r],
                    scale,
                    sliding_window,
                    logits_soft_cap,
                )
        if decodes:
            block_size = kv_cache.shape[2]
            max_blocks = metadata.block_tables.shape[1]
            # A window: each decode's keys from its window's first block on, bucketed by that span.
            first_blocks = {r: window_start(seq_lens[r] - 1, sliding_window) // block_size for r in decodes}
            spans = list(seq_lens)  # positions from each decode's first gathered block to its end
            for r, first_block in first_blocks.items():
                spans[r] -= first_block * block_size
            for num_blocks, rows in _decode_buckets(decodes, spans, block_size, max_blocks).items():
                self._decode(
                    query,
                    kv_cache,
                    metadata.block_tables,
                    rows,
                    starts,
                    seq_lens,
                    num_blocks,
                    scale,
                    out,
                    None if sliding_window is None else [first_blocks[r] for r in rows],
                    sliding_window,
                    logits_soft_cap,
                )
        return out

    @staticmethod
    def _prefill(
        query: torch.Tensor,  # [L, Hq, D], the request's last L positions
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        block_table: torch.Tensor,  # [max_blocks] int32
        seq_len: int,
        scale: float,
        sliding_window: int | None,
        logits_soft_cap: float | None,
    ) -> torch.Tensor:  # [L, Hq, D]
        num_queries, num_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        # Keys from the first query's window start: N = seq_len - first, key j at position first + j.
        first = window_start(seq_len - num_queries, sliding_window)
        key, value = reference.gather_kv(kv_cache, block_table, seq_len, first)  # [N, Hkv, D(+4)] each
        key, value = kv_quant.dequantize(key), kv_quant.dequantize(value)  # [N, Hkv, D] float32
        # Fold the GQA group into the query rows, so K/V are shared without repeating them:
        # [L, Hkv, G, D] -> [1, Hkv, G * L, D], row g * L + i is head g of query token i.
        q = query.float().view(num_queries, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
        q = q.reshape(1, num_kv_heads, group * num_queries, head_size)
        k = key.float().permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, N, D]
        v = value.float().permute(1, 0, 2).unsqueeze(0)
        # Query i sits at position seq_len - L + i: a bottom-right aligned causal mask (and the
        # window's lower edge), [L, N] -> [G * L, N].
        q_pos = torch.arange(seq_len - num_queries, seq_len, device=query.device)
        k_pos = torch.arange(first, seq_len, device=query.device)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        o = attend_masked(q, k, v, allowed.repeat(group, 1), scale, logits_soft_cap)
        o = o.view(num_kv_heads, group, num_queries, head_size).permute(2, 0, 1, 3)
        return o.reshape(num_queries, num_heads, head_size).to(query.dtype)

    @staticmethod
    def _decode(
        query: torch.Tensor,  # [T, Hq, D]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
        block_tables: torch.Tensor,  # [S, max_blocks] int32
        rows: list[int],  # n decode requests whose contexts fit in num_blocks blocks
        starts: list[int],
        seq_lens: list[int],
        num_blocks: int,
        scale: float,
        out: torch.Tensor,  # [T, Hq, D], written at the rows' tokens
        first_blocks: list[int] | None,  # a window: each row's first table column; None: column 0
        sliding_window: int | None,
        logits_soft_cap: float | None,
    ) -> None:
        _, num_heads, head_size = query.shape
        num_kv_heads = kv_cache.shape[3]
        device = query.device
        tokens = torch.tensor([starts[r] for r in rows], device=device)
        lens = torch.tensor([seq_lens[r] for r in rows], device=device)
        row_ids = torch.tensor(rows, device=device)
        if first_blocks is None:
            tables = block_tables[row_ids, :num_blocks].long()  # [n, nb]
            offsets = torch.zeros(len(rows), dtype=torch.long, device=device)
        else:
            # Columns first_block + j, clamped to the table (columns past a row's end are masked below).
            offsets = torch.tensor(first_blocks, device=device)
            cols = (offsets[:, None] + torch.arange(num_blocks, device=device)).clamp_(
                max=block_tables.shape[1] - 1
            )
            tables = block_tables[row_ids].gather(1, cols).long()  # [n, nb]
            offsets = offsets * kv_cache.shape[2]  # position of each row's first gathered key
        # [2, n, nb, block_size, Hkv, D] -> [2, n, L, Hkv, D] with L = nb * block_size.
        # index_select over the flat table is about twice as fast as advanced indexing on CPU.
        kv = kv_cache.index_select(1, tables.flatten())  # a fresh copy: safe to edit in place
        kv = kv.view(2, len(rows), num_blocks * kv_cache.shape[2], num_kv_heads, kv_cache.shape[-1])
        kv = kv_quant.dequantize(kv)  # [2, n, L, Hkv, D] float32 (an 8-bit cache's rows expanded)
        length = kv.shape[2]
        pos = offsets[:, None] + torch.arange(length, device=device)[None, :]  # [n, L] key positions
        valid = pos < lens[:, None]
        if sliding_window is not None:  # the decode at lens - 1 sees keys > lens - 1 - W
            valid &= pos >= lens[:, None] - sliding_window
        # Slots past a request's end hold stale or uninitialised data (maybe NaN): zero K and V there,
        # since SDPA adds its mask to the scores (NaN + -inf is NaN) and 0 * NaN is NaN too.
        kv.masked_fill_(~valid[None, :, :, None, None], 0.0)
        # SDPA's fused CPU kernel takes the strided [n, Hkv, L, D] views and the GQA sharing as they
        # are; matmul on the same views copies K and falls back to a per-batch loop for V (2x slower).
        q = query.index_select(0, tokens).float().unsqueeze(2)  # [n, Hq, 1, D]
        o = attend_masked(
            q, kv[0].transpose(1, 2), kv[1].transpose(1, 2), valid[:, None, None, :], scale, logits_soft_cap
        )  # [n, Hq, 1, D]
        out.index_copy_(0, tokens, o.view(len(rows), num_heads, head_size).to(out.dtype))
