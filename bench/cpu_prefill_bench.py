"""CPU prefill attention: the C++ kernel against torch's flash SDPA on one whole prompt.

    python -m bench.cpu_prefill_bench [--tokens 64,256,1024,4096] [--threads 1]

At SmolLM2-135M's attention shape (9 query / 3 kv heads, head 64), in float32 and bf16: the best of
--repeats calls of each path, interleaved (engine/attention/cpu_prefill.py time_paths; one thread:
timed by the thread's CPU time). Printed per prompt length: each path's time and causal attention
GFLOP/s, SDPA's time over the kernel's, the path the engine's start-up probe (a prompt of
PROBE_TOKENS tokens) would pick from this row's times, and SDPA's time on the prompt's own K/V (what
the engine does with a prompt that fits one step: no gather of its context from the cache), timed
against the gathering call.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from bench.run_support import cpu_kernel_parser, run_cpu_kernel_bench
from engine.attention import cpu_prefill


def causal_flops(tokens: int, shape: cpu_prefill.PrefillShape) -> float:
    """Multiply-adds of QK^T and PV under the causal mask, counted as 2 FLOPs each."""
    return 2.0 * 2.0 * shape.num_heads * shape.head_size * tokens * (tokens + 1) / 2


def main(argv: list[str] | None = None) -> int:
    parser = cpu_kernel_parser(__doc__, 5, "timed calls per path")
    parser.add_argument("--tokens", default="64,256,1024,4096", help="comma list of prompt lengths")
    args = parser.parse_args(argv)
    return run_cpu_kernel_bench("cpu_prefill_bench", args.threads, lambda: report(args))


def report(args: argparse.Namespace) -> None:
    print(f"prefill attention, one whole prompt, heads 9/3, head 64, {args.threads} thread(s)")
    print(
        f"{'dtype':<9} {'tokens':>6} {'kernel ms':>10} {'GFLOP/s':>8} {'SDPA ms':>9} {'GFLOP/s':>8} "
        f"{'SDPA/kernel':>11} {'pick':>6} {'SDPA own ms':>11}"
    )
    for name in args.dtypes:
        shape = cpu_prefill.PrefillShape(9, 3, 64, getattr(torch, name))
        for tokens in (int(t) for t in args.tokens.split(",")):
            kernel, sdpa = cpu_prefill.probe(shape, tokens)
            kernel_s, sdpa_s = cpu_prefill.time_paths(kernel, sdpa, args.threads, args.repeats)
            _, own_s = cpu_prefill.time_paths(sdpa, own_kv_sdpa(shape, tokens), args.threads, args.repeats)
            flops = causal_flops(tokens, shape)
            print(
                f"{name:<9} {tokens:>6} {kernel_s * 1e3:>10.3f} {flops / kernel_s / 1e9:>8.1f} "
                f"{sdpa_s * 1e3:>9.3f} {flops / sdpa_s / 1e9:>8.1f} {sdpa_s / kernel_s:>11.2f} "
                f"{cpu_prefill.pick(kernel_s, sdpa_s):>6} {own_s * 1e3:>11.3f}"
            )


def own_kv_sdpa(shape: cpu_prefill.PrefillShape, tokens: int) -> Callable[[], None]:
    """SDPA on one whole prompt given its own K/V, as [T, heads, D] rows from the model's projections."""
    gen = torch.Generator().manual_seed(1)
    query, key, value = (
        torch.randn((tokens, heads, shape.head_size), generator=gen).to(shape.dtype)
        for heads in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads)
    )
    blocks = -(-tokens // cpu_prefill.PROBE_BLOCK_SIZE)  # the cache's shape only: it is not read
    cache = torch.empty(
        (2, blocks, shape.num_kv_heads, cpu_prefill.PROBE_BLOCK_SIZE, shape.head_size), dtype=shape.dtype
    )
    table = torch.arange(blocks, dtype=torch.int32)
    scale = shape.head_size**-0.5

    def call() -> None:
        cpu_prefill.sdpa_prefill(query, cache, table, tokens, scale, own_kv=(key, value))

    return call


if __name__ == "__main__":
    raise SystemExit(main())
