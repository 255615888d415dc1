"""CPU linear layers on GGUF block formats (engine/kernels/cpu/quant_gemm.cpp) against the float linear of
the same weights dequantized (torch's F.linear: oneDNN / MKL).

    python -m bench.quant_gemm_bench [--formats Q8_0 Q4_0 ...] [--rows 1,2,4,8,16,64] [--threads 1]

One pass is every linear layer of a model's shape (qkv, o, gate_up, down, --layers times; SmolLM2-135M's
by default) in one format, random valid blocks; the best of --repeats passes counts. Printed per format,
dtype and row count: each path's time and the rate it reads its weights at (bytes of every weight over
the pass's time: what bounds a decode step), and the float path's time over the quantized one's. The
quantized path is shown twice: the float32 kernels (``quant``: the dequantized weight times the rows as
they are) and the integer path (``int8``: the rows quantized to int8 blocks of 32, integer dot
products; ``quant_linear`` takes it up to ``INT8_ACTIVATION_MAX_ROWS`` rows), ``int8/quant`` their
ratio of speeds. ``deq+float``: what a linear layer runs past its row bound (engine/layers/linear.py),
the weight dequantized for the step and then the float linear; ``deq+float/quant`` above 1 means the
block kernels are the faster path at that row count.
K-quants need in features in whole blocks of 256: SmolLM2's 576 is rounded up to 768 for them (llama.cpp
stores those tensors in another format); the byte counts are of the weights actually multiplied.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.run_support import add_layer_shape, cpu_kernel_parser, run_cpu_kernel_bench
from engine.quant import FORMATS, QuantizedWeight, random_quantized
from engine.quant.linear import cpu_isa, dequantize_for_step


def float_kernels(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    out: torch.Tensor = torch.ops.inflight_cpu.quant_linear(x, w.blocks, w.fmt.ggml_type, w.in_features, None)
    return out


def int8_kernels(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    out: torch.Tensor = torch.ops.inflight_cpu.quant_linear_int8(
        x, w.blocks, w.fmt.ggml_type, w.in_features, None
    )
    return out


def dequantized_step(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """What a linear layer runs past its row bound (engine/layers/linear.py): the weight dequantized for
    the step, then the float linear."""
    return F.linear(x, dequantize_for_step(w, x.dtype))


def shapes(args: argparse.Namespace, block: int) -> list[tuple[int, int]]:
    """(out, in) of one layer's linears, in features rounded up to whole blocks."""
    h, inter, d = args.hidden, args.intermediate, args.head_dim

    def whole(k: int) -> int:
        return -(-k // block) * block

    return [
        (d * (args.heads + 2 * args.kv_heads), whole(h)),
        (d * args.heads, whole(h)),
        (2 * inter, whole(h)),
        (h, whole(inter)),
    ]


def best_of(
    repeats: int, calls: list[tuple[Callable[[torch.Tensor, Any], torch.Tensor], torch.Tensor, Any]]
) -> float:
    """The fastest of ``repeats`` passes over ``calls`` (fn, x, weight), in seconds."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for fn, x, w in calls:
            fn(x, w)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = cpu_kernel_parser(__doc__, 3, "passes per path")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    parser.add_argument("--rows", default="1,2,4,8,16,64", help="comma list of row counts")
    add_layer_shape(parser)
    args = parser.parse_args(argv)
    return run_cpu_kernel_bench("quant_gemm_bench", args.threads, lambda: report(args))


@torch.inference_mode()
def report(args: argparse.Namespace) -> None:
    rows_list = [int(r) for r in args.rows.split(",")]
    print(
        f"linear layers of {args.layers} x {shapes(args, 1)}, {args.threads} thread(s), kernels {cpu_isa()}"
    )
    print(
        f"{'format':<6} {'dtype':<9} {'rows':>5} {'quant ms':>9} {'GB/s':>6} {'int8 ms':>8} {'GB/s':>6} "
        f"{'float ms':>9} {'GB/s':>6} {'deq+float ms':>12} {'float/quant':>11} {'int8/quant':>10} "
        f"{'deq+float/quant':>15}"
    )
    for name in args.formats:
        gen = torch.Generator().manual_seed(0)
        layer_shapes = shapes(args, FORMATS[name].block_size) * args.layers
        weights: list[QuantizedWeight] = [random_quantized(name, o, i, gen) for o, i in layer_shapes]
        quant_bytes = sum(w.nbytes for w in weights)
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            floats = [w.dequantize().to(dtype) for w in weights]
            float_bytes = sum(f.numel() * f.element_size() for f in floats)
            inputs = {k: torch.randn(max(rows_list), k, generator=gen).to(dtype) for _, k in layer_shapes}
            for rows in rows_list:
                quant = best_of(
                    args.repeats, [(float_kernels, inputs[w.in_features][:rows], w) for w in weights]
                )
                int8 = best_of(
                    args.repeats, [(int8_kernels, inputs[w.in_features][:rows], w) for w in weights]
                )
                dense = best_of(args.repeats, [(F.linear, inputs[f.shape[1]][:rows], f) for f in floats])
                step = best_of(
                    args.repeats, [(dequantized_step, inputs[w.in_features][:rows], w) for w in weights]
                )
                quant_rate, dense_rate = quant_bytes / quant / 1e9, float_bytes / dense / 1e9
                print(
                    f"{name:<6} {dtype_name:<9} {rows:>5} {quant * 1e3:>9.2f} {quant_rate:>6.1f} "
                    f"{int8 * 1e3:>8.2f} {quant_bytes / int8 / 1e9:>6.1f} "
                    f"{dense * 1e3:>9.2f} {dense_rate:>6.1f} {step * 1e3:>12.2f} {dense / quant:>11.2f} "
                    f"{quant / int8:>10.2f} {step / quant:>15.2f}",
                    flush=True,
                )


if __name__ == "__main__":
    raise SystemExit(main())
