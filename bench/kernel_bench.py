"""Paged decode attention: achieved bandwidth as a fraction of the device's copy bandwidth.

Decode attention reads every cached K/V byte of the batch once and does little arithmetic, so the
figure of merit is bytes moved per second against what the memory system can do at all: a large
device-to-device copy, timed the same way.

    python -m bench.kernel_bench [--out bench-results]

Needs only torch, triton and a CUDA device; ``--smoke`` runs one tiny case anywhere (the Triton
interpreter on CPU) to check the harness itself.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int  # tokens already cached per request (all requests equally long)
    num_heads: int = 64  # GQA 8 at head 128: the Llama-3-70B / Qwen2-72B attention shape
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class DecodeResult:
    case: DecodeCase
    num_splits: int | None  # None: the launcher's heuristic
    time_us: float
    bytes_moved: int
    gbps: float
    fraction_of_copy: float


def time_fn(
    fn: Callable[[], object], device: torch.device, warmup: int = 3, iters: int = 20, inner: int = 5
) -> float:
    """Median seconds per call over `iters` samples of `inner` back-to-back calls.

    Back-to-back calls keep the GPU queue full, so host-side launch overhead hides behind the
    previous call instead of counting as idle device time. Wall clock off the GPU.
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(inner):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / inner)
        else:
            t0 = time.perf_counter()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter() - t0) / inner)
    return statistics.median(samples)


def as_cuda_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """The engine replays decode steps from CUDA graphs; time the kernels the same way."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def copy_bandwidth(device: torch.device, nbytes: int = 2 << 30) -> float:
    """Bytes per second of a large device-to-device copy, counting the read and the write."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = time_fn(lambda: dst.copy_(src), device, warmup=2, iters=10, inner=1)
    return 2 * nbytes / seconds


def run_decode_case(
    case: DecodeCase,
    device: torch.device,
    copy_bps: float,
    num_splits: int | None = None,
    warmup: int = 3,
    iters: int = 20,
) -> DecodeResult:
    from engine.kernels.paged_attention import paged_attention

    dtype = getattr(torch, case.dtype)
    blocks_per_seq = -(-case.context // case.block_size)
    num_blocks = case.batch * blocks_per_seq
    gen = torch.Generator(device="cpu").manual_seed(0)
    # Shuffled blocks, as a long-running cache fragments them; contiguity would flatter the kernel.
    block_tables = torch.randperm(num_blocks, generator=gen).view(case.batch, blocks_per_seq)
    block_tables = block_tables.to(torch.int32).to(device)
    kv_cache = torch.randn(
        (2, num_blocks, case.block_size, case.num_kv_heads, case.head_size), dtype=dtype, device=device
    )
    query = torch.randn((case.batch, case.num_heads, case.head_size), dtype=dtype, device=device)
    query_start_loc = torch.arange(case.batch + 1, dtype=torch.int32, device=device)
    seq_lens = torch.full((case.batch,), case.context, dtype=torch.int32, device=device)

    def step() -> torch.Tensor:
        return paged_attention(
            query,
            kv_cache,
            query_start_loc,
            seq_lens,
            block_tables,
            case.head_size**-0.5,
            max_query_len=1,
            max_seq_len=case.context,
            num_splits=num_splits,
        )

    timed: Callable[[], object] = as_cuda_graph(step) if device.type == "cuda" else step
    seconds = time_fn(timed, device, warmup=warmup, iters=iters, inner=5 if device.type == "cuda" else 1)
    elem = kv_cache.element_size()
    kv_bytes = 2 * case.batch * case.context * case.num_kv_heads * case.head_size * elem
    bytes_moved = kv_bytes + 2 * query.numel() * elem  # K and V once, query in, output out
    bps = bytes_moved / seconds
    return DecodeResult(case, num_splits, seconds * 1e6, bytes_moved, bps / 1e9, bps / copy_bps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-results", help="directory for kernel_bench.json")
    parser.add_argument("--batches", type=int, nargs="+", default=[32, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--num-heads", type=int, default=64)
    parser.add_argument("--num-kv-heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--smoke", action="store_true", help="one tiny case, also on CPU (interpreter)")
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
        args.batches, args.contexts = [2], [64]
        args.num_heads, args.num_kv_heads, args.head_size = 8, 1, 64
    elif not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device (use --smoke to check the harness on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy_bps = copy_bandwidth(device, nbytes=(1 << 20) if args.smoke else (2 << 30))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}   copy bandwidth (read + write): {copy_bps / 1e9:.0f} GB/s")
    print(f"paged decode attention, {args.num_heads}/{args.num_kv_heads} heads, head {args.head_size}, bf16")
    print(f"{'batch':>5} {'context':>7} {'splits':>7} {'time us':>9} {'GB/s':>7} {'of copy':>8}")

    results = []
    for batch in args.batches:
        for context in args.contexts:
            case = DecodeCase(
                batch, context, args.num_heads, args.num_kv_heads, args.head_size, args.block_size
            )
            warmup, iters = (1, 1) if args.smoke else (3, 20)
            # The launcher's own choice, then the plain grid: the gap is what split-K buys.
            for num_splits in (None, 1):
                res = run_decode_case(case, device, copy_bps, num_splits, warmup=warmup, iters=iters)
                results.append(res)
                splits = "auto" if num_splits is None else str(num_splits)
                print(
                    f"{batch:>5} {context:>7} {splits:>7} {res.time_us:>9.1f} {res.gbps:>7.0f} "
                    f"{res.fraction_of_copy:>8.1%}"
                )
            if device.type == "cuda":
                torch.cuda.empty_cache()  # the next case's cache may be larger than what is pooled

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {
        "device": name,
        "copy_bandwidth_gbps": copy_bps / 1e9,
        "results": [asdict(r) for r in results],
    }
    path = out_dir / "kernel_bench.json"
    path.write_text(json.dumps(report, indent=2))
    print(f"wrote {path}")
    plot = _plot(results, out_dir / "kernel_bench.png")
    if plot is not None:
        print(f"wrote {plot}")
    return 0


def _plot(results: list[DecodeResult], path: Path) -> Path | None:
    """Fraction of copy bandwidth against context, one line per batch and split mode (if matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # the GPU check needs only torch, triton and numpy
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    series: dict[str, list[DecodeResult]] = {}
    for r in results:
        mode = "auto split" if r.num_splits is None else f"{r.num_splits} split"
        series.setdefault(f"batch {r.case.batch}, {mode}", []).append(r)
    for label, rs in series.items():
        ax.plot([r.case.context for r in rs], [r.fraction_of_copy for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title("paged decode attention")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
