"""Paged decode attention: achieved bandwidth as a fraction of the device's copy bandwidth.

Decode attention reads every cached K/V byte of the batch once and does little arithmetic, so the
figure of merit is bytes moved per second against what the memory system can do at all: a large
device-to-device copy, timed the same way.

    python -m bench.kernel_bench [--out bench-results] [--sweep] [--sweep-budget-s 60]

Figures: the Llama-3-8B attention shape (32 query / 8 KV heads, head 128, bf16) at context 1k and
batches 1, 8, 16, 32, 64, with the launcher's split heuristic and with forced split counts, then the
70B shape (64 / 8 heads) at context 4k. ``--sweep`` then times the decode variant's launch
configurations (BLOCK_N 32/64/128 x 4/8 warps x 2/3/4 stages, then forced splits on the best) per
8B case within a time budget and prints the best per shape. kernel_bench.json is rewritten after
every case, so a stage timeout keeps what was measured.

Needs only torch, triton and a CUDA device; ``--smoke`` runs tiny cases anywhere (the Triton
interpreter on CPU) to check the harness itself.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BATCHES_8B = (1, 8, 16, 32, 64)
FORCED_SPLITS = (1, 2, 4, 8, 16)
SWEEP_BLOCK_N = (32, 64, 128)
SWEEP_WARPS = (4, 8)
SWEEP_STAGES = (2, 3, 4)


@dataclass(frozen=True)
class DecodeCase:
    batch: int
    context: int  # tokens already cached per request (all requests equally long)
    num_heads: int = 32  # GQA 4 at head 128: the Llama-3-8B attention shape
    num_kv_heads: int = 8
    head_size: int = 128
    block_size: int = 16
    dtype: str = "bfloat16"


@dataclass(frozen=True)
class LaunchConfig:
    """The decode variant's launch: None keeps the launcher's default (see DecodeConfig)."""

    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def label(self) -> str:
        if self == LaunchConfig():
            return "default"
        parts = [f"{k}={v}" for k, v in asdict(self).items() if v is not None]
        return " ".join(parts)


@dataclass(frozen=True)
class DecodeResult:
    case: DecodeCase
    num_splits: int | None  # None: the launcher's heuristic
    time_us: float
    bytes_moved: int
    gbps: float
    fraction_of_copy: float
    config: LaunchConfig = field(default_factory=LaunchConfig)


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
    config: LaunchConfig | None = None,
) -> DecodeResult:
    from engine.kernels._common import DecodeConfig
    from engine.kernels.paged_attention import paged_attention

    config = config or LaunchConfig()
    decode_config = DecodeConfig(**asdict(config))
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
        # all_rows_owned: a decode step without padding rows, as the engine launches it (no zero-fill).
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
            all_rows_owned=True,
            decode_config=decode_config,
        )

    timed: Callable[[], object] = as_cuda_graph(step) if device.type == "cuda" else step
    seconds = time_fn(timed, device, warmup=warmup, iters=iters, inner=5 if device.type == "cuda" else 1)
    elem = kv_cache.element_size()
    kv_bytes = 2 * case.batch * case.context * case.num_kv_heads * case.head_size * elem
    bytes_moved = kv_bytes + 2 * query.numel() * elem  # K and V once, query in, output out
    bps = bytes_moved / seconds
    return DecodeResult(case, num_splits, seconds * 1e6, bytes_moved, bps / 1e9, bps / copy_bps, config)


def sweep_configs() -> list[LaunchConfig]:
    """Every decode launch configuration the sweep times, the default's values first."""
    return [
        LaunchConfig(n, w, st) for n, w, st in itertools.product(SWEEP_BLOCK_N, SWEEP_WARPS, SWEEP_STAGES)
    ]


def best_per_case(results: list[DecodeResult]) -> dict[str, DecodeResult]:
    """The fastest result of each case (key: 'batch B context C heads Hq/Hkv')."""
    best: dict[str, DecodeResult] = {}
    for r in results:
        key = case_key(r.case)
        if key not in best or r.time_us < best[key].time_us:
            best[key] = r
    return best


def case_key(case: DecodeCase) -> str:
    return f"batch {case.batch} context {case.context} heads {case.num_heads}/{case.num_kv_heads}"


def _row(res: DecodeResult) -> str:
    splits = "auto" if res.num_splits is None else str(res.num_splits)
    c = res.case
    return (
        f"{c.num_heads:>3}/{c.num_kv_heads:<2} {c.batch:>5} {c.context:>7} {splits:>6} "
        f"{res.config.label():>28} {res.time_us:>9.1f} {res.gbps:>7.0f} {res.fraction_of_copy:>8.1%}"
    )


HEADER = (
    f"{'heads':>6} {'batch':>5} {'context':>7} {'splits':>6} {'config':>28} {'time us':>9} {'GB/s':>7} "
    f"{'of copy':>8}"
)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-results", help="directory for kernel_bench.json")
    parser.add_argument("--context", type=int, default=1024, help="the 8B cases' context")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES_8B))
    parser.add_argument("--sweep", action="store_true", help="time the decode launch configurations")
    parser.add_argument("--sweep-budget-s", type=float, default=60.0, help="stop the sweep after this")
    parser.add_argument("--smoke", action="store_true", help="tiny cases, also on CPU (interpreter)")
    args = parser.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "0" if torch.cuda.is_available() else "1")
    elif not torch.cuda.is_available():
        print("kernel_bench: needs a CUDA device (use --smoke to check the harness on CPU)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    copy_bps = copy_bandwidth(device, nbytes=(1 << 20) if args.smoke else (2 << 30))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu (interpreter)"
    print(f"device: {name}   copy bandwidth (read + write): {copy_bps / 1e9:.0f} GB/s")
    print("paged decode attention, head 128, bf16, no zero-fill (all rows owned); timed from CUDA graphs")
    print(HEADER)

    # (case, forced split counts): the heuristic's choice first, then what the forced ones buy.
    plan: list[tuple[DecodeCase, tuple[int | None, ...]]]
    if args.smoke:
        plan = [(DecodeCase(2, 64, 8, 1, 64), (None, 1))]
        configs = [LaunchConfig(), LaunchConfig(32, 4, 2)]
        forced: tuple[int, ...] = (1, 2)
        warmup, iters = 1, 1
    else:
        plan = [(DecodeCase(b, args.context), (None, *FORCED_SPLITS)) for b in args.batches]
        plan += [(DecodeCase(b, 4096, 64, 8), (None,)) for b in (32, 64)]
        configs = sweep_configs()
        forced = FORCED_SPLITS
        warmup, iters = 3, 20
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "kernel_bench.json"
    report: dict[str, Any] = {
        "device": name,
        "copy_bandwidth_gbps": copy_bps / 1e9,
        "results": [],
        "sweep": [],
        "sweep_complete": None,
        "sweep_best": {},
    }

    def save() -> None:
        path.write_text(json.dumps(report, indent=2))

    results: list[DecodeResult] = []
    for case, split_counts in plan:
        for num_splits in split_counts:
            res = run_decode_case(case, device, copy_bps, num_splits, warmup=warmup, iters=iters)
            results.append(res)
            report["results"].append(asdict(res))
            print(_row(res))
            save()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the next case's cache may be larger than what is pooled

    if args.sweep:
        sweep = run_sweep(
            forced,
            [c for c, _ in plan if c.num_heads == plan[0][0].num_heads],
            configs,
            device,
            copy_bps,
            args.sweep_budget_s,
            warmup,
            iters,
            report,
            save,
        )
        best = best_per_case(sweep)
        report["sweep_best"] = {k: asdict(v) for k, v in best.items()}
        save()
        print("best decode configuration per shape (the launcher's default in brackets):")
        defaults = {case_key(r.case): r for r in results if r.num_splits is None}
        for key, res in best.items():
            base = defaults.get(key)
            was = f" [{base.fraction_of_copy:.1%}]" if base is not None else ""
            splits = "auto" if res.num_splits is None else res.num_splits
            print(f"  {key}: {res.config.label()}, splits {splits}: {res.fraction_of_copy:.1%} of copy{was}")

    print(f"wrote {path}")
    plot = _plot(results, out_dir / "kernel_bench.png")
    if plot is not None:
        print(f"wrote {plot}")
    return 0


def run_sweep(
    forced_splits: tuple[int, ...],
    cases: list[DecodeCase],
    configs: list[LaunchConfig],
    device: torch.device,
    copy_bps: float,
    budget_s: float,
    warmup: int,
    iters: int,
    report: dict[str, Any],
    save: Callable[[], None],
) -> list[DecodeResult]:
    """Configurations outer, cases inner (each configuration compiles once per split count), then
    forced splits on each case's best configuration; stops when the budget is spent."""
    deadline = time.monotonic() + budget_s
    done: list[DecodeResult] = []
    report["sweep_complete"] = False

    def measure(case: DecodeCase, config: LaunchConfig, num_splits: int | None) -> bool:
        if time.monotonic() > deadline:
            return False
        res = run_decode_case(case, device, copy_bps, num_splits, warmup, iters, config)
        done.append(res)
        report["sweep"].append(asdict(res))
        print(_row(res))
        save()
        return True

    print(f"sweep: {len(configs)} configurations x {len(cases)} cases, budget {budget_s:.0f}s")
    for config in configs:
        for case in cases:
            if not measure(case, config, None):
                print("sweep: budget spent; kernel_bench.json has what was measured")
                return done
    best = best_per_case(done)
    for case in cases:
        config = best[case_key(case)].config
        for num_splits in forced_splits:
            if not measure(case, config, num_splits):
                print("sweep: budget spent during forced splits")
                return done
    report["sweep_complete"] = True
    return done


def _plot(results: list[DecodeResult], path: Path) -> Path | None:
    """Fraction of copy bandwidth against batch, one line per head shape and split mode (if matplotlib)."""
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
        c = r.case
        series.setdefault(f"{c.num_heads}/{c.num_kv_heads} heads, ctx {c.context}, {mode}", []).append(r)
    for label, rs in series.items():
        ax.plot([r.case.batch for r in rs], [r.fraction_of_copy for r in rs], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch (requests)")
    ax.set_ylabel("fraction of copy bandwidth")
    ax.set_title("paged decode attention")
    ax.legend(fontsize="x-small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
