"""Mixture of experts in Triton: one grouped launch per GEMM for all of a layer's experts.

The T * k (token, expert) pairs are sorted by expert and each expert's run is padded to a multiple of
BLOCK_M (``moe_align_block_size``), so every BLOCK_M-row block of the sorted list belongs to exactly one
expert. One launch then covers every block of every expert: a program reads its block's expert id and
multiplies its rows by that expert's weights. The layer is::

    gate_up = grouped_gemm(hidden rows, w13)       [T * k, 2I]   one launch
    act     = act(gate) * up                       [T * k, I]    one launch
    down    = weight * grouped_gemm(act, w2)       [T * k, H]    one launch, float32
    out     = down.view(T, k, H).sum(1)            [T, H]

Rows are indexed by pair p = t * k + j throughout: the first GEMM reads hidden row p // k, writes row p;
the second reads and writes row p. Under CUDA graphs nothing here syncs with the host: the grid is
sized for the worst-case padding and programs past the real padded length return at once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.kernels._common import is_interpreted
from engine.kernels.moe_reference import check_moe_args

_ACTIVATION_CODES = {"silu": 0, "gelu_tanh": 1}
_ACT_BLOCK = 1024  # elements of one output row per program of the activation kernel


def moe_align_block_size(
    topk_ids: torch.Tensor,  # [T, k] int32/int64, in [0, E) or -1 (not this rank's expert)
    block_m: int,
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs sorted by expert, each expert's run padded to a multiple of ``block_m``; -1 pairs left out.

    Returns ``sorted_pair_ids`` [max_padded] int32 (pair indices t * k + j; padding holds T * k, one past
    the last pair), ``block_expert_ids`` [max_padded / block_m] int32 (the expert of each block; -1 past
    the used blocks) and ``num_pairs_post_padded`` [1] int32 (how many entries of ``sorted_pair_ids`` are
    used). ``max_padded`` is the worst case, T * k + min(E, T * k) * (block_m - 1): only experts that
    received a pair are padded, and at most block_m - 1 rows each. Sizes never depend on the ids, so the
    result needs no host sync.

    Worked example, topk_ids = [[5, 1], [1, 7], [5, 1]] (T = 3, k = 2), block_m = 4, E = 8::

        pair ids p   0  1  2  3  4  5        flat ids [5, 1, 1, 7, 5, 1]
        counts       expert 1: 3, 5: 2, 7: 1  -> padded to 4 each: 12 rows used of max 6 + 6 * 3 = 24
        sorted_pair_ids    [1, 2, 5, 6 | 0, 4, 6, 6 | 3, 6, 6, 6 | 6 ...]   (6 = padding)
        block_expert_ids   [1, 5, 7, -1, -1, -1]
        num_pairs_post_padded  [12]
    """
    device = topk_ids.device
    flat_ids = topk_ids.reshape(-1).long()  # [N], N = T * k
    num_pairs = flat_ids.numel()
    max_padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    max_padded = triton.cdiv(max_padded, block_m) * block_m
    # Bucket E collects the -1 pairs; it is counted so the sort places it last, and never padded.
    buckets = torch.where(flat_ids < 0, num_experts, flat_ids)  # [N] in [0, E]
    # scatter_add_ rather than bincount: bincount sizes its output from the data (a host sync).
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, buckets, torch.ones_like(buckets))  # [E + 1]
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts] = 0
    padded_end = padded.cumsum(0)  # [E + 1] where each expert's padded run ends
    padded_start = padded_end - padded
    padded_start[num_experts] = max_padded  # -1 pairs land past the end, in the slack cut off below
    unpadded_start = counts.cumsum(0) - counts  # [E + 1] where each run starts in the unpadded sort
    sorted_buckets, order = torch.sort(buckets, stable=True)  # [N] each
    # Sorted position i holds the (i - unpadded_start)-th pair of its expert: shift it to the padded run.
    rank = torch.arange(num_pairs, device=device) - unpadded_start[sorted_buckets]
    sorted_pair_ids = torch.full((max_padded + num_pairs,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids[padded_start[sorted_buckets] + rank] = order.to(torch.int32)
    # Block b belongs to the first expert whose cumulative block count exceeds b.
    block_ends = padded_end[:num_experts] // block_m  # [E]
    blocks = torch.arange(max_padded // block_m, device=device)
    block_expert_ids = torch.searchsorted(block_ends, blocks, right=True)
    block_expert_ids = torch.where(block_expert_ids < num_experts, block_expert_ids, -1).to(torch.int32)
    num_post_padded = padded_end[num_experts - 1 : num_experts].to(torch.int32)
    return sorted_pair_ids[:max_padded], block_expert_ids, num_post_padded


@triton.jit
def _grouped_gemm_kernel(  # type: ignore[no-untyped-def]
    a_ptr,  # [rows, K]; row of pair p is p // PAIRS_PER_A_ROW
    b_ptr,  # [E, N, K]: each expert's weight, applied as a @ b[e].T
    c_ptr,  # [num_pairs, N]; row p
    weights_ptr,  # [num_pairs] float32 routing weights (read when MUL_WEIGHT)
    sorted_pair_ids_ptr,  # [max_padded] int32, padding = num_pairs
    block_expert_ids_ptr,  # [max_padded / BLOCK_M] int32
    num_post_padded_ptr,  # [1] int32
    N,
    K,
    num_pairs,
    num_n_blocks,
    stride_am,
    stride_ak,
    stride_be,
    stride_bn,
    stride_bk,
    stride_cm,
    stride_cn,
    PAIRS_PER_A_ROW: tl.constexpr,  # k for the first GEMM (A = hidden), 1 for the second (A = act)
    MUL_WEIGHT: tl.constexpr,  # scale each row by its routing weight (the second GEMM)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # upcast tiles before tl.dot (the interpreter cannot multiply bf16)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 models: tf32 would lose ~3 digits
):
    pid = tl.program_id(0)
    block = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    # The grid covers the worst-case padding; blocks past the real one have no rows.
    if block * BLOCK_M >= tl.load(num_post_padded_ptr):
        return
    expert = tl.load(block_expert_ids_ptr + block).to(tl.int64)
    pairs = tl.load(sorted_pair_ids_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_mask = pairs < num_pairs  # padding rows load zeros and store nothing
    a_rows = (pairs // PAIRS_PER_A_ROW).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BLOCK_M, BLOCK_K]
    # b[e] is [N, K]; the tile is read transposed, [BLOCK_K, BLOCK_N], so that a @ tile = a @ b[e].T.
    b_ptrs = b_ptr + expert * stride_be + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = offs_k < K - k0
        a = tl.load(a_ptrs, mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        if DOT_FP32:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if MUL_WEIGHT:
        # Rounded to the model dtype first, as HF's down projection output is, then weighted in float32.
        weight = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0)
        acc = acc.to(a_ptr.dtype.element_ty).to(tl.float32) * weight[:, None]
    c_ptrs = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_mask[:, None] & n_mask[None, :])


@triton.jit
def _act_and_mul_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [M, I] contiguous
    x_ptr,  # [M, 2I]: gate in [:, :I], up in [:, I:]
    stride_x,
    inter,
    ACTIVATION: tl.constexpr,  # 0: SiLU, 1: GELU (tanh approximation)
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    if ACTIVATION == 0:
        act = gate * tl.sigmoid(gate)
    else:
        # 0.5 * (1 + tanh(z)) == sigmoid(2z), so GELU-tanh(x) = x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3));
        # 1.5957691216057308 is 2 sqrt(2/pi).
        act = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    # Rounded to the model dtype before the product, as HF's act_fn(gate) * up is.
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * inter + offs, (act * up).to(out_ptr.dtype.element_ty), mask=mask)


def _act_and_mul(x: torch.Tensor, activation: str) -> torch.Tensor:  # [M, 2I] -> [M, I]
    num_rows, inter = x.shape[0], x.shape[1] // 2
    out = torch.empty((num_rows, inter), dtype=x.dtype, device=x.device)
    block = min(_ACT_BLOCK, triton.next_power_of_2(inter))
    _act_and_mul_kernel[(num_rows, triton.cdiv(inter, block))](
        out, x, x.stride(0), inter, ACTIVATION=_ACTIVATION_CODES[activation], BLOCK=block
    )
    return out


def choose_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block: about the rows an active expert gets, so decode steps waste little padding."""
    rows_per_expert = triton.cdiv(num_pairs, min(num_experts, num_pairs))
    return min(64, max(16, triton.next_power_of_2(rows_per_expert)))


def _grouped_gemm(
    a: torch.Tensor,  # [rows, K]
    b: torch.Tensor,  # [E, N, K]
    c: torch.Tensor,  # [num_pairs, N]
    weights: torch.Tensor,  # [num_pairs] float32
    sorted_pair_ids: torch.Tensor,
    block_expert_ids: torch.Tensor,
    num_post_padded: torch.Tensor,
    pairs_per_a_row: int,
    mul_weight: bool,
    block_m: int,
) -> None:
    """c[p] = (weights[p] if mul_weight else 1) * a[p // pairs_per_a_row] @ b[expert of p].T: one launch."""
    num_n, k_dim = b.shape[1], b.shape[2]
    assert a.shape[1] == k_dim and c.shape[1] == num_n, (tuple(a.shape), tuple(b.shape), tuple(c.shape))
    block_n = min(64, max(16, triton.next_power_of_2(num_n)))
    block_k = min(64 if a.element_size() == 2 else 32, max(16, triton.next_power_of_2(k_dim)))
    num_n_blocks = triton.cdiv(num_n, block_n)
    grid = (block_expert_ids.shape[0] * num_n_blocks,)
    _grouped_gemm_kernel[grid](
        a,
        b,
        c,
        weights,
        sorted_pair_ids,
        block_expert_ids,
        num_post_padded,
        num_n,
        k_dim,
        c.shape[0],
        num_n_blocks,
        a.stride(0),
        a.stride(1),
        b.stride(0),
        b.stride(1),
        b.stride(2),
        c.stride(0),
        c.stride(1),
        PAIRS_PER_A_ROW=pairs_per_a_row,
        MUL_WEIGHT=mul_weight,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        DOT_FP32=is_interpreted(a) and a.dtype != torch.float32,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
    )


def fused_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]: gate rows, then up rows
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k] int32/int64, in [0, E) or -1 (see moe_reference)
    activation: str = "silu",
) -> torch.Tensor:  # [T, H], hidden's dtype
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(hidden[t]): two grouped GEMM launches in all."""
    check_moe_args(hidden, w13, w2, topk_weights, topk_ids, activation)
    assert hidden.device == w13.device == w2.device == topk_weights.device == topk_ids.device
    assert hidden.stride(1) == 1 and w13.stride(2) == 1 and w2.stride(2) == 1, "rows must be contiguous"
    num_tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    hidden_size = hidden.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(hidden)
    block_m = choose_block_m(num_pairs, num_experts)
    sorted_pair_ids, block_expert_ids, num_post_padded = moe_align_block_size(topk_ids, block_m, num_experts)
    weights = topk_weights.reshape(-1).contiguous()  # [T * k], pair order

    gate_up = torch.empty((num_pairs, 2 * inter), dtype=hidden.dtype, device=hidden.device)
    align = (sorted_pair_ids, block_expert_ids, num_post_padded)
    _grouped_gemm(
        hidden, w13, gate_up, weights, *align, pairs_per_a_row=top_k, mul_weight=False, block_m=block_m
    )
    act = _act_and_mul(gate_up, activation)  # [T * k, I]; rows of -1 pairs are garbage, never read
    # Zeros: the rows of -1 pairs are in no block, so nothing else writes them.
    down = torch.zeros((num_pairs, hidden_size), dtype=torch.float32, device=hidden.device)
    _grouped_gemm(act, w2, down, weights, *align, pairs_per_a_row=1, mul_weight=True, block_m=block_m)
    # The k weighted contributions of each token, summed in float32 and rounded once.
    return down.view(num_tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
