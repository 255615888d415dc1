"""Compile, at engine start, every Triton variant a step can launch, so none compiles mid-serving.

A variant is a set of constexpr values. Per model and dtype, the per-step choices are:

    paged attention   decode: NUM_SPLITS in SPLIT_CHOICES (the heuristic rounds to these), each
                      with its merge; prefill / mixed: BLOCK_M 64 or 128 (by the longest query)
    sampling          USE_TOP_K x USE_TOP_P x USE_MIN_P (which knobs any row of the step uses)

Integer arguments that change every step are not specialised on (``do_not_specialize``), and the
other kernels (norms, rotary, SiLU, KV store) have one variant per model, compiled by the first
forward (the CUDA-graph warm-up). The piecewise graphs of mixed steps (engine/runner/
piecewise_graph.py) add no variant: their token-wise segments compile in each size's warm-up
before capture, and the attention between them launches on the views the eager model passes (q, k,
v of a fused QKV row, the step's real rows and metadata), so it picks the prefill variants below.
The launches below use tiny tensors with the model's layout (q as a view into a fused QKV row, as
the model passes it), so they take milliseconds once compiled.
"""

from __future__ import annotations

import itertools

import torch

from engine.kernels import kv_quant
from engine.kernels.paged_attention import SPLIT_CHOICES, paged_attention
from engine.kernels.sampling import sample


def warm_up(
    num_heads: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    vocab_size: int,
    device: torch.device,
    kv_cache_dtype: torch.dtype | None = None,  # None: dtype; an 8-bit cache compiles its own variants
) -> list[str]:
    """Launches every variant once; returns what it launched (one line each)."""
    launched: list[str] = []
    prefill_len = 128  # long enough for BLOCK_M 128 whatever the GQA group
    num_blocks = -(-prefill_len // block_size)
    cache_dtype = kv_cache_dtype or dtype
    row = kv_quant.row_elements(cache_dtype, head_size)
    kv_cache = torch.zeros((2, num_blocks, block_size, num_kv_heads, row), dtype=cache_dtype, device=device)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.zeros((prefill_len, q_size + 2 * kv_size), dtype=dtype, device=device)
    query = qkv[:, :q_size].view(prefill_len, num_heads, head_size)
    block_tables = torch.arange(num_blocks, dtype=torch.int32, device=device)[None, :]

    def attend(num_tokens: int, seq_len: int, **kwargs: object) -> None:
        paged_attention(
            query[:num_tokens],
            kv_cache,
            torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
            torch.tensor([seq_len], dtype=torch.int32, device=device),
            block_tables,
            head_size**-0.5,
            max_query_len=num_tokens,
            **kwargs,  # type: ignore[arg-type]
        )

    for splits in SPLIT_CHOICES:
        # max_seq_len is only a bound: it lets the forced count stand while the context stays 1.
        attend(1, 1, max_seq_len=1 << 20, num_splits=splits)
        launched.append(f"attention decode NUM_SPLITS={splits}")
    for num_tokens in (2, prefill_len):
        attend(num_tokens, num_tokens, max_seq_len=num_tokens)
        launched.append(f"attention prefill max_query_len={num_tokens}")

    logits = torch.zeros((1, vocab_size), dtype=torch.float32, device=device)
    ones = torch.ones(1, dtype=torch.float32, device=device)
    keys = torch.zeros((1, 2), dtype=torch.int64, device=device)
    top_k = torch.ones(1, dtype=torch.int32, device=device)
    for use_top_k, use_top_p, use_min_p in itertools.product((False, True), repeat=3):
        sample(
            logits,
            ones,
            top_k,
            ones * 0.5,
            ones * 0.1,
            keys,
            use_top_k=use_top_k,
            use_top_p=use_top_p,
            use_min_p=use_min_p,
        )
        launched.append(f"sampling top_k={use_top_k} top_p={use_top_p} min_p={use_min_p}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return launched
