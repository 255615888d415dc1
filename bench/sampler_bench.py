"""The CPU sampler's random draw, top-p cut and penalties: the torch forms against the faster ones.

    python -m bench.sampler_bench [--rows 1,8,32,64] [--vocab 49152] [--top-p 0.9] [--threads 1]

A random row (temperature > 0) draws argmax(logits - log q), q ~ Exp(1) from a hash of (seed, step,
token) over the whole vocabulary (engine/sampling/sampler.py). Timed per row count, interleaved, the
best of --repeats: the race through torch (the noise as whole-vocabulary int64 and float64 tensors,
its log, the C++ argmax) and in the kernel (engine/kernels/cpu/sampling.cpp, a row at a time in
cache-sized chunks); then top-p by torch's sort of the vocabulary and by the kernel's threshold. Each
row count also checks that both draw the same tokens, and counts the tokens whose top-p fate differs
(the sort sums the mass in float32, the kernel in float64: a token at the boundary may fall either
way; where they differed, a float64 sort kept what the kernel kept). The logits are Gaussian, scale
3: flatter than a trained model's, so a large nucleus. Last, the repetition penalty over whole
[rows, vocab] tensors against the sampler's, which touches only the tokens each row has seen.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

import torch

from bench.run_support import run_cpu_kernel_bench
from engine.sampling.sampler import (
    SamplingRow,
    apply_penalties,
    apply_top_p,
    argmax_rows,
    exponential_noise,
    row_keys,
)
from engine.sampling_params import SamplingParams

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


def dense_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Repetition penalty over whole [rows, vocab] tensors of counts and masks, the form the sampler
    had before it touched only the seen tokens."""
    counts = torch.zeros_like(logits)
    r_idx = torch.tensor([i for i, r in enumerate(rows) for _ in r.output_token_ids])
    t_idx = torch.tensor([t for r in rows for t in r.output_token_ids])
    counts.index_put_((r_idx, t_idx), torch.ones(len(t_idx)), accumulate=True)
    seen = counts > 0
    seen[
        torch.tensor([i for i, r in enumerate(rows) for _ in r.prompt_token_ids]),
        torch.tensor([t for r in rows for t in r.prompt_token_ids]),
    ] = True
    p = torch.tensor([r.params.repetition_penalty for r in rows])[:, None]
    return torch.where(seen, torch.where(logits > 0, logits / p, logits * p), logits)


def report_penalties(rows_list: list[int], vocab: int, repeats: int) -> None:
    print(f"repetition penalty 1.05, 128 prompt and 64 output tokens a row, {vocab}-token vocabulary")
    print(f"{'rows':>5} {'dense ms':>9} {'seen ms':>10} {'dense/seen':>13}")
    for n in rows_list:
        rng = random.Random(n)
        logits = torch.randn(n, vocab, generator=torch.Generator().manual_seed(n))
        rows = [
            SamplingRow(
                SamplingParams(temperature=0.7, repetition_penalty=1.05),
                [rng.randrange(vocab) for _ in range(128)],
                [rng.randrange(vocab) for _ in range(64)],
                seed=i,
            )
            for i in range(n)
        ]
        if not torch.equal(apply_penalties(logits, rows), dense_penalties(logits, rows)):
            raise SystemExit(f"the penalties differ from the dense form at {n} rows")
        t_dense = t_seen = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            dense_penalties(logits, rows)
            t_dense = min(t_dense, time.perf_counter() - start)
            start = time.perf_counter()
            apply_penalties(logits, rows)
            t_seen = min(t_seen, time.perf_counter() - start)
        print(f"{n:>5} {t_dense * 1e3:>9.2f} {t_seen * 1e3:>10.2f} {t_dense / t_seen:>12.1f}x")


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
        report_penalties(rows, args.vocab, args.repeats)

    return run_cpu_kernel_bench("sampler_bench", args.threads, both)


if __name__ == "__main__":
    raise SystemExit(main())
