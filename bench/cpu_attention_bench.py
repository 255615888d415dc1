"""CPU decode attention (the C++ kernel, engine/kernels/cpu): time of one layer's call.

    python -m bench.cpu_attention_bench [--baseline REV] [--seqs 64] [--context 300] [--threads 1]

A decode step of --seqs requests with --context cached tokens each, at SmolLM2-135M's attention
shape (9 query / 3 kv heads, head 64, block 16), in float32 and bf16 (``--dtypes`` adds the 8-bit
caches, int8 and fp8_e4m3, read by their own kernel with a float32 query). There is one cache per layer
(--layers, 30 as in the model), blocks shuffled as a long-running pool fragments them, and each timed
sweep calls every layer once: the K/V then comes from memory, as in a real step, not from a
last-level cache holding the one layer a loop would repeat. Printed: one layer's call (median over
sweeps) and the K/V bytes it reads per second. With one thread the kernel runs on the calling thread
and is timed by that thread's CPU time, which a busy host's other processes do not inflate by
preempting it (they still share the memory bus); with more threads, by the wall clock.

``--baseline REV`` also builds the kernel of git revision REV (engine/kernels/cpu/paged_attention.cpp
and vec.h, under another op namespace; its cache laid out as --baseline-layout: head-major by default,
the layout the kernel read from 565be93 until its K pages were key-interleaved; head-major-kt for
revisions since; token-major for older ones) and times it
interleaved with the current one, sweep for sweep, in one process. ``--small-pages`` does the same
for the current kernel on a cache of 4 KiB pages: the caches are otherwise on transparent huge pages,
as the engine allocates its own (engine.platform.memory.huge_page_zeros). The last column is each row's
speed over the first row's. On a busy host read the ratio, not either absolute figure.
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.run_support import run_cpu_kernel_bench
from engine.attention.backend import KVLayout
from engine.attention.cpu_backend import CpuAttentionBackend
from engine.kernels import cpu as cpu_kernels
from engine.kernels import kv_quant
from engine.paths import cpu_ext_root
from engine.platform import memory

REPO = Path(__file__).resolve().parents[1]
BASELINE_OPS = "inflight_cpu_baseline"
_KERNEL_FILES = ("engine/kernels/cpu/paged_attention.cpp", "engine/kernels/cpu/vec.h")


@dataclass(frozen=True)
class Shape:
    seqs: int
    context: int  # cached tokens per request, this step's included
    num_heads: int = 9
    num_kv_heads: int = 3
    head_size: int = 64
    block_size: int = 16


@dataclass
class Variant:
    name: str
    layout: KVLayout
    op: Callable[..., None]
    caches: list[torch.Tensor]
    seconds: list[float]  # per layer's call, one entry per sweep


def build_baseline(rev: str) -> Callable[..., None]:
    """The paged_attention op as it was at ``rev``, registered as torch.ops.inflight_cpu_baseline."""
    sources = {}
    for path in _KERNEL_FILES:
        text = subprocess.run(
            ["git", "-C", str(REPO), "show", f"{rev}:{path}"], check=True, capture_output=True, text=True
        ).stdout
        # Only the op library's name changes: both builds then load side by side in one process.
        for macro in ("TORCH_LIBRARY", "TORCH_LIBRARY_IMPL"):
            text = text.replace(f"{macro}(inflight_cpu,", f"{macro}({BASELINE_OPS},")
        sources[Path(path).name] = text
    key = hashlib.sha256("".join(sources.values()).encode() + torch.__version__.encode()).hexdigest()[:16]
    directory = cpu_ext_root() / f"baseline-{key}"
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in sources.items():
        if not (directory / name).exists() or (directory / name).read_text() != text:
            (directory / name).write_text(text)
    cpu_kernels.build(BASELINE_OPS, [directory / "paged_attention.cpp"], directory)
    return torch.ops.inflight_cpu_baseline.paged_attention  # type: ignore[no-any-return]


def make_caches(
    shape: Shape,
    dtype: torch.dtype,
    layers: int,
    layouts: list[KVLayout],
    seed: int = 0,
    small_pages: list[bool] | None = None,
) -> tuple[list[list[torch.Tensor]], torch.Tensor]:
    """Per layout, one cache per layer (the same values in each layout), and the shuffled block table.
    Caches are on huge pages as the engine allocates them, except where ``small_pages`` says."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = -(-shape.context // shape.block_size)
    num_blocks = shape.seqs * per_seq + 1
    tables = torch.randperm(num_blocks, generator=gen)[: shape.seqs * per_seq].view(shape.seqs, per_seq)
    dims = (num_blocks, shape.block_size, shape.num_kv_heads, shape.head_size)
    caches: list[list[torch.Tensor]] = [[] for _ in layouts]
    for _ in range(layers):
        token_major = torch.randn((2, *dims), generator=gen)
        # An 8-bit cache's rows are D codes and a scale (engine/kernels/kv_quant.py).
        token_major = kv_quant.quantize(token_major, dtype) if kv_quant.is_quantized(dtype) else token_major
        token_major = token_major.to(dtype)
        cache_dims = (*dims[:3], token_major.shape[-1])
        for i, layout in enumerate(layouts):
            if small_pages is not None and small_pages[i]:
                cache = torch.empty(layout.shape(*cache_dims), dtype=dtype)
            else:
                cache = memory.huge_page_zeros(layout.shape(*cache_dims), dtype)
            layout.fill_from_token_major(cache, token_major)
            caches[i].append(cache)
    return caches, tables.to(torch.int32)


def run(
    shape: Shape,
    dtype: torch.dtype,
    layers: int,
    sweeps: int,
    baseline: tuple[Callable[..., None], KVLayout] | None,
    small_pages: bool = False,
) -> list[Variant]:
    current_layout = CpuAttentionBackend().kv_layout(dtype, shape.head_size, torch.device("cpu"))
    current: Callable[..., None] = torch.ops.inflight_cpu.paged_attention
    quantized = kv_quant.is_quantized(dtype)
    if quantized:  # the 8-bit cache's kernel: no max_query_len argument (every request is a decode here)
        assert cpu_kernels.load_kv_quant(), "the 8-bit cache's kernels could not be built"
        baseline, small_pages = None, False

        def current(*args: object) -> None:  # (out, query, cache, starts, lens, tables, scale, max_query_len)
            torch.ops.inflight_cpu.paged_attention_quant(*args[:7])

    specs: list[tuple[str, KVLayout, Callable[..., None]]] = [("current", current_layout, current)]
    if small_pages:
        specs.insert(0, ("4k-pages", current_layout, current))
    if baseline is not None:
        specs.insert(0, ("baseline", baseline[1], baseline[0]))
    caches, tables = make_caches(
        shape,
        dtype,
        layers,
        [layout for _, layout, _ in specs],
        small_pages=[n == "4k-pages" for n, _, _ in specs],
    )
    variants = [Variant(n, layout, op, c, []) for (n, layout, op), c in zip(specs, caches, strict=True)]
    gen = torch.Generator().manual_seed(1)
    query = torch.randn((shape.seqs, shape.num_heads, shape.head_size), generator=gen)
    query = query if quantized else query.to(dtype)
    starts = torch.arange(shape.seqs + 1, dtype=torch.int32)
    seq_lens = torch.full((shape.seqs,), shape.context, dtype=torch.int32)
    scale = shape.head_size**-0.5
    outs = {v.name: torch.empty_like(query) for v in variants}

    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def sweep(v: Variant) -> float:
        out = outs[v.name]
        t0 = clock()
        for cache in v.caches:
            v.op(out, query, cache, starts, seq_lens, tables, scale, 1)
        return (clock() - t0) / len(v.caches)

    for v in variants:
        sweep(v)  # warm-up: first touches, thread pool
    if len(variants) > 1:
        first = outs[variants[0].name].float()
        torch.testing.assert_close(outs[variants[1].name].float(), first, atol=2e-2, rtol=1e-2)
    for i in range(sweeps):
        # Alternate who goes first, so neither always runs right after the other warmed a cache.
        for v in variants if i % 2 == 0 else variants[::-1]:
            v.seconds.append(sweep(v))
    return variants


def kv_bytes(shape: Shape, dtype: torch.dtype) -> int:
    per_head = kv_quant.bytes_per_token_head(dtype, shape.head_size)
    return 2 * shape.seqs * shape.context * shape.num_kv_heads * per_head


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (a power of two)")
    parser.add_argument("--layers", type=int, default=30, help="caches swept per timing (one per layer)")
    parser.add_argument("--sweeps", type=int, default=25, help="timed sweeps per variant and dtype")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (the kernel's workers)")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32", "bfloat16"],
        choices=["float32", "bfloat16", *kv_quant.KV_CACHE_DTYPES],
    )
    parser.add_argument("--baseline", metavar="REV", help="also time the kernel of this git revision")
    parser.add_argument(
        "--small-pages",
        action="store_true",
        help="also time the current kernel on a cache of 4 KiB pages (the engine's is on huge pages)",
    )
    parser.add_argument(
        "--baseline-layout",
        choices=[layout.value for layout in KVLayout],
        default=KVLayout.HEAD_MAJOR.value,
        help="the cache layout the baseline kernel reads",
    )
    args = parser.parse_args(argv)
    return run_cpu_kernel_bench("cpu_attention_bench", args.threads, lambda: report(args))


def report(args: argparse.Namespace) -> None:
    baseline = (build_baseline(args.baseline), KVLayout(args.baseline_layout)) if args.baseline else None
    shape = Shape(args.seqs, args.context, block_size=args.block_size)
    print(
        f"decode attention, {shape.seqs} requests x {shape.context} tokens, heads {shape.num_heads}/"
        f"{shape.num_kv_heads}, head {shape.head_size}, block {shape.block_size}, {args.threads} thread(s), "
        f"{args.layers} layer caches per sweep, median of {args.sweeps} sweeps"
    )
    print(f"{'dtype':<9} {'kernel':<9} {'layout':<12} {'us/layer':>9} {'GB/s':>6} {'vs first':>11}")
    for name in args.dtypes:
        dtype = kv_quant.KV_CACHE_DTYPES.get(name) or getattr(torch, name)
        variants = run(shape, dtype, args.layers, args.sweeps, baseline, args.small_pages)
        for v in variants:
            median = statistics.median(v.seconds)
            # The ratio of medians of paired sweeps: each pair ran back to back, under the same load.
            ratio = statistics.median(b / s for b, s in zip(variants[0].seconds, v.seconds, strict=True))
            print(
                f"{name:<9} {v.name:<9} {v.layout.value:<12} {median * 1e6:>9.1f} "
                f"{kv_bytes(shape, dtype) / median / 1e9:>6.1f} {ratio:>10.2f}x"
            )


if __name__ == "__main__":
    sys.exit(main())
