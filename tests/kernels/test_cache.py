"""Triton K/V scatter vs the torch reference: exact, including skipped (-1) slots."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.cache import store_kvcache


@pytest.mark.parametrize(
    ("num_kv_heads", "head_size", "block_size", "dtype"),
    [(1, 64, 16, torch.float32), (2, 128, 32, torch.bfloat16), (4, 80, 16, torch.float32)],
)
def test_store_matches_reference(device, num_kv_heads, head_size, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 5, 11
    # K and V as views into a fused QKV output: token stride larger than Hkv * D.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen).to(dtype).to(device)
    key = qkv[:, num_kv_heads * head_size : 2 * num_kv_heads * head_size].view(
        num_tokens, num_kv_heads, head_size
    )
    value = qkv[:, 2 * num_kv_heads * head_size :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    slots = slots.to(device)
    cache = (
        torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype).to(device)
    )
    want = cache.clone()
    reference.store_kvcache(key, value, want, slots)
    store_kvcache(key, value, cache, slots)
    assert torch.equal(cache, want)
    assert not torch.equal(want, want.new_zeros(()).expand_as(want))


def test_reference_store_then_gather_roundtrip():
    gen = torch.Generator().manual_seed(1)
    block_size, seq_len = 4, 7
    key = torch.randn(seq_len, 2, 16, generator=gen)
    value = torch.randn(seq_len, 2, 16, generator=gen)
    table = torch.tensor([3, 0], dtype=torch.int32)  # positions 0-3 in block 3, 4-6 in block 0
    pos = torch.arange(seq_len)
    slots = table[pos // block_size].long() * block_size + pos % block_size
    cache = torch.zeros(2, 4, block_size, 2, 16)
    reference.store_kvcache(key, value, cache, slots)
    k, v = reference.gather_kv(cache, table, seq_len)
    assert torch.equal(k, key) and torch.equal(v, value)
    assert torch.equal(cache[0, 3, 1], key[1]) and torch.equal(cache[1, 0, 2], value[6])
