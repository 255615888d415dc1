"""Kernel tests run the Triton kernels under the interpreter when there is no GPU.

Triton picks the interpreter when a kernel is decorated, i.e. when ``engine.kernels.*`` is first
imported, so the variable is set here, at conftest import, before any test module loads. It is
process-wide: other test directories that import triton later in the same run get the interpreter
too, which is the only way triton runs without CUDA anyway.
"""

from __future__ import annotations

import itertools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from engine.attention.backend import AttentionMetadata, KVLayout

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With GPU_CHECK_TESTS_REPORT set (by bench/gpu_check.py), every test's outcome is appended to that
    file as the test ends, so a stage cut off at its cap keeps each failure so far."""
    path = os.environ.get("GPU_CHECK_TESTS_REPORT")
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "seconds": round(report.duration, 3),
        "longrepr": str(report.longrepr)[-4000:] if report.failed else None,
    }
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


@pytest.fixture(autouse=True)
def _skip_gpu_tests_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None and not torch.cuda.is_available():
        pytest.skip("needs CUDA")


@dataclass
class PagedBatch:
    """A packed step whose K/V is already in a paged cache, plus the dense K/V it came from."""

    query: torch.Tensor  # [T, Hq, D]
    keys: list[torch.Tensor]  # per request [seq_len, Hkv, D], positions 0..seq_len-1
    values: list[torch.Tensor]  # per request [seq_len, Hkv, D]
    kv_cache: torch.Tensor  # in ``layout``; unused slots hold NaN
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, slots of this step's tokens
    layout: KVLayout = KVLayout.TOKEN_MAJOR

    def token_major_cache(self) -> torch.Tensor:
        """The cache's contents as [2, num_blocks, block_size, Hkv, D] (a copy; ``layout`` writes back)."""
        return self.layout.to_token_major(self.kv_cache)

    def metadata(self) -> AttentionMetadata:
        starts = self.query_start_loc.tolist()
        query_lens = [b - a for a, b in itertools.pairwise(starts)]
        return AttentionMetadata(
            num_tokens=self.query.shape[0],
            num_seqs=len(query_lens),
            max_query_len=max(query_lens),
            max_seq_len=int(self.seq_lens.max()),
            query_start_loc=self.query_start_loc,
            seq_lens=self.seq_lens,
            block_tables=self.block_tables,
            slot_mapping=self.slot_mapping,
            query_start_loc_cpu=starts,
            seq_lens_cpu=self.seq_lens.tolist(),
            decode_only=all(n == 1 for n in query_lens),
        )


def make_paged_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    device: torch.device = DEVICE,
    layout: KVLayout = KVLayout.TOKEN_MAJOR,
) -> PagedBatch:
    """Random K/V scattered over shuffled blocks; unused cache slots are NaN so stray reads show."""
    assert len(query_lens) == len(seq_lens) and all(q <= s for q, s in zip(query_lens, seq_lens, strict=True))
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 2  # two spare blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    kv_cache = torch.full((2, num_blocks, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    block_tables = torch.zeros((len(seq_lens), max(blocks_per_seq)), dtype=torch.int32)
    keys, values, slots = [], [], []
    used = 0
    for r, (q_len, s_len) in enumerate(zip(query_lens, seq_lens, strict=True)):
        blocks = order[used : used + blocks_per_seq[r]]
        used += blocks_per_seq[r]
        block_tables[r, : len(blocks)] = blocks.to(torch.int32)
        pos = torch.arange(s_len)
        seq_slots = blocks[pos // block_size] * block_size + pos % block_size
        k = torch.randn((s_len, num_kv_heads, head_size), generator=gen).to(dtype)
        v = torch.randn((s_len, num_kv_heads, head_size), generator=gen).to(dtype)
        kv_cache[0].view(-1, num_kv_heads, head_size)[seq_slots] = k
        kv_cache[1].view(-1, num_kv_heads, head_size)[seq_slots] = v
        keys.append(k.to(device))
        values.append(v.to(device))
        slots.append(seq_slots[s_len - q_len :])
    query = torch.randn((sum(query_lens), num_heads, head_size), generator=gen).to(dtype)
    starts = torch.tensor([0, *query_lens], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    laid_out = torch.empty(layout.shape(num_blocks, block_size, num_kv_heads, head_size), dtype=dtype)
    layout.fill_from_token_major(laid_out, kv_cache)
    return PagedBatch(
        query=query.to(device),
        keys=keys,
        values=values,
        kv_cache=laid_out.to(device),
        query_start_loc=starts.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=block_tables.to(device),
        slot_mapping=torch.cat(slots).to(device),
        layout=layout,
    )


def dense_causal_attention(batch: PagedBatch, scale: float) -> torch.Tensor:  # [T, Hq, D] float32
    """Naive attention from the dense K/V, independent of any paging: one request and head at a time."""
    num_heads = batch.query.shape[1]
    starts = batch.query_start_loc.tolist()
    out = torch.zeros(batch.query.shape, dtype=torch.float32, device=batch.query.device)
    for r, (k, v) in enumerate(zip(batch.keys, batch.values, strict=True)):
        q = batch.query[starts[r] : starts[r + 1]].float()
        q_len, s_len = q.shape[0], k.shape[0]
        group = num_heads // k.shape[1]
        k_rep = k.float().repeat_interleave(group, dim=1)  # [s_len, Hq, D]
        v_rep = v.float().repeat_interleave(group, dim=1)
        allowed = torch.ones(q_len, s_len, dtype=torch.bool, device=q.device).tril(s_len - q_len)
        for h in range(num_heads):
            scores = (q[:, h] @ k_rep[:, h].T) * scale
            scores = scores.masked_fill(~allowed, float("-inf"))
            out[starts[r] : starts[r + 1], h] = scores.softmax(-1) @ v_rep[:, h]
    return out


@pytest.fixture
def paged_batch() -> Callable[..., PagedBatch]:
    return make_paged_batch


@pytest.fixture
def dense_attention() -> Callable[[PagedBatch, float], torch.Tensor]:
    return dense_causal_attention


@pytest.fixture
def device() -> torch.device:
    return DEVICE
