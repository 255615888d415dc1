"""CPU prefill attention: the C++ kernel against torch's flash SDPA on one whole prompt.

    python -m bench.cpu_prefill_bench [--tokens 64,256,1024,4096] [--threads 1]

At SmolLM2-135M's attention shape (9 query / 3 kv heads, head 64), in float32 and bf16: the best of
--repeats calls of each path, interleaved (engine/attention/cpu_prefill.py time_paths; one thread:
timed by the thread's CPU time). Printed per prompt length: each path's time and causal attention
GFLOP/s, SDPA's time over the kernel's, and the path the engine's start-up probe (a prompt of
PROBE_TOKENS tokens) would pick from this row's times.
"""

from __future__ import annotations

import argparse

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
        f"{'SDPA/kernel':>11} {'pick':>6}"
    )
    for name in args.dtypes:
        shape = cpu_prefill.PrefillShape(9, 3, 64, getattr(torch, name))
        for tokens in (int(t) for t in args.tokens.split(",")):
            kernel_s, sdpa_s = cpu_prefill.time_paths(
                *cpu_prefill.probe(shape, tokens), args.threads, args.repeats
            )
            flops = causal_flops(tokens, shape)
            print(
                f"{name:<9} {tokens:>6} {kernel_s * 1e3:>10.3f} {flops / kernel_s / 1e9:>8.1f} "
                f"{sdpa_s * 1e3:>9.3f} {flops / sdpa_s / 1e9:>8.1f} {sdpa_s / kernel_s:>11.2f} "
                f"{cpu_prefill.pick(kernel_s, sdpa_s):>6}"
            )


if __name__ == "__main__":
    raise SystemExit(main())
