"""Mixture of experts on the CPU: the grouped path against a dense loop over every expert.

    python -m bench.moe_bench [--experts 8,32,64] [--tokens 1,16,64] [--top-k 2] [--threads 1]

For each expert count E and token count T, one MoE layer (hidden --hidden, expert intermediate
--intermediate, random weights and random softmax top-k routing) runs two ways on the same inputs:
``grouped``, the engine's CPU path (one GEMM pair per expert some token chose, over its rows only), and
``dense``, every expert over every token with the unchosen ones weighted zero (E GEMM pairs over T rows).
Each time is the best of --repeats runs of --iters calls. Printed per dtype, E and T: both times in ms,
dense over grouped, and how many experts the grouped path touched (at most min(E, T * k)): the grouped
time follows that count, the dense time follows E * T. --json writes the rows.
"""

from __future__ import annotations

import argparse
import functools
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from bench.run_support import cpu_kernel_parser
from engine.kernels import moe_cpu
from engine.kernels.moe import route_topk
from engine.kernels.moe_reference import expert_mlp


def dense_moe(
    hidden: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    topk_weights: torch.Tensor,  # [T, k] float32
    topk_ids: torch.Tensor,  # [T, k]
) -> torch.Tensor:  # [T, H]
    """The loop over experts: each expert multiplies every token, and its weight zeroes the unchosen."""
    num_experts = w13.shape[0]
    # [T, E]: token t's weight for expert e, 0 where t did not choose e.
    dense_weights = torch.zeros(hidden.shape[0], num_experts).scatter_(1, topk_ids, topk_weights)
    out = torch.zeros(hidden.shape, dtype=torch.float32)
    for expert in range(num_experts):
        out += (
            expert_mlp(hidden, w13[expert], w2[expert], "silu").float()
            * dense_weights[:, expert : expert + 1]
        )
    return out.to(hidden.dtype)


def best_ms(fn: Callable[[], torch.Tensor], repeats: int, iters: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e3


@torch.inference_mode()
def report(args: argparse.Namespace) -> list[dict[str, object]]:
    experts = [int(e) for e in args.experts.split(",")]
    tokens = [int(t) for t in args.tokens.split(",")]
    h, inter, top_k = args.hidden, args.intermediate, args.top_k
    print(
        f"MoE layer H={h} I={inter} k={top_k}, {args.threads} thread(s), best of {args.repeats}x{args.iters}"
    )
    header = f"{'E':>4} {'T':>4} {'touched':>7} {'grouped ms':>10} {'dense ms':>9} {'dense/grouped':>13}"
    print(f"{'dtype':<9} {header}")
    rows: list[dict[str, object]] = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for num_experts in experts:
            gen = torch.Generator().manual_seed(num_experts)
            w13 = (torch.randn(num_experts, 2 * inter, h, generator=gen) / h**0.5).to(dtype)
            w2 = (torch.randn(num_experts, h, inter, generator=gen) / inter**0.5).to(dtype)
            for num_tokens in tokens:
                hidden = torch.randn(num_tokens, h, generator=gen).to(dtype)
                weights, ids = route_topk(torch.randn(num_tokens, num_experts, generator=gen), top_k, True)
                grouped = moe_cpu.fused_moe(hidden, w13, w2, weights, ids)
                dense = dense_moe(hidden, w13, w2, weights, ids)
                # The two must agree before their times mean anything.
                torch.testing.assert_close(grouped, dense, atol=3e-2, rtol=3e-2)
                inputs = (hidden, w13, w2, weights, ids)
                t_grouped = best_ms(functools.partial(moe_cpu.fused_moe, *inputs), args.repeats, args.iters)
                t_dense = best_ms(functools.partial(dense_moe, *inputs), args.repeats, args.iters)
                touched = int(ids.unique().numel())
                print(
                    f"{name:<9} {num_experts:>4} {num_tokens:>4} {touched:>7} {t_grouped:>10.3f} "
                    f"{t_dense:>9.3f} {t_dense / t_grouped:>13.1f}",
                    flush=True,
                )
                rows.append(
                    {
                        "dtype": name,
                        "num_experts": num_experts,
                        "num_tokens": num_tokens,
                        "top_k": top_k,
                        "hidden": h,
                        "intermediate": inter,
                        "experts_touched": touched,
                        "grouped_ms": t_grouped,
                        "dense_ms": t_dense,
                    }
                )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = cpu_kernel_parser(__doc__, 5, "timed runs per path")
    parser.set_defaults(dtypes=["float32"])
    parser.add_argument("--experts", default="8,32,64", help="comma list of expert counts E")
    parser.add_argument("--tokens", default="1,16,64", help="comma list of token counts T")
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=256, help="one expert's intermediate size")
    parser.add_argument("--iters", type=int, default=5, help="calls per timed run")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here")
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        rows = report(args)
    finally:
        torch.set_num_threads(before)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
