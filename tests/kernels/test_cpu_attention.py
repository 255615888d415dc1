"""The C++ CPU attention kernels vs the torch reference over the Triton kernels' grid, and the
backend through store_kv + forward vs dense attention. The kernels read head-major caches with
key-interleaved K pages (KVLayout.HEAD_MAJOR_KT); the reference reads the same contents token-major."""

from __future__ import annotations

import functools

import pytest
import torch

from engine.attention import cpu_prefill
from engine.attention.backend import KVLayout, get_attention_backend
from engine.attention.cpu_backend import PREFILL_SDPA_MIN
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
    ([1, 64], [129, 64], 4, 2, 256, 64, torch.bfloat16),  # largest head size, pages of 4 key groups
    ([1, 1, 5, 1], [37, 3, 50, 64], 6, 2, 32, 4, torch.bfloat16),  # a group of 16 keys spans 4 pages
    ([1, 2], [19, 9], 4, 2, 64, 1, torch.float32),  # one key per page
]

KERNEL_LAYOUT = KVLayout.HEAD_MAJOR_KT
CPU = torch.device("cpu")


def _op(batch, scale, out=None, max_query_len=2**31):
    assert batch.layout is KERNEL_LAYOUT
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
    batch = paged_batch(
        [1, 40, 3], [50, 60, 3], 4, 2, 64, 16, torch.float32, device=CPU, layout=KERNEL_LAYOUT
    )
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
        query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, device=CPU, layout=KERNEL_LAYOUT
    )
    scale = head_size**-0.5
    got = _op(batch, scale)
    want = reference.paged_attention(
        batch.query,
        batch.token_major_cache(),
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_tables,
        scale,
    )
    assert got.dtype == dtype
    # Unused cache slots are NaN: a read past a request's context or outside its blocks shows here.
    assert not got.isnan().any()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


def test_kernel_reads_strided_query(paged_batch):
    """The model hands attention a view of the fused qkv projection: rows strided, heads contiguous."""
    batch = paged_batch([1, 5], [20, 5], 4, 2, 64, 16, torch.float32, device=CPU, layout=KERNEL_LAYOUT)
    wide = torch.randn(batch.query.shape[0], 4 * 64 + 99)
    wide[:, : 4 * 64] = batch.query.reshape(-1, 4 * 64)
    strided = wide[:, : 4 * 64].view(-1, 4, 64)
    assert not strided.is_contiguous()
    batch_strided = type(batch)(**{**batch.__dict__, "query": strided})
    torch.testing.assert_close(_op(batch_strided, 0.125), _op(batch, 0.125), atol=0, rtol=0)


def test_kernel_rejects_bad_input(paged_batch):
    batch = paged_batch([1], [9], 4, 2, 64, 16, torch.float32, device=CPU, layout=KERNEL_LAYOUT)
    with pytest.raises(RuntimeError, match="share a dtype"):
        _op(batch, 0.125, out=torch.empty_like(batch.query, dtype=torch.bfloat16))
    bad = type(batch)(**{**batch.__dict__, "seq_lens": batch.seq_lens.long()})
    with pytest.raises(RuntimeError, match="int32"):
        _op(bad, 0.125)
    with pytest.raises(RuntimeError, match="outside the cache"):
        torch.ops.inflight_cpu.store_kv(
            batch.query[:, :2], batch.query[:, :2], batch.kv_cache, torch.tensor([10**6])
        )


@pytest.mark.parametrize(
    ("num_kv_heads", "head_size", "block_size", "dtype"),
    [(1, 64, 16, torch.float32), (3, 64, 16, torch.bfloat16), (2, 128, 4, torch.float32)],
)
def test_store_kv_writes_each_token_into_its_heads_pages(num_kv_heads, head_size, block_size, dtype):
    gen = torch.Generator().manual_seed(0)
    num_blocks, num_tokens = 5, 11
    # K and V as views into a fused QKV output: token stride larger than Hkv * D.
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_size, generator=gen).to(dtype)
    kv_size = num_kv_heads * head_size
    key = qkv[:, kv_size : 2 * kv_size].view(num_tokens, num_kv_heads, head_size)
    value = qkv[:, 2 * kv_size :].view(num_tokens, num_kv_heads, head_size)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    slots[[2, 7]] = -1  # padding tokens
    token_major = torch.randn(2, num_blocks, block_size, num_kv_heads, head_size, generator=gen).to(dtype)
    cache = torch.empty(KERNEL_LAYOUT.shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype)
    KERNEL_LAYOUT.fill_from_token_major(cache, token_major)  # the same contents, in the kernel's layout
    assert torch.equal(KERNEL_LAYOUT.to_token_major(cache), token_major)
    reference.store_kvcache(key, value, token_major, slots)
    torch.ops.inflight_cpu.store_kv(key, value, cache, slots)
    assert torch.equal(KERNEL_LAYOUT.to_token_major(cache), token_major)
    # Spelled out for one token: in block slot // block_size, each head's V page holds it as row
    # slot % block_size; its K page as element (pair) slot % block_size of each of its D / P lines.
    slot = int(slots[0])
    block, row = slot // block_size, slot % block_size
    pack = 4 // cache.element_size()
    for h in range(num_kv_heads):
        lines = cache[0, block, h].reshape(head_size // pack, block_size, pack)
        assert torch.equal(lines[:, row].flatten(), key[0, h])
        assert torch.equal(cache[1, block, h, row], value[0, h])


@functools.cache
def _backend():
    return get_attention_backend("cpu")


@pytest.mark.parametrize(
    ("dtype", "head_size", "layout"),
    [
        (torch.float32, 64, KERNEL_LAYOUT),
        (torch.bfloat16, 64, KERNEL_LAYOUT),
        (torch.bfloat16, 256, KERNEL_LAYOUT),
        (torch.float32, 16, KERNEL_LAYOUT),
        (torch.float16, 64, KVLayout.TOKEN_MAJOR),  # the torch fallback's dtype
        (torch.float32, 24, KVLayout.TOKEN_MAJOR),  # not a multiple of 16
        (torch.float32, 512, KVLayout.TOKEN_MAJOR),  # past the kernel's largest head
    ],
)
def test_backend_declares_its_layout_exactly_for_the_kernel_shapes(dtype, head_size, layout):
    assert _backend().kv_layout(dtype, head_size, CPU) is layout
    assert get_attention_backend("torch").kv_layout(dtype, head_size, CPU) is KVLayout.TOKEN_MAJOR


LONG_CHUNK_CASES = [
    # long chunks (>= PREFILL_SDPA_MIN tokens): a whole prompt (SDPA: is_causal) and a later chunk
    # (SDPA: the bottom-right mask), next to short ones the kernel always takes
    ([1, 70, 1, 33], [90, 70, 5, 100], 9, 3, 64, 16, torch.float32),
    ([48, 1], [48, 200], 8, 2, 64, 16, torch.bfloat16),
]


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"),
    BACKEND_CASES,
)
def test_backend_store_then_attend_matches_dense(
    paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype
):
    _store_then_attend_matches_dense(
        paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype
    )


@pytest.mark.parametrize("route", ["kernel", "sdpa"])
@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "hq", "hkv", "head_size", "block_size", "dtype"), LONG_CHUNK_CASES
)
def test_long_chunks_match_dense_through_either_prefill_route(
    paged_batch,
    dense_attention,
    monkeypatch,
    route,
    query_lens,
    seq_lens,
    hq,
    hkv,
    head_size,
    block_size,
    dtype,
):
    calls = []
    real = cpu_prefill.sdpa_prefill

    def counted(*a, **kw):
        calls.append((a[0].shape[0], kw.get("own_kv") is not None))
        return real(*a, **kw)

    monkeypatch.setattr(cpu_prefill, "sdpa_prefill", counted)
    monkeypatch.setenv("INFLIGHT_CPU_PREFILL_ATTENTION", route)
    got = _store_then_attend_matches_dense(
        paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype
    )
    long_chunks = [n for n in query_lens if n >= PREFILL_SDPA_MIN]
    assert calls == ([(n, False) for n in long_chunks] if route == "sdpa" else [])
    # Given the step's own K/V (as the model passes them), a whole prompt attends them instead of the
    # cache (a later chunk still reads the cache), with the same result.
    calls.clear()
    own = _store_then_attend_matches_dense(
        paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, own_kv=True
    )
    whole = [n == s for n, s in zip(query_lens, seq_lens, strict=True) if n >= PREFILL_SDPA_MIN]
    assert calls == ([(n, w) for n, w in zip(long_chunks, whole, strict=True)] if route == "sdpa" else [])
    assert torch.equal(own, got)


def _store_then_attend_matches_dense(
    paged_batch, dense_attention, query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, own_kv=False
):
    backend = _backend()
    layout = backend.kv_layout(dtype, head_size, CPU)
    assert layout is KERNEL_LAYOUT
    batch = paged_batch(
        query_lens, seq_lens, hq, hkv, head_size, block_size, dtype, device=CPU, layout=layout
    )
    want = dense_attention(batch, head_size**-0.5)
    new_k, new_v = _fresh_step(batch)
    metadata = batch.metadata()
    backend.store_kv(new_k, new_v, batch.kv_cache, metadata)
    new_kv = (new_k, new_v) if own_kv else None
    got = backend.forward(batch.query, batch.kv_cache, metadata, head_size**-0.5, new_kv=new_kv)
    torch.testing.assert_close(got.float(), want, **TOL[dtype])
    return got


@pytest.mark.parametrize(("head_size", "dtype"), [(24, torch.float32), (64, torch.float16)])
def test_backend_falls_back_for_shapes_the_kernel_does_not_take(
    paged_batch, dense_attention, head_size, dtype
):
    # Head size 24 is not a multiple of 16, float16 is not a kernel dtype: the torch path serves
    # them from a token-major cache, store and attention, with the same answer.
    backend = _backend()
    layout = backend.kv_layout(dtype, head_size, CPU)
    batch = paged_batch([1, 4], [30, 4], 4, 2, head_size, 16, dtype, device=CPU, layout=layout)
    want = dense_attention(batch, head_size**-0.5)
    new_k, new_v = _fresh_step(batch)
    metadata = batch.metadata()
    backend.store_kv(new_k, new_v, batch.kv_cache, metadata)
    got = backend.forward(batch.query, batch.kv_cache, metadata, head_size**-0.5)
    tol = {"atol": 2e-3, "rtol": 2e-3} if dtype == torch.float16 else TOL[dtype]
    torch.testing.assert_close(got.float(), want, **tol)


def test_backend_attends_a_query_of_another_dtype_in_the_caches(paged_batch, dense_attention):
    batch = paged_batch([1, 3], [40, 3], 4, 2, 64, 16, torch.bfloat16, device=CPU, layout=KERNEL_LAYOUT)
    want = dense_attention(batch, 0.125)
    new_k, new_v = _fresh_step(batch)
    metadata = batch.metadata()
    backend = _backend()
    backend.store_kv(new_k.float(), new_v.float(), batch.kv_cache, metadata)
    got = backend.forward(batch.query.float(), batch.kv_cache, metadata, 0.125)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, **TOL[torch.bfloat16])


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
