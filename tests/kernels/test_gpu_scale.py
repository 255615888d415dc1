"""GPU-only kernel checks at sizes the interpreter cannot reach (run by scripts/gpu_check.sh).

* A KV cache past 2**31 elements per half: element offsets of the last blocks overflow int32, so
  the store and attention kernels must compute them in int64.
* Split-K at the captured max_model_len: CUDA graphs launch attention with max_seq_len fixed at
  max_model_len whatever the step's real lengths; short and long requests must still be exact.
"""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.cache import store_kvcache
from engine.kernels.paged_attention import paged_attention

BF16_TOL = {"atol": 2e-2, "rtol": 1e-2}


@pytest.mark.gpu
def test_kv_cache_past_int32_elements_gpu() -> None:
    num_kv_heads, head_size, block_size = 8, 128, 16
    per_block = block_size * num_kv_heads * head_size  # 16384 elements
    num_blocks = (1 << 31) // per_block + 64  # each half holds more than 2**31 elements (~8.6 GB bf16)
    kv_cache = torch.empty(
        (2, num_blocks, block_size, num_kv_heads, head_size), dtype=torch.bfloat16, device="cuda"
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    seq_len = 200
    # The request's blocks are the last ones, shuffled: their offsets sit past 2**31.
    blocks = num_blocks - 1 - torch.randperm(13, device="cuda", generator=gen)
    block_table = blocks.to(torch.int32)[None, :]
    pos = torch.arange(seq_len, device="cuda")
    slots = blocks[pos // block_size] * block_size + pos % block_size
    assert int(slots.min()) * num_kv_heads * head_size > 2**31
    key = torch.randn((seq_len, num_kv_heads, head_size), device="cuda", generator=gen).bfloat16()
    value = torch.randn((seq_len, num_kv_heads, head_size), device="cuda", generator=gen).bfloat16()
    store_kvcache(key, value, kv_cache, slots)
    k, v = reference.gather_kv(kv_cache, block_table[0], seq_len)
    assert torch.equal(k, key) and torch.equal(v, value)

    query = torch.randn((1, 32, head_size), device="cuda", generator=gen).bfloat16()
    qsl = torch.tensor([0, 1], dtype=torch.int32, device="cuda")
    lens = torch.tensor([seq_len], dtype=torch.int32, device="cuda")
    for num_splits in (None, 1):
        out = paged_attention(
            query, kv_cache, qsl, lens, block_table, 0.088, max_query_len=1, num_splits=num_splits
        )
        want = reference.paged_attention(query, kv_cache, qsl, lens, block_table, 0.088)
        torch.testing.assert_close(out.float(), want.float(), **BF16_TOL)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 16, 64])
def test_split_k_at_captured_max_model_len_gpu(paged_batch, batch: int) -> None:
    # Lengths from 1 to ~3k under a max_seq_len of 8192, the value a captured graph launches with.
    seq_lens = [1 + (i * 977) % 3000 for i in range(batch)]
    b = paged_batch([1] * batch, seq_lens, 32, 8, 128, 16, torch.bfloat16)
    out = paged_attention(
        b.query,
        b.kv_cache,
        b.query_start_loc,
        b.seq_lens,
        b.block_tables,
        0.088,
        max_query_len=1,
        max_seq_len=8192,
    )
    want = reference.paged_attention(
        b.query, b.kv_cache, b.query_start_loc, b.seq_lens, b.block_tables, 0.088
    )
    torch.testing.assert_close(out.float(), want.float(), **BF16_TOL)
