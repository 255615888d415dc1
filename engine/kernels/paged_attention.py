"""Paged attention over a packed mixed batch (prefill chunks and decodes in one step), Triton.

A program owns BLOCK_Q query tokens of one request and the GROUP query heads that share one kv head,
so each K/V tile is loaded once for the whole group. Its rows are (token, head) pairs, head fastest.
Worked example, GROUP 4 (GROUP_PAD 4), BLOCK_Q 4, so BLOCK_M = 16 rows:

    row        0  1  2  3   4  5  6  7   8 ...  15
    token      0  0  0  0   1  1  1  1   2 ...   3     (row // GROUP_PAD, within the tile)
    head       0  1  2  3   0  1  2  3   0 ...   3     (row % GROUP_PAD, within the group)

K/V is walked BLOCK_N positions at a time; position n lives in block block_table[n // block_size] at
offset n % block_size, so a tile may span several cache blocks. Online softmax runs in float32 in
the log2 domain (exp2 is the native instruction; the scale absorbs log2(e)).

Two variants of one kernel split a step's requests by query length:

* decode (FLAT False): grid (request, kv head [x split]), one small tile (BLOCK_M 16) per request;
  it attends the requests with exactly one query token and skips the others.
* flat (FLAT True, steps that are not decode-only): the requests with two or more query tokens, on
  a grid flattened over query blocks, BLOCK_M 64 or 128. Request r owns the flat block range that
  starts at query_start_loc[r] // BLOCK_Q + r (at least cdiv(query_len, BLOCK_Q) blocks); a program
  finds its request by binary search over those starts. The grid is num_tokens // BLOCK_Q + S
  blocks, known on the host without a sync. Worked example, BLOCK_Q 4:

    request            0     1      2           3
    query_start_loc    0     1      1           5          41
    query_len          1     0      4           36
    range start        0     1      2           4          (start // 4 + r)
    flat blocks        0     1      2, 3        4 .. 13    (grid 41 // 4 + 4 = 14 blocks)
    flat programs      0 returns (a decode: the decode variant's), 1 returns (nothing scheduled),
                       2 works, 3 returns, 4 .. 12 work (cdiv(36, 4) = 9 tiles), 13 returns

  A 2048-token mixed step of 64 decodes and a 1984-token chunk with BLOCK_Q 32 launches (64 + 64)
  blocks per kv head instead of the (64 requests x 64 tiles) of a grid sized by the longest query.

Split-K (decode-only steps): with few requests and long contexts the grid above is too small to
keep every SM streaming K/V. The grid then has NUM_SPLITS programs per (request, kv head), an upper
bound; each request cuts its own context into as many partitions as its length fills (at least
min_partition positions each, at most NUM_SPLITS), so a CUDA graph captured with NUM_SPLITS sized
for max_model_len still gives a short request one partition. Worked example, NUM_SPLITS 8,
min_partition 256, BLOCK_N 64:

    seq_len   used splits              partition   programs with split >= used
    100       max(1, 100 // 256) = 1   -           7 return at once; split 0 writes the output
    700       700 // 256 = 2           384         6 return at once; splits 0, 1 write partials
    9000      min(8, 35) = 8           1152        none

A request with one used split writes its normalised output directly and the merge skips it; the
merge reads only the used partitions of the others (never an empty one).

Sliding window (SLIDING, a constexpr: without it the kernel compiles as if the code were absent): a
query at position p sees keys p - W + 1 .. p. A program's KV walk starts at the BLOCK_N tile holding
its first row's window start, so whole tiles (and the cache blocks in them) before the window are
never visited; within the first tile, loads below the window start are masked (those slots may
belong to a freed, reused block), and each row's scores below its own start are -inf. Split-K cuts
the span from that first tile to seq_len. Worked example, W 100, BLOCK_N 32, a decode at 999:

    window start 900; walk starts at tile 896 (900 // 32 * 32): tiles 0 .. 864 skipped; keys 896..899
    masked at load; split-K partitions cut 999 + 1 - 896 = 104 positions, not 1000.

Soft cap (SOFT_CAP, constexpr): each scaled score s becomes cap * tanh(s / cap) before the softmax,
tanh written with exp2 in the log2 domain the scores already live in.

8-bit cache (KV_QUANT, constexpr): each K/V tile is loaded as one-byte codes and its rows' float32
scales (engine/kernels/kv_quant.py) and multiplied out into the query's dtype before the dots, so
the tile's bytes from memory are about half of bf16's and the arithmetic is unchanged.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from engine.kernels import kv_quant
from engine.kernels._common import DecodeConfig, check_kv_cache, is_interpreted, sm_count
from engine.kernels.split_k import (
    MAX_SPLITS,
    MIN_PARTITION,
    SPLIT_CHOICES,
    choose_num_splits,
    merge_splits_kernel,
    request_splits,
    window_base,
)

__all__ = ["SPLIT_CHOICES", "choose_num_splits", "default_block_n", "paged_attention"]


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):  # type: ignore[no-untyped-def]
    """The request whose flat block range holds q_block: the last r < num_seqs whose range start,
    query_start_loc[r] // BLOCK_Q + r, is <= q_block (request 0's start is 0)."""
    lo = q_block * 0  # int32 tensors from the start: loop-carried values keep one type
    hi = num_seqs + 0  # the answer lies in [lo, hi)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        lo = tl.where(start <= q_block, mid, lo)
        hi = tl.where(start <= q_block, hi, mid)
    return lo


# stride_bt is the block table's width, which follows the step's longest context in eager steps:
# specialising on it (divisibility by 16) would compile new variants mid-serving; num_seqs changes
# every step (and a value of 1 would be specialised into a constant).
@triton.jit(do_not_specialize=["stride_bt", "num_seqs"])
def _paged_attention_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, Hq, D], written when NUM_SPLITS == 1
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, D] float32, unnormalised partial outputs (split-K)
    part_max_ptr,  # [T, Hq, NUM_SPLITS] float32, running max in the log2 domain (split-K)
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] float32, running sum of exponentials (split-K)
    query_ptr,  # [T, Hq, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D] (an 8-bit cache: D + 4, codes then scale)
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    k_scale_ptr,  # KV_QUANT: the K half's bytes as float32, a row's scale at (row offset + D) / 4
    v_scale_ptr,  # KV_QUANT: the V half's, likewise
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    block_tables_ptr,  # [S, max_blocks] int32
    scale_log2,  # softmax scale * log2(e)
    min_partition,  # fewest KV positions per used split (split-K)
    num_seqs,  # S (the flat variant's binary search)
    sliding_window,  # W (read when SLIDING)
    soft_cap,  # cap (read when SOFT_CAP)
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cache_block,
    stride_cache_slot,
    stride_cache_head,
    stride_bt,
    NUM_HEADS: tl.constexpr,  # Hq
    GROUP: tl.constexpr,  # query heads per kv head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,  # HEAD_SIZE rounded up to a power of two
    BLOCK_SIZE: tl.constexpr,  # cache block size
    BLOCK_Q: tl.constexpr,  # query tokens per program
    BLOCK_N: tl.constexpr,  # KV positions per iteration
    NUM_SPLITS: tl.constexpr,
    FLAT: tl.constexpr,  # True: flat grid over query blocks, requests of 2+ tokens; False: decodes
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter cannot multiply bf16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models, which are checked against HF to 1e-5
    SLIDING: tl.constexpr = False,  # rows see only their last sliding_window positions
    SOFT_CAP: tl.constexpr = False,  # scores soft-capped at soft_cap
    KV_QUANT: tl.constexpr = False,  # an 8-bit cache (engine/kernels/kv_quant.py): tiles dequantized
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    kv_head = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    if FLAT:
        q_block = tl.program_id(0)
        seq = _find_request(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        q_tile = q_block - (q_start // BLOCK_Q + seq)
        # One-token requests are the decode variant's; a range may hold a block more than it fills.
        if (q_len == 1) | (q_tile * BLOCK_Q >= q_len):
            return
    else:
        seq = tl.program_id(0)
        q_tile = 0
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        if q_len != 1:  # nothing scheduled, or a prefill chunk (the flat variant's)
            return
    seq_len = tl.load(seq_lens_ptr + seq)
    num_cached = seq_len - q_len  # positions before this step's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_SIZE
    tok = q_tile * BLOCK_Q + offs_m // GROUP_PAD  # [BLOCK_M] query index within the request
    grp = offs_m % GROUP_PAD
    head = kv_head * GROUP + grp
    row_valid = (tok < q_len) & (grp < GROUP)
    q_pos = num_cached + tok  # [BLOCK_M] absolute position of each row's token

    token = (q_start + tok).to(tl.int64)
    q_ptrs = query_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_valid[:, None] & d_mask[None, :], other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)

    # Causality bounds the tile's KV range by its last token, a window by its first token's window
    # start (kv_lo, walked from its BLOCK_N tile, kv_base); split-K cuts it further.
    kv_stop = tl.minimum(seq_len, num_cached + (q_tile + 1) * BLOCK_Q)
    kv_lo = 0
    kv_base = 0
    if SLIDING:
        kv_lo, kv_base = window_base(num_cached + q_tile * BLOCK_Q, sliding_window, BLOCK_N)
    kv_start = kv_base
    num_used = 1
    if NUM_SPLITS > 1:
        num_used, partition = request_splits(seq_len - kv_base, min_partition, NUM_SPLITS, BLOCK_N)
        kv_start = kv_base + split * partition
        kv_stop = tl.minimum(kv_stop, kv_start + partition)
    if split >= num_used:  # this request's context is too short to need this partition
        return

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_cache_head
    for start_n in range(kv_start, kv_stop, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < kv_stop
        if SLIDING:  # slots below the window start may be another request's now: never loaded
            n_valid = n_valid & (offs_n >= kv_lo)
        # int64 before multiplying: a large cache overflows int32 element offsets.
        block_ids = tl.load(bt_row + offs_n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        kv_off = block_ids * stride_cache_block + (offs_n % BLOCK_SIZE) * stride_cache_slot + kv_head_off
        kv_mask = n_valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + kv_off[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        if KV_QUANT:
            # Codes times their row's scale, in the query's dtype: the dots then run as for a float cache.
            k_s = tl.load(k_scale_ptr + (kv_off + HEAD_SIZE) // 4, mask=n_valid, other=0.0)
            v_s = tl.load(v_scale_ptr + (kv_off + HEAD_SIZE) // 4, mask=n_valid, other=0.0)
            k = (k.to(tl.float32) * k_s[:, None]).to(q.dtype)
            v = (v.to(tl.float32) * v_s[:, None]).to(q.dtype)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SOFT_CAP:
            # s = log2(e) * x with x the scaled score: cap * tanh(x / cap) * log2(e), where
            # tanh(y) = 1 - 2 / (e^(2y) + 1) and e^(2x / cap) = 2^(2s / cap).
            s = (soft_cap * 1.4426950408889634) * (1.0 - 2.0 / (tl.math.exp2(s * (2.0 / soft_cap)) + 1.0))
        visible = (offs_n[None, :] <= q_pos[:, None]) & n_valid[None, :]
        if SLIDING:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # Rows that have seen nothing yet (padding rows, empty partitions) keep m = -inf; subtracting
        # 0 instead keeps exp2 at exactly 0 rather than NaN from -inf - -inf.
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_ref)
        p = tl.math.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new

    if num_used == 1:  # the whole context in this program: the final output, no merge
        denom = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / denom[:, None]
        o_ptrs = out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_mask[None, :])
    else:
        # Partial buffers are dense: [T, Hq, NUM_SPLITS(, D)].
        part_row = (token * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        a_ptrs = part_acc_ptr + part_row[:, None] * HEAD_SIZE + offs_d[None, :]
        tl.store(a_ptrs, acc, mask=row_valid[:, None] & d_mask[None, :])


def default_block_n(tile_bytes: int) -> int:
    """KV positions per iteration for a [BLOCK_D] row of tile_bytes: K and V tiles stay in shared memory."""
    return 64 if tile_bytes <= 256 else (32 if tile_bytes <= 512 else 16)


def paged_attention(
    query: torch.Tensor,  # [T, Hq, D]
    kv_cache: torch.Tensor,  # [2, num_blocks, block_size, Hkv, D]; 8-bit: [..., D + 4] (kv_quant.py)
    query_start_loc: torch.Tensor,  # [S + 1] int32
    seq_lens: torch.Tensor,  # [S] int32
    block_tables: torch.Tensor,  # [S, max_blocks] int32
    scale: float,
    *,
    max_query_len: int | None = None,  # pass it to avoid a device sync (the metadata has it)
    max_seq_len: int | None = None,  # >= every seq_len; an upper bound only caps the split count
    num_splits: int | None = None,  # None: heuristic; forced values apply to decode-only steps only
    all_rows_owned: bool = False,  # query_start_loc[-1] == T (no padding tokens): skips a zero-fill
    decode_config: DecodeConfig | None = None,  # the decode variant's launch; None: the defaults
    sliding_window: int | None = None,  # None: full causal context; W: each query's last W positions
    logits_soft_cap: float | None = None,  # None: off
) -> torch.Tensor:  # [T, Hq, D] contiguous; rows outside every request are zero
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    check_kv_cache(kv_cache, num_kv_heads, head_size)
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, f"{num_heads} query heads over {num_kv_heads} kv heads"
    assert query.stride(2) == 1, "head_size dimension of query must be contiguous"
    kv_quantized = kv_quant.is_quantized(kv_cache.dtype)
    assert kv_quantized or query.dtype == kv_cache.dtype, (query.dtype, kv_cache.dtype)
    assert query_start_loc.shape == (num_seqs + 1,) and query_start_loc.dtype == torch.int32
    assert seq_lens.dtype == torch.int32
    assert block_tables.dim() == 2 and block_tables.shape[0] == num_seqs and block_tables.dtype == torch.int32
    assert block_tables.stride(1) == 1, "block table rows must be contiguous"
    assert query.device == kv_cache.device == query_start_loc.device == seq_lens.device == block_tables.device
    assert sliding_window is None or sliding_window >= 1, sliding_window
    assert logits_soft_cap is None or logits_soft_cap > 0, logits_soft_cap

    # Every row of a request is written (by its program, or by the merge), so only rows past the last
    # request need zeros: the caller says whether there are any (it knows without a device sync).
    alloc = torch.empty if all_rows_owned else torch.zeros
    out = alloc((num_tokens, num_heads, head_size), dtype=query.dtype, device=query.device)
    if num_seqs == 0 or num_tokens == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    if max_seq_len is None:
        max_seq_len = int(seq_lens.max())
    if max_query_len == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_d = max(16, triton.next_power_of_2(head_size))  # tl.dot's K dimension is at least 16
    tile_bytes = query.element_size() * block_d
    decode_only = max_query_len == 1
    config = decode_config or DecodeConfig()
    block_n = config.block_n or default_block_n(tile_bytes)

    splits = 1
    min_partition = MIN_PARTITION
    if decode_only:
        if num_splits is None:
            span = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + block_n)
            splits = choose_num_splits(num_seqs, num_kv_heads, span, sm_count(query.device))
        else:
            # A forced count is honoured down to one BLOCK_N tile per partition (tests use it).
            min_partition = block_n
            splits = max(1, min(num_splits, MAX_SPLITS, triton.cdiv(max_seq_len, block_n)))

    if splits > 1:
        part_acc = torch.empty(
            (num_tokens, num_heads, splits, head_size), dtype=torch.float32, device=query.device
        )
        part_max = torch.empty((num_tokens, num_heads, splits), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the kernel when NUM_SPLITS == 1
    k_cache, v_cache = kv_cache[0], kv_cache[1]
    # An 8-bit cache's scales are read through float32 views of the same bytes (rows of D + 4 bytes,
    # D a multiple of 4, keep every scale aligned).
    k_scales = k_cache.view(torch.float32) if kv_quantized else k_cache
    v_scales = v_cache.view(torch.float32) if kv_quantized else v_cache

    def launch(grid: tuple[int, int], block_m: int, n: int, num_splits: int, flat: bool, **opts: int) -> None:
        _paged_attention_kernel[grid](
            out,
            part_acc,
            part_max,
            part_sum,
            query,
            k_cache,
            v_cache,
            k_scales,
            v_scales,
            query_start_loc,
            seq_lens,
            block_tables,
            scale * math.log2(math.e),
            min_partition,
            num_seqs,
            sliding_window or 0,
            logits_soft_cap or 0.0,
            query.stride(0),
            query.stride(1),
            out.stride(0),
            out.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            block_tables.stride(0),
            NUM_HEADS=num_heads,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_SIZE=head_size,
            BLOCK_D=block_d,
            BLOCK_SIZE=kv_cache.shape[2],
            BLOCK_Q=block_m // group_pad,
            BLOCK_N=n,
            NUM_SPLITS=num_splits,
            FLAT=flat,
            DOT_FP32=is_interpreted(query),
            DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
            SLIDING=sliding_window is not None,
            SOFT_CAP=logits_soft_cap is not None,
            KV_QUANT=kv_quantized,
            **opts,
        )

    if not decode_only:
        # Shared memory budget: Q tile plus pipelined K and V tiles must fit on Hopper/Ampere.
        block_m = 128 if tile_bytes <= 256 and max_query_len * group >= 128 else 64
        block_m = max(block_m, group_pad)
        flat_blocks = num_tokens // (block_m // group_pad) + num_seqs
        launch(
            (flat_blocks, num_kv_heads),
            block_m,
            default_block_n(tile_bytes),
            1,
            True,
            num_warps=8 if block_m >= 128 else 4,
        )
    # The decode variant: every one-token request (all of a decode-only step's, or a mixed step's
    # decodes, which would fill 1 of BLOCK_Q tokens of the flat variant's tile).
    opts = {"num_warps": config.num_warps or 4}
    if config.num_stages is not None:
        opts["num_stages"] = config.num_stages
    launch((num_seqs, num_kv_heads * splits), max(16, group_pad), block_n, splits, False, **opts)
    if splits > 1:
        merge_splits_kernel[(num_seqs, num_heads)](
            out,
            part_acc,
            part_max,
            part_sum,
            query_start_loc,
            seq_lens,
            min_partition,
            sliding_window or 0,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_SIZE=head_size,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
            SLIDING=sliding_window is not None,
        )
    return out
