"""Torch references of every kernel: the definition the Triton kernels are tested against.

Written for clarity, not speed (the CPU attention backend has its own faster paths). Shapes use
T = tokens in the step, S = requests, Hq / Hkv = query / key-value heads, D = head size,
I = MLP intermediate size. The paged cache is token-major, ``[2, num_blocks, block_size, Hkv, D]``
(an 8-bit cache's rows are D + 4 elements, codes then scale: ``engine/kernels/kv_quant.py``); a cache
in another layout is read through its token-major contents (``KVLayout.to_token_major``). The layouts
and the packed-step metadata are described in ``engine/attention/backend.py``.
"""

from __future__ import annotations

import torch

from engine.kernels import kv_quant


def store_kvcache(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]; 0: K, 1: V
    slot_mapping: torch.Tensor,  # [T] int64, block_id * block_size + offset; -1: padding, skipped
) -> None:
    """Writes each token's K/V into its cache slot, in place; an 8-bit cache quantizes each row."""
    num_kv_heads, row = kv_cache.shape[-2:]
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    # A flat view over (block, offset) makes the slot number a plain row index.
    for half, x in enumerate((key[keep], value[keep])):
        rows = kv_quant.quantize(x, kv_cache.dtype) if kv_quant.is_quantized(kv_cache.dtype) else x
        kv_cache[half].view(-1, num_kv_heads, row)[slots] = rows.to(kv_cache.dtype)


def gather_kv(
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    block_table: torch.Tensor,  # [max_blocks] int32, one request's row
    seq_len: int,
    start: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:  # K, V: [seq_len - start, Hkv, D] each
    """One request's cached rows at positions ``start .. seq_len - 1``, in position order, as stored
    (``kv_quant.dequantize`` gives an 8-bit cache's values); blocks wholly before ``start`` are not read.

    Example, block_size 4, start 6, seq_len 11: blocks 1 and 2 of the table are read (positions 4..11),
    then the first 2 and the last 1 positions trimmed.
    """
    block_size = kv_cache.shape[2]
    first_block, num_blocks = start // block_size, -(-seq_len // block_size)
    blocks = block_table[first_block:num_blocks].long()
    # [2, nb, block_size, Hkv, D] -> [2, nb * block_size, Hkv, D], then trim both ends.
    offset = first_block * block_size
    kv = kv_cache[:, blocks].flatten(1, 2)[:, start - offset : seq_len - offset]
    return kv[0], kv[1]


def window_start(position: int, sliding_window: int | None) -> int:
    """The first key position a query at ``position`` attends: HF's ``kv_idx > q_idx - sliding_window``
    (transformers' masking_utils), so a window of W keys includes the query's own position.

    Example, W 4: the query at position 9 sees keys 6, 7, 8, 9; at position 2 it sees 0, 1, 2.
    """
    return 0 if sliding_window is None else max(0, position - sliding_window + 1)


def soft_cap(scores: torch.Tensor, logits_soft_cap: float | None) -> torch.Tensor:
    """Gemma 2's attention logit soft-capping of already scaled scores: ``cap * tanh(scores / cap)``."""
    if logits_soft_cap is None:
        return scores
    return torch.tanh(scores / logits_soft_cap) * logits_soft_cap


def causal_attention(
    query: torch.Tensor,  # [L, Hq, D], the request's last L positions
    key: torch.Tensor,  # [N, Hkv, D], positions 0..N-1
    value: torch.Tensor,  # [N, Hkv, D]
    scale: float,
    sliding_window: int | None = None,  # None: every earlier position; W: the last W (own included)
    logits_soft_cap: float | None = None,  # None: off
) -> torch.Tensor:  # [L, Hq, D] float32
    """Dense attention of one request: query i sits at position N - L + i and sees positions <= it (and
    > it - sliding_window). Scores are scaled, then soft-capped, then masked, as HF's Gemma 2 does."""
    num_queries, num_heads, head_size = query.shape
    num_keys, num_kv_heads, _ = key.shape
    group = num_heads // num_kv_heads
    # GQA: query head h reads kv head h // group; view queries as [Hkv, group, L, D] instead of
    # repeating K/V group times.
    q = query.float().view(num_queries, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    k = key.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, N, D]
    v = value.float().permute(1, 0, 2).unsqueeze(1)  # [Hkv, 1, N, D]
    scores = soft_cap(torch.matmul(q, k.transpose(-1, -2)) * scale, logits_soft_cap)  # [Hkv, group, L, N]
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=query.device)
    k_pos = torch.arange(num_keys, device=query.device)
    hidden = k_pos[None, :] > q_pos[:, None]  # [L, N]: the future
    if sliding_window is not None:
        hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window  # before the window
    scores = scores.masked_fill(hidden, float("-inf"))
    out = torch.matmul(torch.softmax(scores, dim=-1), v)  # [Hkv, group, L, D]
    return out.permute(2, 0, 1, 3).reshape(num_queries, num_heads, head_size)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]
    query_start_loc: torch.Tensor,  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor,  # [S] int32, context length including this step's tokens
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
) -> torch.Tensor:  # [T, Hq, D], query dtype; rows outside every request are zero
    """Causal attention of a packed mixed batch (prefill chunks and decodes) through block tables.

    With a window, keys before the step's first query's window are not read (their blocks may have
    been freed and reused): a request's keys are gathered from there on."""
    out = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for r, seq_len in enumerate(lens):
        q_start, q_end = starts[r], starts[r + 1]
        if q_end == q_start:
            continue
        first = window_start(seq_len - (q_end - q_start), sliding_window)
        k, v = (kv_quant.dequantize(x) for x in gather_kv(kv_cache, block_tables[r], seq_len, first))
        # Positions relative to ``first``: causality and the window only compare differences.
        o = causal_attention(query[q_start:q_end], k, v, scale, sliding_window, logits_soft_cap)
        out[q_start:q_end] = o.to(query.dtype)
    return out


def rms_norm(
    x: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> torch.Tensor:  # [T, H]
    # As HF Llama: normalise in float32, round to the input dtype, then scale by the weight.
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def fused_add_rms_norm(
    x: torch.Tensor,  # [T, H]
    residual: torch.Tensor,  # [T, H]
    weight: torch.Tensor,  # [H]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H], new_residual [T, H]
    # The residual sum is rounded to the model dtype before the norm, as HF does.
    new_residual = x + residual
    return rms_norm(new_residual, weight, eps), new_residual


def rotary_embedding(
    positions: torch.Tensor,  # [T] int64
    query: torch.Tensor,  # [T, Hq, D]
    key: torch.Tensor,  # [T, Hkv, D]
    cos_sin_cache: torch.Tensor,  # [max_pos, D] float32: cos in [:, :D/2], sin in [:, D/2:]
) -> tuple[torch.Tensor, torch.Tensor]:  # rotated query [T, Hq, D], key [T, Hkv, D]
    """NeoX / HF ``rotate_half`` rotary embedding, out of place.

    Dimension i < D/2 pairs with i + D/2. Computed in float32 and rounded once; for float32 models
    this is HF's result exactly (HF rounds cos/sin to the model dtype first, so bf16 may differ by
    an ulp).
    """
    cos, sin = cos_sin_cache[positions].float().chunk(2, dim=-1)  # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]  # broadcast over heads

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def silu_and_mul(
    x: torch.Tensor,  # [T, 2 * I]: gate projection in [:, :I], up projection in [:, I:]
) -> torch.Tensor:  # [T, I]
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def quant_matmul(
    x: torch.Tensor,  # [T, K] float32 or bf16
    blocks: torch.Tensor,  # [N, row_bytes] uint8: each output feature's row of GGUF blocks
    format: str,  # a name in engine/quant/formats.py's FORMATS
    in_features: int,  # K
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:  # [T, N] in x's dtype
    """x @ dequantize(blocks).T + bias, in float32, rounded once to x's dtype."""
    from engine.quant.formats import dequantize_rows, get_format

    weight = dequantize_rows(get_format(format), blocks, in_features)  # [N, K] float32
    out = x.float() @ weight.T
    return (out if bias is None else out + bias.float()).to(x.dtype)
