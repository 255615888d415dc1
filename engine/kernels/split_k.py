"""Split-K for the decode variant of paged attention (engine/kernels/paged_attention.py): how many
partitions a request's context is cut into, and the kernel that merges their partial outputs.

A partition writes its unnormalised output, running max (log2 domain) and sum of exponentials; the
merge rescales each to the global max and divides once, which is the softmax over the whole context.
"""

from __future__ import annotations

import triton
import triton.language as tl

# A partition shorter than this spends more on the merge than it gains in parallelism.
MIN_PARTITION = 256
# Enough programs in flight per SM that K/V loads of one hide the latency of another.
_PROGRAMS_PER_SM = 4
# The merge holds every partition's [D] partial in registers.
MAX_SPLITS = 32
# The heuristic's split counts: powers of two, so a server compiles (and warms up) six variants.
SPLIT_CHOICES = (1, 2, 4, 8, 16, 32)


@triton.jit
def request_splits(seq_len, min_partition, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """(used splits, partition length) of one request: partitions of at least min_partition
    positions, at most NUM_SPLITS of them, each a multiple of BLOCK_N; none starts past seq_len."""
    wanted = tl.maximum(1, tl.minimum(NUM_SPLITS, seq_len // min_partition))
    partition = tl.cdiv(tl.cdiv(seq_len, wanted), BLOCK_N) * BLOCK_N
    return tl.cdiv(seq_len, partition), partition


@triton.jit
def window_base(first_pos, sliding_window, BLOCK_N: tl.constexpr):  # type: ignore[no-untyped-def]
    """(first key any row needs, start of the BLOCK_N tile holding it) for rows from first_pos on."""
    lo = tl.maximum(first_pos - sliding_window + 1, 0)
    return lo, (lo // BLOCK_N) * BLOCK_N


@triton.jit
def merge_splits_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [T, Hq, D]
    part_acc_ptr,  # [T, Hq, NUM_SPLITS, D] float32
    part_max_ptr,  # [T, Hq, NUM_SPLITS] float32
    part_sum_ptr,  # [T, Hq, NUM_SPLITS] float32
    query_start_loc_ptr,  # [S + 1] int32
    seq_lens_ptr,  # [S] int32
    min_partition,
    sliding_window,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SLIDING: tl.constexpr = False,
):
    # One program per (request, query head); split-K runs on decode-only steps: one token each.
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_start = tl.load(query_start_loc_ptr + seq)
    if tl.load(query_start_loc_ptr + seq + 1) == q_start:  # a request with nothing scheduled
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    kv_base = 0
    if SLIDING:  # the span the attention kernel cut into partitions
        _, kv_base = window_base(seq_len - 1, sliding_window, BLOCK_N)
    num_used, _ = request_splits(seq_len - kv_base, min_partition, NUM_SPLITS, BLOCK_N)
    if num_used == 1:  # the attention kernel wrote the final output itself
        return
    token = q_start.to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_used  # only the partitions this request used were written
    row = (token * NUM_HEADS + head) * NUM_SPLITS + offs_s  # [SPLITS_PAD]
    m = tl.load(part_max_ptr + row, mask=s_mask, other=float("-inf"))
    l_part = tl.load(part_sum_ptr + row, mask=s_mask, other=0.0)
    m_all = tl.max(m, axis=0)
    m_ref = tl.where(m_all == float("-inf"), 0.0, m_all)
    w = tl.math.exp2(m - m_ref)  # rescales each partition to the global max
    a_mask = s_mask[:, None] & (offs_d[None, :] < HEAD_SIZE)
    acc = tl.load(part_acc_ptr + row[:, None] * HEAD_SIZE + offs_d[None, :], mask=a_mask, other=0.0)
    total = tl.sum(w * l_part, axis=0)
    out = tl.sum(w[:, None] * acc, axis=0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_SIZE,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """The most splits a request may use: split-K only when the plain grid (one program per request
    and kv head) leaves SMs idle, and every partition stays long."""
    programs = num_seqs * num_kv_heads
    if programs >= num_sms:  # every SM already has a program; a merge would only add work
        return 1
    wanted = min(triton.cdiv(_PROGRAMS_PER_SM * num_sms, programs), max_seq_len // MIN_PARTITION, MAX_SPLITS)
    return 1 << (wanted.bit_length() - 1) if wanted > 1 else 1  # rounded down to SPLIT_CHOICES
