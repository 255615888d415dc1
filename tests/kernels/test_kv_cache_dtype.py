"""The 8-bit KV cache (kv_cache_dtype int8 / fp8_e4m3, engine/kernels/kv_quant.py) on every path: the
torch reference's format, the Triton store and attention (interpreter without a GPU), the C++ CPU
store and attention, and the torch backend.

Two bounds per attention path: against the reference reading the same 8-bit cache (the kernel's own
error: float32 summation order, 1e-5), and against attention over the float cache it was quantized
from (the format's error, stated in ATTN_TOL)."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import KVLayout, get_attention_backend
from engine.attention.torch_backend import TorchAttentionBackend
from engine.kernels import cpu as cpu_kernels
from engine.kernels import kv_quant, reference
from engine.kernels.cache import store_kvcache
from engine.kernels.paged_attention import paged_attention
from tests.kernels.conftest import PagedBatch

DTYPES = [torch.int8, torch.float8_e4m3fn]
# Attention outputs over N(0, 1) keys and values, 8-bit cache against float cache, max abs error.
# int8: a code is within half a step (max |x| / 254) of its value; fp8 e4m3 keeps 3 mantissa bits
# (relative error up to 2^-4). Measured on this grid: 0.014 int8, 0.087 fp8.
ATTN_TOL = {torch.int8: 0.03, torch.float8_e4m3fn: 0.12}
KERNEL_TOL = {"atol": 1e-5, "rtol": 1e-5}
CPU = torch.device("cpu")
needs_cpu_kernels = pytest.mark.skipif(
    not cpu_kernels.load_kv_quant(), reason="the 8-bit cache's C++ kernels could not be built here"
)


def test_row_format_worked_example():
    # kv_quant.py's docstring: D 4, s = 1.27 / 127 = 0.01.
    rows = kv_quant.quantize(torch.tensor([[0.5, -1.27, 0.0, 0.254]]), torch.int8)
    assert rows.dtype == torch.int8 and rows.shape == (1, 8)
    assert rows[0, :4].tolist() == [50, -127, 0, 25]
    assert rows[0, 4:].contiguous().view(torch.float32).item() == pytest.approx(0.01)
    assert (
        kv_quant.row_elements(torch.int8, 64) == 68
        and kv_quant.bytes_per_token_head(torch.bfloat16, 64) == 128
    )
    with pytest.raises(ValueError, match="multiple of 4"):
        kv_quant.row_elements(torch.float8_e4m3fn, 6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_error_bound(dtype):
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(0)) * 3
    x[0] = 0.0  # an all-zero row keeps scale 0, not NaN
    back = kv_quant.round_trip(x, dtype)
    scale = x.abs().amax(-1, keepdim=True) / kv_quant.qmax(dtype)
    if dtype == torch.int8:
        bound = scale / 2 + 1e-6
    else:  # relative 2^-4 in the normal range, 2^-10 of the scale in the subnormal one
        bound = torch.maximum(x.abs() / 16, scale / 1024) + 1e-6
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[0], torch.zeros(32))


def _keys_values(num_tokens: int, num_kv_heads: int, head_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    # As views into a fused QKV output (token stride past Hkv * D), with a tiny and a large value.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen) * 2
    qkv[0, num_kv_heads * head_size : num_kv_heads * head_size + 3] = torch.tensor([1e-5, -2e-3, 300.0])
    size = num_kv_heads * head_size
    key = qkv[:, size : 2 * size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * size :].view(num_tokens, num_kv_heads, head_size)
    return key, value


@pytest.mark.parametrize("path", ["triton", pytest.param("cpu", marks=needs_cpu_kernels)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_matches_reference(path, dtype):
    num_blocks, block_size, num_kv_heads, head_size = 4, 8, 2, 32
    key, value = _keys_values(11, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(2))[:11]
    slots[[2, 7]] = -1  # padding tokens: not stored
    row = kv_quant.row_elements(dtype, head_size)
    want = torch.zeros(2, num_blocks, block_size, num_kv_heads, row, dtype=dtype)
    reference.store_kvcache(key, value, want, slots)
    if path == "triton":
        got = torch.zeros_like(want)
        store_kvcache(key, value, got, slots)
    else:
        layout = KVLayout.HEAD_MAJOR  # the CPU backend's layout for an 8-bit cache
        cache = torch.zeros(layout.shape(num_blocks, block_size, num_kv_heads, row), dtype=dtype)
        torch.ops.inflight_cpu.store_kv_quant(key, value, cache, slots)
        got = layout.to_token_major(cache)
    # The same codes and scales (compared as values: -0 and +0 codes are one value).
    assert torch.equal(kv_quant.dequantize(got), kv_quant.dequantize(want))
    stored = slots[slots >= 0]
    assert kv_quant.dequantize(want).view(2, -1, num_kv_heads, head_size)[:, stored].abs().sum() > 0


def _quantized(batch: PagedBatch, dtype: torch.dtype) -> torch.Tensor:
    """The batch's float cache (token-major; unused slots NaN, zeroed here) as an 8-bit cache."""
    return kv_quant.quantize(torch.nan_to_num(batch.kv_cache), dtype)


def _attend(path: str, batch: PagedBatch, cache: torch.Tensor, scale: float, **kw: object) -> torch.Tensor:
    if path == "triton":
        return paged_attention(
            batch.query, cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale, **kw
        )  # type: ignore[arg-type]
    if path == "torch":
        return TorchAttentionBackend().forward(batch.query, cache, batch.metadata(), scale, **kw)  # type: ignore[arg-type]
    head_major = torch.empty(
        KVLayout.HEAD_MAJOR.shape(*cache.shape[1:3], *cache.shape[3:]), dtype=cache.dtype
    )
    KVLayout.HEAD_MAJOR.fill_from_token_major(head_major, cache)
    return get_attention_backend("cpu").forward(batch.query, head_major, batch.metadata(), scale, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["torch", "triton", pytest.param("cpu", marks=needs_cpu_kernels)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_attention_reads_the_8bit_cache(paged_batch, path, dtype):
    # A decode, a first prefill chunk spanning blocks and another decode; GQA 2.
    batch = paged_batch([1, 11, 1], [30, 11, 9], 4, 2, 32, 8, torch.float32, device=CPU)
    scale = 32**-0.5
    cache = _quantized(batch, dtype)
    out = _attend(path, batch, cache, scale)
    args = (batch.query_start_loc, batch.seq_lens, batch.block_tables, scale)
    torch.testing.assert_close(out, reference.paged_attention(batch.query, cache, *args), **KERNEL_TOL)
    error = (out - reference.paged_attention(batch.query, batch.kv_cache, *args)).abs().max().item()
    assert 0 < error <= ATTN_TOL[dtype]


@needs_cpu_kernels
def test_cpu_kernel_window_soft_cap_and_bf16(paged_batch):
    # The C++ kernel's sliding window (keys before it never read: they are NaN-poisoned here) and soft
    # cap, with a bf16 query.
    batch = paged_batch([1, 13], [40, 29], 4, 1, 16, 4, torch.float32, device=CPU)
    cache = _quantized(batch, torch.int8)
    first_live = 40 - 6  # the decode's window: keys 34..39
    block = int(batch.block_tables[0, first_live // 4 - 1])
    cache[:, block].view(torch.uint8)[..., 16:] = 0xFF  # NaN scales before the window: never to be read
    query = batch.query.to(torch.bfloat16)
    bf16_batch = PagedBatch(**{**batch.__dict__, "query": query})
    out = _attend("cpu", bf16_batch, cache, 0.25, sliding_window=6, logits_soft_cap=5.0)
    want = reference.paged_attention(
        query.float(), cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.25, 6, 5.0
    )
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=1e-2)


@needs_cpu_kernels
@pytest.mark.parametrize("dtype", DTYPES)
def test_cpu_kernel_portable_copy_matches(paged_batch, dtype):
    # The kernel's generic copy (what hosts without AVX-512 run) against the one this host picks.
    batch = paged_batch([1, 11, 1], [30, 11, 9], 4, 2, 32, 8, torch.float32, device=CPU)
    cache = torch.empty(KVLayout.HEAD_MAJOR.shape(batch.kv_cache.shape[1], 8, 2, 36), dtype=dtype)
    KVLayout.HEAD_MAJOR.fill_from_token_major(cache, _quantized(batch, dtype))
    args = (cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 32**-0.5)
    host, portable = torch.empty_like(batch.query), torch.empty_like(batch.query)
    torch.ops.inflight_cpu.paged_attention_quant(host, batch.query, *args)
    torch.ops.inflight_cpu.paged_attention_quant(portable, batch.query, *args, portable=True)
    torch.testing.assert_close(portable, host, **KERNEL_TOL)
