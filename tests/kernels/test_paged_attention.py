"""Triton paged attention vs the torch reference (and the reference vs dense attention)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import reference
from engine.kernels.paged_attention import SPLIT_CHOICES, choose_num_splits, paged_attention

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}

# (query_lens, seq_lens, Hq, Hkv, head_size, block_size, dtype). A query shorter than its seq_len is a
# decode or a later prefill chunk; lengths avoid multiples of the block size on purpose.
CASES = [
    ([1], [37], 4, 1, 64, 16, torch.float32),  # one decode, GQA 4
    ([1, 7, 1], [50, 7, 19], 8, 1, 128, 16, torch.float32),  # decodes around a first chunk, GQA 8
    ([5, 1, 12, 1], [33, 70, 12, 2], 2, 2, 64, 32, torch.bfloat16),  # later chunk + fresh prompt, MHA
    ([1, 1, 3, 1, 9, 1, 1, 2], [3, 40, 20, 17, 9, 65, 1, 33], 4, 1, 64, 16, torch.bfloat16),  # 8 requests
    ([17, 30], [17, 45], 4, 1, 128, 32, torch.float32),  # prefill only, chunk spanning blocks
    ([1, 1, 1, 1, 1], [5, 16, 33, 64, 90], 8, 1, 64, 32, torch.bfloat16),  # decode only, GQA 8
    ([20, 1], [52, 31], 8, 2, 16, 16, torch.float32),  # smallest head size, GQA 4 over 2 kv heads
]


def _run(batch, scale, **kwargs):
    return paged_attention(
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        **kwargs,
    )


def _reference(batch, scale):
    return reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )


@pytest.mark.parametrize(("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"), CASES)
def test_matches_reference(paged_batch, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype):
    batch = paged_batch(query_lens, seq_lens, hq, hkv, head_size, block_size, dtype)
    scale = head_size**-0.5
    out = _run(batch, scale)
    want = _reference(batch, scale)
    assert out.dtype == dtype and out.shape == batch.query.shape
    torch.testing.assert_close(out.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "num_splits"), [([1, 7, 1], [50, 7, 19], None), ([1, 1], [530, 77], 3)]
)
def test_every_row_written_without_zero_fill(paged_batch, query_lens, seq_lens, num_splits):
    # No padding tokens: the output starts uninitialised (NaN here, so a missed row shows).
    batch = paged_batch(query_lens, seq_lens, 8, 2, 64, 16)
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        return real_empty(*args, **kwargs).fill_(float("nan"))

    torch.empty = nan_empty  # type: ignore[assignment]
    try:
        out = _run(batch, 0.1, num_splits=num_splits, all_rows_owned=True)
    finally:
        torch.empty = real_empty  # type: ignore[assignment]
    torch.testing.assert_close(out, _reference(batch, 0.1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(("hkv", "dtype"), [(1, torch.float32), (2, torch.bfloat16)])
def test_reference_matches_dense(paged_batch, dense_attention, hkv, dtype):
    batch = paged_batch([1, 6, 1], [29, 6, 40], 8, hkv, 64, 16, dtype)
    want = dense_attention(batch, 0.125)
    torch.testing.assert_close(_reference(batch, 0.125).float(), want, **TOL[dtype])


@pytest.mark.parametrize(
    ("num_splits", "hq", "hkv", "head_size", "block_size", "dtype"),
    [
        (2, 8, 1, 64, 16, torch.float32),
        (3, 8, 2, 128, 32, torch.bfloat16),
        (None, 4, 1, 64, 16, torch.float32),  # the heuristic splits: 2 programs, 8 interpreter "SMs"
    ],
)
def test_split_k_decode(paged_batch, num_splits, hq, hkv, head_size, block_size, dtype):
    # Contexts of very different lengths: the short one leaves later partitions empty.
    batch = paged_batch([1, 1], [530, 77], hq, hkv, head_size, block_size, dtype)
    if num_splits is None:
        assert choose_num_splits(2, hkv, 530, 8) > 1
    out = _run(batch, 0.1, num_splits=num_splits)
    torch.testing.assert_close(out.float(), _reference(batch, 0.1).float(), **TOL[dtype])


def test_split_k_matches_unsplit(paged_batch):
    batch = paged_batch([1, 1, 1], [300, 12, 129], 4, 1, 64, 16)
    torch.testing.assert_close(
        _run(batch, 0.1, num_splits=4), _run(batch, 0.1, num_splits=1), atol=1e-6, rtol=0
    )


def test_padding_rows_and_empty_requests_are_zero(paged_batch):
    batch = paged_batch([2, 1], [9, 20], 4, 2, 64, 16)
    # A request with nothing scheduled, and two padding tokens after the last request (CUDA-graph style).
    batch.query_start_loc = torch.tensor([0, 2, 2, 3], dtype=torch.int32, device=batch.query.device)
    batch.seq_lens = torch.tensor([9, 5, 20], dtype=torch.int32, device=batch.query.device)
    batch.block_tables = torch.cat([batch.block_tables[:1], batch.block_tables[:1], batch.block_tables[1:]])
    batch.query = torch.cat([batch.query, torch.randn_like(batch.query[:2])])
    out = _run(batch, 0.1)
    torch.testing.assert_close(out, _reference(batch, 0.1), atol=2e-5, rtol=1e-5)
    assert torch.all(out[3:] == 0)


def test_strided_query_view(paged_batch):
    # The model passes q as a view into the fused QKV projection output.
    batch = paged_batch([4, 1], [4, 23], 4, 1, 64, 16)
    fused = torch.cat([batch.query.flatten(1), torch.randn(5, 2 * 64, device=batch.query.device)], dim=1)
    query = fused[:, : 4 * 64].view(5, 4, 64)
    assert not query.is_contiguous()
    out = paged_attention(
        query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, 0.1
    )
    torch.testing.assert_close(out, _reference(batch, 0.1), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("num_splits", [None, 6])
def test_split_k_lengths_far_below_max_seq_len(paged_batch, num_splits):
    # A captured CUDA graph launches with max_seq_len = max_model_len; each request still splits by
    # its own length: 5 and 40 use one partition (written directly, not merged), 530 uses two (or six).
    batch = paged_batch([1, 1, 1], [5, 40, 530], 4, 1, 64, 16)
    out = _run(batch, 0.1, max_query_len=1, max_seq_len=4096, num_splits=num_splits)
    torch.testing.assert_close(out, _reference(batch, 0.1), atol=2e-5, rtol=1e-5)
    if num_splits is None:
        # Same partitions as when the bound is the step's real maximum: graph and eager agree bitwise.
        assert torch.equal(out, _run(batch, 0.1, max_query_len=1))
        # A request that uses one partition gets exactly the unsplit kernel's result.
        assert torch.equal(out[:2], _run(batch, 0.1, num_splits=1)[:2])


def test_heuristic_splits_are_the_warmed_up_choices():
    # The warm-up compiles SPLIT_CHOICES; the heuristic must never ask for another count.
    for num_seqs in (1, 2, 3, 5, 7, 16, 24, 33, 64, 128):
        for max_seq_len in (1, 200, 300, 700, 1500, 5000, 8192, 131072):
            for num_sms in (8, 78, 132):
                assert choose_num_splits(num_seqs, 8, max_seq_len, num_sms) in SPLIT_CHOICES


def test_choose_num_splits():
    # 64 x 8 = 512 programs already cover 132 SMs: no split, no merge.
    assert choose_num_splits(num_seqs=64, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1
    assert (
        choose_num_splits(num_seqs=16, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 4
    )  # 5, rounded down
    assert choose_num_splits(num_seqs=256, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 1
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=8192, num_sms=132) == 32
    assert choose_num_splits(num_seqs=1, num_kv_heads=1, max_seq_len=131072, num_sms=132) == 32  # capped
    assert choose_num_splits(num_seqs=1, num_kv_heads=8, max_seq_len=300, num_sms=132) == 1  # too short


@pytest.mark.gpu
@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_large_mixed_batch_gpu(paged_batch, gqa):
    gen = torch.Generator().manual_seed(gqa)
    seq_lens = torch.randint(1, 3000, (24,), generator=gen).tolist()
    chunks = torch.randint(1, 600, (24,), generator=gen).tolist()
    query_lens = [min(s, q) for s, q in zip(seq_lens, chunks, strict=True)]
    query_lens[::2] = [1] * len(query_lens[::2])  # half decodes
    batch = paged_batch(query_lens, seq_lens, 2 * gqa, 2, 128, 16, torch.bfloat16)
    out = _run(batch, 128**-0.5)
    torch.testing.assert_close(out.float(), _reference(batch, 128**-0.5).float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_long_decode_gpu(paged_batch, num_splits):
    batch = paged_batch([1] * 16, [8192 - 37 * i for i in range(16)], 32, 4, 128, 16, torch.bfloat16)
    out = _run(batch, 128**-0.5, num_splits=num_splits)
    torch.testing.assert_close(out.float(), _reference(batch, 128**-0.5).float(), **TOL[torch.bfloat16])
