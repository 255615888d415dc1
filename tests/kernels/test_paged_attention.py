"""Triton paged attention vs the torch reference (and the reference vs dense attention)."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import paged_attention as pa
from engine.kernels import reference
from engine.kernels._common import DecodeConfig
from engine.kernels.paged_attention import SPLIT_CHOICES, choose_num_splits, paged_attention

TOL = {torch.float32: {"atol": 2e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}
# Two launches of different compiled variants (another NUM_SPLITS, hence another merge width) may
# associate float32 sums differently on a GPU: outputs here are weighted means of N(0, 1) values
# (|x| < 5), so a few ulp of float32 stay well inside 1e-5. The interpreter's numpy arithmetic is
# the same for both variants, so there the check is exact.
SAME_VARIANT_TOL = {"atol": 1e-5, "rtol": 1e-5} if torch.cuda.is_available() else {"atol": 0.0, "rtol": 0.0}

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
    # The merge re-associates the softmax sums: float32 rounding of values below 5 in magnitude.
    batch = paged_batch([1, 1, 1], [300, 12, 129], 4, 1, 64, 16)
    torch.testing.assert_close(
        _run(batch, 0.1, num_splits=4), _run(batch, 0.1, num_splits=1), atol=2e-6, rtol=1e-6
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
        # Same partitions as when the bound is the step's real maximum (another NUM_SPLITS variant).
        torch.testing.assert_close(out, _run(batch, 0.1, max_query_len=1), **SAME_VARIANT_TOL)
        # A request that uses one partition gets the unsplit kernel's result.
        torch.testing.assert_close(out[:2], _run(batch, 0.1, num_splits=1)[:2], **SAME_VARIANT_TOL)


def test_flat_grid_finds_every_request(paged_batch, monkeypatch):
    # GQA 4 and a 40-token chunk: BLOCK_M 128, so BLOCK_Q 32 and the chunk spans two flat blocks;
    # ten requests make the binary search take several steps; decodes sit between the chunks.
    query_lens = [1, 3, 1, 40, 1, 2, 33, 1, 5, 1]
    seq_lens = [40, 3, 17, 45, 1, 2, 33, 65, 20, 9]
    batch = paged_batch(query_lens, seq_lens, 4, 1, 16, 16)
    real_empty = torch.empty
    # No zero-fill, and the output starts as NaN: a row no program finds stays NaN.
    monkeypatch.setattr(torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    out = _run(batch, 0.3, all_rows_owned=True)
    monkeypatch.undo()
    torch.testing.assert_close(out, _reference(batch, 0.3), **TOL[torch.float32])


class _LaunchRecorder:
    """Stands in for the attention kernel: records each launch's grid and constexprs, runs nothing."""

    def __init__(self) -> None:
        self.launches: list[tuple[tuple[int, ...], dict[str, object]]] = []

    def __getitem__(self, grid: tuple[int, ...]):
        def launch(*args: object, **kwargs: object) -> None:
            self.launches.append((grid, kwargs))

        return launch


def test_mixed_step_grid_is_flat_and_decodes_take_the_decode_variant(monkeypatch):
    # Llama-3-8B heads, a 2048-token step: 64 decodes and one 1984-token chunk. Launches are recorded,
    # not run, so the tensors only need the right shapes.
    recorder = _LaunchRecorder()
    monkeypatch.setattr(pa, "_paged_attention_kernel", recorder)
    num_seqs, num_tokens = 65, 2048
    query = torch.empty((num_tokens, 32, 128), dtype=torch.bfloat16)
    kv_cache = torch.empty((2, 4, 16, 8, 128), dtype=torch.bfloat16)
    starts = torch.tensor([*range(65), num_tokens], dtype=torch.int32)
    seq_lens = torch.full((num_seqs,), 3000, dtype=torch.int32)
    block_tables = torch.zeros((num_seqs, 4), dtype=torch.int32)
    paged_attention(
        query, kv_cache, starts, seq_lens, block_tables, 0.1, max_query_len=1984, all_rows_owned=True
    )
    (flat_grid, flat), (decode_grid, decode) = recorder.launches
    # Flat: BLOCK_M 128 over GROUP 4 is BLOCK_Q 32; 2048 // 32 + 65 blocks per kv head (a grid sized
    # by the longest query would be 65 x 62 tiles per kv head, 31x more programs).
    assert flat["FLAT"] is True and flat["BLOCK_Q"] == 32
    assert flat_grid == (2048 // 32 + 65, 8)
    # Decodes: the decode variant's 16-row tile (4 tokens x 4 heads), one program per request.
    assert decode["FLAT"] is False and decode["BLOCK_Q"] == 4 and decode["NUM_SPLITS"] == 1
    assert decode_grid == (65, 8)


def test_decode_only_step_launches_the_decode_variant_alone(monkeypatch):
    recorder = _LaunchRecorder()
    monkeypatch.setattr(pa, "_paged_attention_kernel", recorder)
    query = torch.empty((64, 32, 128), dtype=torch.bfloat16)
    kv_cache = torch.empty((2, 4, 16, 8, 128), dtype=torch.bfloat16)
    starts = torch.arange(65, dtype=torch.int32)
    paged_attention(
        query,
        kv_cache,
        starts,
        torch.full((64,), 50, dtype=torch.int32),
        torch.zeros((64, 4), dtype=torch.int32),
        0.1,
        max_query_len=1,
        decode_config=DecodeConfig(block_n=128, num_warps=8, num_stages=2),
    )
    ((grid, kwargs),) = recorder.launches
    assert grid == (64, 8) and kwargs["FLAT"] is False
    assert (kwargs["BLOCK_N"], kwargs["num_warps"], kwargs["num_stages"]) == (128, 8, 2)


@pytest.mark.parametrize(
    ("config", "num_splits"),
    [(DecodeConfig(block_n=16, num_warps=8), 3), (DecodeConfig(block_n=128, num_stages=2), None)],
)
def test_decode_config_overrides(paged_batch, config, num_splits):
    # BLOCK_N sets the partition granularity of split-K (and the merge's); the result must not move.
    batch = paged_batch([1, 1], [530, 77], 4, 1, 32, 16)
    out = _run(batch, 0.1, num_splits=num_splits, decode_config=config)
    torch.testing.assert_close(out, _reference(batch, 0.1), **TOL[torch.float32])


def test_decode_config_rejects_bad_values():
    for bad in ({"block_n": 48}, {"block_n": 8}, {"num_warps": 3}, {"num_stages": 0}):
        with pytest.raises(ValueError):
            DecodeConfig(**bad)  # type: ignore[arg-type]


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
