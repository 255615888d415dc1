"""The CPU sampler's random draw and its top-p cut: through torch against the C++ kernels.

    python -m bench.sampler_bench [--rows 1,8,32,64] [--vocab 49152] [--top-p 0.9] [--threads 1]

A random row (temperature > 0) draws argmax(logits - log q), q ~ Exp(1) from a hash of (seed, step,
token) over the whole vocabulary (engine/sampling/sampler.py). Timed per row count, interleaved, the
best of --repeats: the race through torch (the noise as whole-vocabulary int64 and float64 tensors,
its log, the C++ argmax) and in the kernel (engine/kernels/cpu/sampling.cpp, a row at a time in
cache-sized chunks); then top-p by torch's sort of the vocabulary and by the kernel's threshold. Each
row count also checks that both draw the same tokens, and counts the tokens whose top-p fate differs
(the sort sums the mass in float32, the kernel in float64: a token at the boundary may fall either
way; where they differed, a float64 sort kept what the kernel kept). The logits are Gaussian, scale
3: flatter than a trained model's, so a large nucleus.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

import torch

from bench.run_support import run_cpu_kernel_bench
from engine.sampling.sampler import apply_top_p, argmax_rows, exponential_noise, row_keys

Draw = Callable[[torch.Tensor, list[int], list[int]], torch.Tensor]


def _seconds(draw: Draw, args: tuple[torch.Tensor, list[int], list[int]]) -> float:
    start = time.perf_counter()
    draw(*args)
    return time.perf_counter() - start


def torch_path(logits: torch.Tensor, seeds: list[int], steps: list[int]) -> torch.Tensor:
    noise = exponential_noise(seeds, steps, logits.shape[1], logits.device)
    return argmax_rows(logits - noise.log())


def kernel(logits: torch.Tensor, seeds: list[int], steps: list[int]) -> torch.Tensor:
    keys = torch.tensor(row_keys(seeds, steps), dtype=torch.int64)
    out: torch.Tensor = torch.ops.inflight_cpu.exponential_race(logits, keys)
    return out


def sorted_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """The torch definition: sort the vocabulary, keep while the mass strictly before is below top_p."""
    ordered, order = logits.sort(dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    ordered = ordered.masked_fill(probs.cumsum(dim=-1) - probs >= top_p[:, None], float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _cut_seconds(
    cut: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], logits: torch.Tensor, p: torch.Tensor
) -> float:
    start = time.perf_counter()
    cut(logits, p)
    return time.perf_counter() - start


def report_top_p(rows_list: list[int], vocab: int, top_p: float, repeats: int) -> None:
    print(f"top-p {top_p} over a {vocab}-token vocabulary")
    print(
        f"{'rows':>5} {'sort ms':>9} {'kernel ms':>10} {'sort/kernel':>13} {'kept a row':>11} {'differ':>7}"
    )
    for rows in rows_list:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
        p = torch.full((rows,), top_p)
        kept = ~torch.isinf(apply_top_p(logits, p))
        # The sort sums the mass in float32 in order, the kernel in float64 by bins: a token whose mass
        # before it is within rounding of top_p can fall either way.
        differ = int((kept != ~torch.isinf(sorted_top_p(logits, p))).sum())
        t_sort = t_kernel = float("inf")
        for _ in range(repeats):
            t_sort = min(t_sort, _cut_seconds(sorted_top_p, logits, p))
            t_kernel = min(t_kernel, _cut_seconds(apply_top_p, logits, p))
        print(
            f"{rows:>5} {t_sort * 1e3:>9.2f} {t_kernel * 1e3:>10.2f} {t_sort / t_kernel:>12.1f}x "
            f"{kept.sum().item() / rows:>11.0f} {differ:>7}"
        )


def report(rows_list: list[int], vocab: int, repeats: int) -> None:
    print(f"exponential race over a {vocab}-token vocabulary, {torch.get_num_threads()} thread(s)")
    print(f"{'rows':>5} {'torch ms':>9} {'kernel ms':>10} {'torch/kernel':>13} {'ns a token':>11}")
    for rows in rows_list:
        logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(rows)) * 3
        args = (logits, list(range(rows)), [7] * rows)
        if not torch.equal(torch_path(*args), kernel(*args)):
            raise SystemExit(f"the kernel drew other tokens than the torch path at {rows} rows")
        t_torch = t_kernel = float("inf")
        for _ in range(repeats):  # interleaved, so a slow moment of the host hits both
            t_torch = min(t_torch, _seconds(torch_path, args))
            t_kernel = min(t_kernel, _seconds(kernel, args))
        print(
            f"{rows:>5} {t_torch * 1e3:>9.2f} {t_kernel * 1e3:>10.2f} {t_torch / t_kernel:>12.1f}x "
            f"{t_kernel / (rows * vocab) * 1e9:>11.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per path (the best counts)")
    parser.add_argument("--rows", default="1,8,32,64", help="comma list of row counts")
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (default SmolLM2's)")
    parser.add_argument("--top-p", type=float, default=0.9, help="top_p of the nucleus timings")
    args = parser.parse_args(argv)
    from engine.kernels import cpu as cpu_kernels

    if cpu_kernels.load() and not torch.ops.inflight_cpu.exponential_race_supported():
        print(
            "sampler_bench: the race kernel does not run here (no AVX2, or torch without MKL)",
            file=sys.stderr,
        )
        return 2
    rows = [int(r) for r in args.rows.split(",")]

    def both() -> None:
        report(rows, args.vocab, args.repeats)
        report_top_p(rows, args.vocab, args.top_p, args.repeats)

    return run_cpu_kernel_bench("sampler_bench", args.threads, both)


if __name__ == "__main__":
    raise SystemExit(main())
