"""Long prefill chunks on the CPU: the C++ kernel or torch's flash SDPA, whichever this host runs faster.

A chunk of many query tokens is compute-bound (O(L x context)), and which of the two paths wins it
depends on the CPU, not on the model. On a 2-core AMD EPYC with AVX-512 and AVX512_BF16 (no AMX), one
SmolLM2-shaped prompt of 256-4,096 tokens at one and two threads, float32 and bf16, took SDPA 1.4-2.8x
the kernel's time (``python -m bench.cpu_prefill_bench``; docs/benchmarks.md): SDPA's float32 GEMMs
are MKL's, which take a slower path on AMD CPUs, and its bf16 ones have no AMX there. Where SDPA's
bf16 GEMMs run on AMX tiles it can be the faster one. So the engine times both, once per attention
shape and thread count, on a probe prompt of ``PROBE_TOKENS`` tokens, and sends long chunks to SDPA
only if it is clearly faster (``SDPA_MARGIN``): the kernel reads the cache in place, SDPA needs the context
gathered first. ``INFLIGHT_CPU_PREFILL_ATTENTION`` forces either path.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine import envs
from engine.attention.backend import key_pages
from engine.attention.torch_backend import attend_masked
from engine.kernels.reference import window_start

log = logging.getLogger(__name__)

PROBE_TOKENS = 256  # long enough to be compute-bound, short enough to time in milliseconds
PROBE_BLOCK_SIZE = 16
SDPA_MARGIN = 1.15  # SDPA must beat the kernel's time by this factor to be chosen
_REPEATS = 3


@dataclass(frozen=True)
class PrefillShape:
    num_heads: int
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype


@dataclass(frozen=True)
class PrefillChoice:
    route: str  # "kernel" | "sdpa"
    kernel_s: float | None  # the probe's times; None when the route was forced
    sdpa_s: float | None


def pick(kernel_s: float, sdpa_s: float) -> str:
    """The route for these probe times: SDPA only when clearly faster."""
    return "sdpa" if sdpa_s * SDPA_MARGIN < kernel_s else "kernel"


def choose(shape: PrefillShape) -> PrefillChoice:
    """The route of long prefill chunks of this shape at the current torch thread count."""
    forced = envs.cpu_prefill_attention()
    if forced != "auto":
        return PrefillChoice(forced, None, None)
    return _timed(shape, torch.get_num_threads())


@functools.cache
def _timed(shape: PrefillShape, threads: int) -> PrefillChoice:
    kernel_s, sdpa_s = time_paths(*probe(shape), threads)
    choice = PrefillChoice(pick(kernel_s, sdpa_s), kernel_s, sdpa_s)
    log.info(
        "CPU prefill attention: %s (a %d-token prompt, heads %d/%d x %d, %s, %d threads: kernel %.2f ms, "
        "SDPA %.2f ms)",
        choice.route,
        PROBE_TOKENS,
        shape.num_heads,
        shape.num_kv_heads,
        shape.head_size,
        str(shape.dtype).removeprefix("torch."),
        threads,
        kernel_s * 1e3,
        sdpa_s * 1e3,
    )
    return choice


def time_paths(
    kernel: Callable[[], None], sdpa: Callable[[], None], threads: int, repeats: int = _REPEATS
) -> tuple[float, float]:
    """The best of ``repeats`` timed calls of each, interleaved so that a slow moment of the host hits
    both; one thread: the calling thread's CPU time, which other processes preempting it do not inflate."""
    clock = time.thread_time if threads == 1 else time.perf_counter
    kernel_s, sdpa_s = float("inf"), float("inf")
    kernel()  # first calls allocate and fault in their buffers
    sdpa()
    for _ in range(repeats):
        start = clock()
        kernel()
        kernel_s = min(kernel_s, clock() - start)
        start = clock()
        sdpa()
        sdpa_s = min(sdpa_s, clock() - start)
    return kernel_s, sdpa_s


def probe(shape: PrefillShape, tokens: int = PROBE_TOKENS) -> tuple[Callable[[], None], Callable[[], None]]:
    """Calls that attend one whole prompt of ``tokens`` tokens through each path (kernel, SDPA), on
    a cache of HEAD_MAJOR_KT's size (random contents: only the time counts)."""
    n = tokens
    num_blocks = -(-n // PROBE_BLOCK_SIZE)
    gen = torch.Generator().manual_seed(0)
    query = torch.randn((n, shape.num_heads, shape.head_size), generator=gen).to(shape.dtype)
    kv_cache = torch.randn(
        (2, num_blocks, shape.num_kv_heads, PROBE_BLOCK_SIZE, shape.head_size), generator=gen
    ).to(shape.dtype)
    starts = torch.tensor([0, n], dtype=torch.int32)
    lens = torch.tensor([n], dtype=torch.int32)
    table = torch.arange(num_blocks, dtype=torch.int32)
    out = torch.empty_like(query)
    scale = shape.head_size**-0.5

    def kernel() -> None:
        torch.ops.inflight_cpu.paged_attention(out, query, kv_cache, starts, lens, table[None], scale, n)

    def sdpa() -> None:
        sdpa_prefill(query, kv_cache, table, n, scale)

    return kernel, sdpa


def sdpa_prefill(
    query: torch.Tensor,  # [L, Hq, D], the request's last L positions
    kv_cache: torch.Tensor,  # HEAD_MAJOR_KT, [2, num_blocks, Hkv, block_size, D] in size
    block_table: torch.Tensor,  # [max_blocks] int32
    seq_len: int,
    scale: float,
    sliding_window: int | None = None,
    logits_soft_cap: float | None = None,
    own_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # this chunk's K/V, [L, Hkv, D] each
) -> torch.Tensor:  # [L, Hq, D]
    """One request's chunk through torch's SDPA, its context gathered once (O(context), small next to
    the attention) and the bottom-right causal mask. With a window the context is gathered from the
    page holding the first query's window start (pages before it are never read) and the mask also
    hides keys at or before q - W; a soft cap (which SDPA does not take) goes through the torch
    backend's explicit softmax. A whole prompt (L == seq_len) given ``own_kv``, the values the cache
    holds for it, attends them as they are: no gather."""
    num_queries = query.shape[0]
    block_size = kv_cache.shape[3]
    first = window_start(seq_len - num_queries, sliding_window)
    if own_kv is not None and num_queries == seq_len:
        k, v = (t.transpose(0, 1)[None] for t in own_kv)  # [1, Hkv, L, D]; first is 0
    else:
        first_block = first // block_size
        blocks = block_table[first_block : -(-seq_len // block_size)].long()
        # One copy of the context from `first`, whole pages: [nb, Hkv, block_size, D] -> [1, Hkv, N, D],
        # K's pages from their key-interleaved lines; key j of it sits at position first + j.
        keep = slice(first - first_block * block_size, seq_len - first_block * block_size)
        k = key_pages(kv_cache[0].index_select(0, blocks)).transpose(0, 1).flatten(1, 2)[None, :, keep]
        v = kv_cache[1].index_select(0, blocks).transpose(0, 1).flatten(1, 2)[None, :, keep]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, Hq, L, D]
    if num_queries == seq_len and sliding_window is None and logits_soft_cap is None:
        # A whole prompt: the usual causal mask.
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:  # query i sits at position seq_len - L + i (bottom-right aligned)
        q_pos = torch.arange(seq_len - num_queries, seq_len)
        k_pos = torch.arange(first, seq_len)
        allowed = k_pos[None, :] <= q_pos[:, None]
        if sliding_window is not None:
            allowed &= k_pos[None, :] > q_pos[:, None] - sliding_window
        if logits_soft_cap is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale, enable_gqa=True)
        else:
            o = attend_masked(q.float(), k.float(), v.float(), allowed, scale, logits_soft_cap).to(q.dtype)
    return o[0].transpose(0, 1)
