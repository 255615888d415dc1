"""The C++ CPU attention kernels vs the torch reference over the Triton kernels' grid, and the
backend through store_kv + forward vs dense attention."""

from __future__ import annotations

import pytest
import torch

from engine.attention.backend import get_attention_backend
from engine.kernels import cpu as cpu_kernels
from engine.kernels import reference
from tests.kernels.test_attention_backends import CASES as BACKEND_CASES
from tests.kernels.test_attention_backends import _fresh_step
from tests.kernels.test_paged_attention import CASES as KERNEL_CASES

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="the C++ CPU kernels could not be built here")

TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.bfloat16: {"atol": 2e-2, "rtol": 1e-2}}

EXTRA_CASES = [
    # (query_lens, seq_lens, Hq, Hkv, head_size, block_size, dtype)
    ([1] * 9, [1, 2, 15, 16, 17, 31, 32, 33, 300], 9, 3, 64, 16, torch.float32),  # GQA 3 (SmolLM2)
    ([40, 1, 17], [40, 500, 100], 8, 2, 64, 16, torch.bfloat16),  # chunks spanning tiles of 8 queries
    ([3, 1], [3, 70], 4, 4, 128, 8, torch.float32),  # small blocks, MHA
    ([1, 64], [129, 64], 4, 2, 256, 64, torch.bfloat16),  # largest head size
]


def _op(batch, scale, out=None, max_query_len=2**31):
    out = torch.empty_like(batch.query) if out is None else out
    torch.ops.inflight_cpu.paged_attention(
        out,
        batch.query,
        batch.kv_cache,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
        max_query_len,
    )
    return out


def test_kernel_leaves_longer_requests_to_the_caller(paged_batch):
    batch = paged_batch([1, 40, 3], [50, 60, 3], 4, 2, 64, 16, torch.float32, device=torch.device("cpu"))
    out = torch.full_like(batch.query, 7.0)
    _op(batch, 0.125, out=out, max_query_len=31)
    assert torch.all(out[1:41] == 7.0)  # the 40-token chunk: untouched
    full = _op(batch, 0.125)
    torch.testing.assert_close(out[:1], full[:1], atol=0, rtol=0)
    torch.testing.assert_close(out[41:], full[41:], atol=0, rtol=0)


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"), KERNEL_CASES + EXTRA_CASES
)
def test_kernel_matches_reference(paged_batch, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype):
    batch = paged_batch(
        query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, device=torch.device("cpu")
    )
    scale = head_size**-0.5
    got = _op(batch, scale)
    want = reference.paged_attention(
        batch.query, batch.kv_cache, batch.query_start_loc, batch.seq_lens, batch.block_tables, scale
    )
    assert got.dtype == dtype
    # Unused cache slots are NaN: a read past a request's context or outside its blocks shows here.
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_kernel_reads_strided_query(paged_batch):
    """The model hands attention a view of the fused qkv projection: rows strided, heads contiguous."""
    batch = paged_batch([1, 5], [20, 5], 4, 2, 64, 16, torch.float32, device=torch.device("cpu"))
    wide = torch.randn(batch.query.shape[0], 4 * 64 + 99)
    wide[:, : 4 * 64] = batch.query.reshape(-1, 4 * 64)
    strided = wide[:, : 4 * 64].view(-1, 4, 64)
    assert not strided.is_contiguous()
    batch_strided = type(batch)(**{**batch.__dict__, "query": strided})
    torch.testing.assert_close(_op(batch_strided, 0.125), _op(batch, 0.125), atol=0, rtol=0)


def test_kernel_rejects_bad_input(paged_batch):
    batch = paged_batch([1], [9], 4, 2, 64, 16, torch.float32, device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="share a dtype"):
        _op(batch, 0.125, out=torch.empty_like(batch.query, dtype=torch.bfloat16))
    bad = type(batch)(**{**batch.__dict__, "seq_lens": batch.seq_lens.long()})
    with pytest.raises(RuntimeError, match="int32"):
        _op(bad, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.inflight_cpu.store_kv(
            batch.query[:, :2], batch.query[:, :2], batch.kv_cache, torch.tensor([10**6])
        )


LONG_CHUNK_CASES = [
    # long chunks go through SDPA: a whole prompt (is_causal) and a later chunk (bottom-right mask)
    ([1, 70, 1, 33], [90, 70, 5, 100], 9, 3, 64, 16, torch.float32),
    ([48, 1], [48, 200], 8, 2, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"),
    BACKEND_CASES + LONG_CHUNK_CASES,
)
def test_backend_store_then_attend_matches_dense(
    paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype
):
    batch = paged_batch(
        query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, device=torch.device("cpu")
    )
    want = dense_attention(batch, head_size**-0.5)
    new_k, new_v = _fresh_step(batch)
    backend = get_attention_backend("cpu")
    metadata = batch.metadata()
    backend.store_kv(new_k, new_v, batch.kv_cache, metadata)
    got = backend.forward(batch.query, batch.kv_cache, metadata, head_size**-0.5)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])


def test_backend_falls_back_for_shapes_the_kernel_does_not_take(paged_batch, dense_attention):
    # head size 24 is not a multiple of 16: the torch path serves it, same answer.
    batch = paged_batch([1, 4], [30, 4], 4, 2, 24, 16, torch.float32, device=torch.device("cpu"))
    want = dense_attention(batch, 24**-0.5)
    got = get_attention_backend("cpu").forward(batch.query, batch.kv_cache, batch.metadata(), 24**-0.5)
    torch.testing.assert_close(got, want, **TOL[torch.float32])


def test_a_host_that_cannot_build_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """No compiler (simulated: the build raises): load() says no once, warns once, and the engine's
    auto backend resolves to torch instead of crashing."""
    from torch.utils import cpp_extension

    from engine.config import EngineArgs, EngineConfig
    from engine.models.tiny import write_tiny_checkpoint

    def broken_build(**kwargs):
        raise RuntimeError("Error building extension 'inflight_cpu': g++: command not found")

    monkeypatch.setattr(cpp_extension, "load", broken_build)
    monkeypatch.setenv("INFLIGHT_CPU_EXT_DIR", str(tmp_path / "ext"))
    cpu_kernels.load.cache_clear()
    try:
        with caplog.at_level("WARNING", logger="engine.kernels.cpu"):
            assert cpu_kernels.load() is False
            assert cpu_kernels.load() is False  # cached: no second build attempt, no second warning
        warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "g++: command not found" in warnings[0].getMessage()
        path = write_tiny_checkpoint(tmp_path / "m", arch="llama")
        config = EngineConfig.resolve(EngineArgs(model=str(path), device="cpu"))
        assert config.attention_backend == "torch"
    finally:
        monkeypatch.undo()
        cpu_kernels.load.cache_clear()
        assert cpu_kernels.load()  # the real build (cached on disk) for the tests after this one
