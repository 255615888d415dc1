"""Fused random sampling (Triton): temperature -> top-k -> top-p -> min-p -> exponential race.

One program per row reads its logits a few times and writes one token id; no sort, no host sync,
nothing shaped by the values (capturable in a CUDA graph). Same definition as
``engine.sampling.sampler`` (the torch path, and the reference here):

* noise: q ~ Exp(1) from the counter-based hash of (seed, step, token id), bit for bit the
  sampler's ``exponential_noise`` (uint32 arithmetic, then float64 log, rounded to float32), so a
  request draws the same tokens on the CPU and the GPU, whatever shares its batch;
* top-k / top-p as thresholds on the logit instead of a sort. A float's bits, with the low 31 bits
  flipped when negative, order like the float ("key"). Both cuts keep {x : key(x) >= T}, where T is
  the smallest key with F(T) < bound, F(T) = the weight of the tokens whose key is above T:

      top-k   weight 1,               bound k            (T = the k-th largest logit; ties stay)
      top-p   weight exp(x - max),    bound top_p * Z    (the nucleus: mass strictly before < top_p)

  F falls as T grows, so T is found by a 16-ary search over the 2^32 keys: 8 passes over the row,
  each counting F at 15 candidate thresholds at once. Example, top-k 2 over logits (3, 1, 2, 2):
  F(key(2)) = 1 (only 3 is above) < 2, F(just below key(2)) = 3, so T = key(2) and 3, 2, 2 stay.
* min-p: probability >= min_p * the top probability, i.e. exp(x - max) >= min_p (no search).

Where the torch path sorts, ties at the top-p boundary may fall differently (it keeps an
order-dependent part of a tie; this keeps all of it), and sums round in another order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_V = 1024
_SEARCH_PASSES = 8  # 16-ary search: 2^32 keys, 4 bits a pass
_NUM_CAND = 16


@triton.jit
def _fmix32(h):  # type: ignore[no-untyped-def]
    # MurmurHash3's finaliser on uint32 (wrapping multiplies), as the sampler's _fmix32.
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit
def _noise(offs, k1, k2):  # type: ignore[no-untyped-def]
    """q ~ Exp(1) float32 for token ids ``offs``, keyed by the row's (k1, k2) uint32."""
    mixed = offs.to(tl.uint32) * 0x9E3779B1
    h = _fmix32(_fmix32(mixed ^ k1) ^ k2)
    u = (h.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)  # in (0, 1), never 0 or 1
    return (-tl.log(u)).to(tl.float32)


@triton.jit
def _order_key(x):  # type: ignore[no-untyped-def]
    """int32 that orders like the float32 x (x + 0.0 first: -0.0 and 0.0 are one value)."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _threshold(  # type: ignore[no-untyped-def]
    row_ptr,
    vocab,
    temp,
    row_max,
    floor,  # int32 key: tokens below it are already cut (by top-k)
    bound,
    WEIGHTED: tl.constexpr,  # weight exp(x - row_max) (top-p) or 1 (top-k)
    BLOCK_V: tl.constexpr,
    PASSES: tl.constexpr,
    NUM_CAND: tl.constexpr,
):
    """The smallest key T with F(T) < bound (module docstring); keep the tokens with key >= T."""
    lo = tl.full([], -2147483649, tl.int64)  # F(lo) >= bound: every token is above it
    hi = tl.full([], 2147483647, tl.int64)  # F(hi) = 0 < bound
    j = tl.arange(0, NUM_CAND)
    for _ in range(PASSES):
        step = (hi - lo + NUM_CAND - 1) // NUM_CAND
        cand = tl.minimum(lo + (j + 1).to(tl.int64) * step, hi)  # [NUM_CAND], the last is hi
        f = tl.zeros([NUM_CAND], dtype=tl.float32)
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            valid = offs < vocab
            x = tl.math.div_rn(tl.load(row_ptr + offs, mask=valid, other=float("-inf")), temp)
            key = _order_key(x)
            valid = valid & (key >= floor)
            if WEIGHTED:
                w = tl.where(valid, tl.exp(x - row_max), 0.0)
            else:
                w = tl.where(valid, 1.0, 0.0)
            above = key.to(tl.int64)[:, None] > cand[None, :]  # [BLOCK_V, NUM_CAND]
            f += tl.sum(tl.where(above, w[:, None], 0.0), axis=0)
        first = tl.min(tl.where(f < bound, j, NUM_CAND - 1), axis=0)  # the first candidate that holds
        new_hi = tl.sum(tl.where(j == first, cand, 0), axis=0)
        new_lo = tl.where(first == 0, lo, tl.sum(tl.where(j == first - 1, cand, 0), axis=0))
        lo, hi = new_lo, new_hi
    return hi.to(tl.int32)


@triton.jit
def _sample_kernel(  # type: ignore[no-untyped-def]
    out_ptr,  # [n] int64, the sampled token of each row
    logits_ptr,  # [n, V] float32 (penalised and masked; not yet divided by the temperature)
    temperature_ptr,  # [n] float32, > 0
    top_k_ptr,  # [n] int32, 0: off
    top_p_ptr,  # [n] float32, 1.0: off
    min_p_ptr,  # [n] float32, 0.0: off
    keys_ptr,  # [n, 2] int64: the row's two 32-bit noise keys (sampler.row_keys)
    vocab,
    stride_row,
    USE_TOP_K: tl.constexpr,
    USE_TOP_P: tl.constexpr,
    USE_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
    PASSES: tl.constexpr,
    NUM_CAND: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    temp = tl.load(temperature_ptr + row)

    row_max = tl.full([], float("-inf"), tl.float32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")), temp)
        row_max = tl.maximum(row_max, tl.max(x, axis=0))

    floor = tl.full([], -2147483648, tl.int32)  # keep everything
    if USE_TOP_K:
        k = tl.load(top_k_ptr + row)
        if k > 0:
            floor = _threshold(
                row_ptr, vocab, temp, row_max, floor, k.to(tl.float32), False, BLOCK_V, PASSES, NUM_CAND
            )
    if USE_TOP_P:
        top_p = tl.load(top_p_ptr + row)
        if top_p < 1.0:
            z = tl.zeros([BLOCK_V], dtype=tl.float32)  # softmax normaliser over the top-k survivors
            for start in range(0, vocab, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                x = tl.math.div_rn(tl.load(row_ptr + offs, mask=offs < vocab, other=float("-inf")), temp)
                z += tl.where(_order_key(x) >= floor, tl.exp(x - row_max), 0.0)
            bound = top_p * tl.sum(z, axis=0)
            floor = tl.maximum(
                floor,
                _threshold(row_ptr, vocab, temp, row_max, floor, bound, True, BLOCK_V, PASSES, NUM_CAND),
            )
    min_p = 0.0
    if USE_MIN_P:
        min_p = tl.load(min_p_ptr + row)

    k1 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k2 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    best = tl.full([], float("-inf"), tl.float32)
    best_idx = tl.full([], 0, tl.int32)
    for start in range(0, vocab, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < vocab
        x = tl.math.div_rn(tl.load(row_ptr + offs, mask=valid, other=float("-inf")), temp)
        keep = valid & (_order_key(x) >= floor)
        if USE_MIN_P:
            keep = keep & (tl.exp(x - row_max) >= min_p)
        q = _noise(offs, k1, k2)
        # argmax(p / q) == argmax(x - log q); the log in float64, rounded once.
        score = tl.where(keep, x - tl.log(q.to(tl.float64)).to(tl.float32), float("-inf"))
        tile_best = tl.max(score, axis=0)
        tile_idx = tl.argmax(score, axis=0).to(tl.int32) + start
        better = tile_best > best  # strict: the first index wins a tie, as torch's argmax
        best_idx = tl.where(better, tile_idx, best_idx)
        best = tl.where(better, tile_best, best)
    tl.store(out_ptr + row, best_idx.to(tl.int64))


@triton.jit
def _noise_kernel(out_ptr, keys_ptr, vocab, BLOCK_V: tl.constexpr):  # type: ignore[no-untyped-def]
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    k1 = tl.load(keys_ptr + 2 * row).to(tl.uint32)
    k2 = tl.load(keys_ptr + 2 * row + 1).to(tl.uint32)
    tl.store(out_ptr + row * vocab + offs, _noise(offs, k1, k2), mask=offs < vocab)


def exponential_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:  # [n, V] float32
    """The kernel's noise alone, for tests against the sampler's: keys [n, 2] int64."""
    assert keys.dim() == 2 and keys.shape[1] == 2 and keys.dtype == torch.int64 and keys.is_contiguous()
    out = torch.empty((keys.shape[0], vocab), dtype=torch.float32, device=keys.device)
    if keys.shape[0]:
        _noise_kernel[(keys.shape[0], triton.cdiv(vocab, _BLOCK_V))](out, keys, vocab, BLOCK_V=_BLOCK_V)
    return out


def sample(
    logits: torch.Tensor,  # [n, V] float32, penalised and masked
    temperature: torch.Tensor,  # [n] float32, > 0
    top_k: torch.Tensor,  # [n] int32, 0: off
    top_p: torch.Tensor,  # [n] float32 in (0, 1]
    min_p: torch.Tensor,  # [n] float32 in [0, 1]
    keys: torch.Tensor,  # [n, 2] int64, from sampler.row_keys
    *,
    use_top_k: bool = True,  # False when no row asks: skips the search passes
    use_top_p: bool = True,
    use_min_p: bool = True,
) -> torch.Tensor:  # [n] int64
    n, vocab = logits.shape
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "rows of float32 logits, contiguous"
    assert temperature.shape == (n,) and temperature.dtype == torch.float32
    assert top_k.shape == (n,) and top_k.dtype == torch.int32
    assert top_p.shape == (n,) and top_p.dtype == torch.float32
    assert min_p.shape == (n,) and min_p.dtype == torch.float32
    assert keys.shape == (n, 2) and keys.dtype == torch.int64 and keys.is_contiguous()
    devices = {t.device for t in (logits, temperature, top_k, top_p, min_p, keys)}
    assert len(devices) == 1, devices
    out = torch.empty(n, dtype=torch.int64, device=logits.device)
    if n == 0:
        return out
    _sample_kernel[(n,)](
        out,
        logits,
        temperature,
        top_k,
        top_p,
        min_p,
        keys,
        vocab,
        logits.stride(0),
        USE_TOP_K=use_top_k,
        USE_TOP_P=use_top_p,
        USE_MIN_P=use_min_p,
        BLOCK_V=min(_BLOCK_V, triton.next_power_of_2(vocab)),
        PASSES=_SEARCH_PASSES,
        NUM_CAND=_NUM_CAND,
        num_warps=8,  # the search tiles are [BLOCK_V, NUM_CAND]: 16k elements
    )
    return out
