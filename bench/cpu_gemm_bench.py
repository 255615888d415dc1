"""CPU linear layers: the engine's own packed kernels against oneDNN's packed weights and torch's matmul.

    python -m bench.cpu_gemm_bench [--rows 1,4,8,16,32,64,256,1024] [--threads 1]

One pass is every linear layer of a model's shape (qkv, o, gate_up, down, --layers times; SmolLM2-135M's
by default) and its LM head at the rows that sample (at most --head-rows), each path on its own packed
copy of the same random weights, the paths interleaved; the best of --repeats passes counts. Printed per
dtype and row count: each path's time, the weights' read rate of the engine's kernels (bytes of every
weight over the pass's time: what bounds a decode step) and oneDNN's time over theirs. torch's matmul is
timed only with --torch (MKL's float32 sgemm is slow on AMD CPUs, and bf16 without AMX slower still).
On an AMX CPU, bf16 rows that are a multiple of 16 also run the AMX tile kernel over oneDNN's packed
weights (engine/models/amx_gemm.py; column "tiles ms", and oneDNN's time over it).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.run_support import add_layer_shape, cpu_kernel_parser, run_cpu_kernel_bench
from engine.models import amx_gemm, cpu_gemm, onednn

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shapes(args: argparse.Namespace) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears."""
    h, inter, d = args.hidden, args.intermediate, args.head_dim
    return [(d * (args.heads + 2 * args.kv_heads), h), (d * args.heads, h), (2 * inter, h), (h, inter)]


def _tiles(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    panels = amx_gemm.panels_of(packed)
    assert panels is not None
    return amx_gemm.linear(x, panels)


def best_pass(calls: list[tuple[Linear, torch.Tensor, torch.Tensor]]) -> float:
    start = time.perf_counter()
    for fn, x, w in calls:
        fn(x, w)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = cpu_kernel_parser(__doc__, 3, "passes per path")
    parser.add_argument("--rows", default="1,4,8,16,32,64,256,1024", help="comma list of row counts")
    add_layer_shape(parser)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--head-rows", type=int, default=64, help="most rows the LM head multiplies")
    parser.add_argument("--torch", action="store_true", help="also time torch's own matmul")
    args = parser.parse_args(argv)
    return run_cpu_kernel_bench("cpu_gemm_bench", args.threads, lambda: report(args))


@torch.inference_mode()
def report(args: argparse.Namespace) -> None:
    print(f"linear layers of {args.layers} x {shapes(args)} + LM head {args.vocab}, {args.threads} thread(s)")
    print(
        f"{'dtype':<9} {'rows':>5} {'inflight ms':>11} {'GB/s':>6} {'oneDNN ms':>10} {'oneDNN/own':>10} "
        f"{'torch ms':>9} {'tiles ms':>9} {'oneDNN/tiles':>12}"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        if not cpu_gemm.supported(dtype):
            print(f"{name:<9} the engine's own kernels do not run on this CPU")
            continue
        gen = torch.Generator().manual_seed(0)
        layer_shapes = shapes(args) * args.layers
        weights = [(torch.randn(o, i, generator=gen) * 0.05).to(dtype) for o, i in layer_shapes]
        head = (torch.randn(args.vocab, args.hidden, generator=gen) * 0.05).to(dtype)
        nbytes = sum(w.numel() * w.element_size() for w in [*weights, head])
        paths: dict[str, tuple[Linear, list[torch.Tensor]]] = {
            "inflight": (cpu_gemm.linear, [cpu_gemm.pack(w) for w in [*weights, head]])
        }
        if onednn.can_prepack(dtype):
            packed_dnn = [onednn.pack(w, args.head_rows) for w in [*weights, head]]
            paths["onednn"] = (onednn.linear, packed_dnn)
            if dtype == torch.bfloat16 and amx_gemm.supported():
                shared = all(amx_gemm.attach(p, w) for p, w in zip(packed_dnn, [*weights, head], strict=True))
                if shared:
                    paths["tiles"] = (_tiles, packed_dnn)
        if args.torch:
            paths["torch"] = (F.linear, [*weights, head])
        inputs = {
            i: torch.randn(max(int(r) for r in args.rows.split(",")), i, generator=gen).to(dtype)
            for i in {args.hidden, args.intermediate}
        }
        for rows in (int(r) for r in args.rows.split(",")):
            calls = {
                path: [
                    (fn, inputs[i][: rows if w is not packed[-1] else min(rows, args.head_rows)], w)
                    for (_, i), w in zip([*layer_shapes, (args.vocab, args.hidden)], packed, strict=True)
                ]
                for path, (fn, packed) in paths.items()
            }
            if rows % amx_gemm.TILE_ROWS:
                calls.pop("tiles", None)
            best = {path: float("inf") for path in calls}
            for _ in range(args.repeats):
                for path, c in calls.items():
                    best[path] = min(best[path], best_pass(c))
            own = best["inflight"]
            dnn = f"{'-':>10} {'-':>10}"
            if "onednn" in best:
                dnn = f"{best['onednn'] * 1e3:>10.2f} {best['onednn'] / own:>10.2f}"
            tch = f"{best['torch'] * 1e3:>9.2f}" if "torch" in best else f"{'-':>9}"
            tiles = f"{'-':>9} {'-':>12}"
            if "tiles" in best and "onednn" in best:
                tiles = f"{best['tiles'] * 1e3:>9.2f} {best['onednn'] / best['tiles']:>12.2f}"
            rate = nbytes / own / 1e9
            print(f"{name:<9} {rows:>5} {own * 1e3:>11.2f} {rate:>6.1f} {dnn} {tch} {tiles}", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
