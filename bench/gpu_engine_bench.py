"""Engine benchmark on one GPU: a Llama-3-8B-shaped random-weight model in bfloat16.

    python -m bench.gpu_engine_bench --out bench-results

Prints, in this order (gpu_engine_bench.json is rewritten after each):
  * the decode step at batch 64, context 1k next to its bandwidth bound: (weights streamed per step
    + KV read) / measured copy bandwidth, where the embedding table is not streamed (a step gathers
    64 of its rows) but the LM head is;
  * a kernel table of ten graphed batch-64 decode steps (torch.profiler): attention, GEMMs,
    pointwise work and copies, per step, and the heaviest kernels;
  * batch-1 decode from the full decode graphs, from the piecewise graphs, and truly eager (neither);
  * output tokens/s, TTFT and TPOT for a mixed batch, greedy and at temperature 0.8 with top-p 0.95.
Needs only torch, triton, numpy and this repository (weights are drawn on the device, no tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from engine.llm_engine import LLMEngine
from engine.metrics import percentile
from engine.sampling_params import SamplingParams

LLAMA3_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def copy_bandwidth(num_bytes: int = 2 << 30, iters: int = 20) -> float:
    """Device copy bandwidth in bytes/s, counting the read and the write."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    torch.cuda.synchronize()
    return 2 * num_bytes * iters / (time.perf_counter() - start)


# Every engine loop here stops after a step cap: a step that fails to make progress raises instead
# of spinning until the GPU check's stage timeout.
MAX_STEPS = 20_000


def run_until_prefilled(engine: LLMEngine, ids: list[str], max_steps: int = MAX_STEPS) -> None:
    pending = set(ids)
    for _ in range(max_steps):
        if not pending:
            return
        for out in engine.step():
            if out.outputs and out.outputs[0].token_ids:
                pending.discard(out.request_id)
    raise RuntimeError(f"step cap: {len(pending)} requests not prefilled after {max_steps} steps")


def run_to_completion(engine: LLMEngine, max_steps: int = MAX_STEPS) -> None:
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return
        engine.step()
    raise RuntimeError(f"step cap: requests unfinished after {max_steps} steps")


def time_decode_steps(engine: LLMEngine, steps: int) -> float:
    """Mean seconds per engine step (the sampler's host copy synchronises every step)."""
    engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


EMBEDDING = "model.embed_tokens.weight"


def streamed_weight_bytes(sizes: dict[str, int], tied: bool) -> int:
    """Weight bytes a decode step reads in full: every matrix but the embedding table, of which a
    step gathers one row per token, unless the LM head is that same table (tied embeddings)."""
    return sum(n for name, n in sizes.items() if tied or name != EMBEDDING)


def decode_bound_bytes(
    weight_bytes: int, batch: int, context: int, layers: int, kv_heads: int, head_dim: int, elem: int
) -> int:
    """Bytes a decode step must move at least: the streamed weights and every cached K and V."""
    return weight_bytes + batch * context * layers * 2 * kv_heads * head_dim * elem


def decode_bound(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> tuple[float, float]:
    mc = engine.config.model
    elem = torch.empty((), dtype=engine.config.dtype).element_size()
    sizes = engine.runner.model.weight_bytes()
    # No separate LM head: the head reads the whole embedding table every step.
    w = streamed_weight_bytes(sizes, tied="lm_head.weight" not in sizes)
    total = decode_bound_bytes(
        w, batch, context, mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim, elem
    )
    return total / bandwidth, float(total)


# Kernel-name fragments of each part of a step (Triton kernels keep their function names; cuBLAS and
# CUTLASS GEMMs carry one of these; memcpy/memset activities are named by the profiler itself).
GEMM_MARKS = ("gemm", "gemv", "cutlass", "xmma", "nvjet", "cublas", "matmul")


def kernel_category(name: str) -> str:
    low = name.lower()
    if "paged_attention" in low or "merge_splits" in low:
        return "attention"
    if any(mark in low for mark in GEMM_MARKS):
        return "gemm"
    if low.startswith(("memcpy", "memset")):
        return "copy"
    return "pointwise"


def kernel_table(kernels: list[tuple[str, float, int]], steps: int, top: int = 8) -> dict[str, Any]:
    """(name, total device us, calls) of every kernel over `steps` steps -> per-step time and share
    of attention, GEMMs, pointwise work and copies, and the `top` heaviest kernels."""
    per_cat: dict[str, float] = {"attention": 0.0, "gemm": 0.0, "pointwise": 0.0, "copy": 0.0}
    for name, us, _ in kernels:
        per_cat[kernel_category(name)] += us
    total = sum(per_cat.values())
    heaviest = sorted(kernels, key=lambda k: -k[1])[:top]
    return {
        "steps": steps,
        "kernel_us_per_step": total / steps,
        "us_per_step": {c: us / steps for c, us in per_cat.items()},
        "share": {c: (us / total if total else 0.0) for c, us in per_cat.items()},
        "top_kernels": [
            {
                "name": n[:80],
                "category": kernel_category(n),
                "us_per_step": us / steps,
                "calls_per_step": c / steps,
            }
            for n, us, c in heaviest
        ],
    }


def profile_decode_steps(engine: LLMEngine, steps: int) -> dict[str, Any]:
    """torch.profiler over `steps` engine steps (decode-only: replayed from the decode graphs)."""
    from torch.profiler import ProfilerActivity, profile

    engine.step()  # the first step after the timing loop may still have work in flight
    torch.cuda.synchronize()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - start
    kernels = []
    for event in prof.key_averages():
        us = float(getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)))
        if us > 0:
            kernels.append((event.key, float(us), int(event.count)))
    table = kernel_table(kernels, steps)
    table["wall_ms_per_step_profiled"] = wall / steps * 1e3
    return table


def print_profile(table: dict[str, Any]) -> None:
    per, share = table["us_per_step"], table["share"]
    parts = ", ".join(f"{c} {per[c]:.0f} us ({share[c]:.0%})" for c in per)
    print(
        f"decode step kernels ({table['steps']} graphed steps): {table['kernel_us_per_step']:.0f} us of "
        f"kernels per step, wall {table['wall_ms_per_step_profiled']:.2f} ms (profiled): {parts}"
    )
    for k in table["top_kernels"]:
        print(f"  {k['us_per_step']:>8.1f} us  x{k['calls_per_step']:<5.0f} {k['category']:<9} {k['name']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-results")
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-sampled-requests", type=int, default=128)
    parser.add_argument("--decode-batch", type=int, default=64)
    parser.add_argument("--decode-context", type=int, default=1024)
    parser.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off"],
        default="auto",
        help="the engine's async_scheduling (auto: on for CUDA); run once each way to measure the overlap",
    )
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("gpu_engine_bench needs a CUDA device")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "device": torch.cuda.get_device_name(),
        "async_scheduling": args.async_scheduling,
    }
    overlap = {"auto": None, "on": True, "off": False}[args.async_scheduling]
    out_path = out_dir / "gpu_engine_bench.json"

    def save() -> None:
        # After every section: a stage timeout later on still leaves the figures measured so far.
        out_path.write_text(json.dumps(results, indent=2))

    bandwidth = copy_bandwidth()
    results["copy_bandwidth_GBps"] = bandwidth / 1e9
    print(f"copy bandwidth: {bandwidth / 1e9:.0f} GB/s")

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(LLAMA3_8B))
        t0 = time.perf_counter()
        engine = LLMEngine.from_engine_args(
            tmp,
            dtype="bfloat16",
            load_format="dummy",
            max_model_len=4096,
            max_num_seqs=128,
            async_scheduling=overlap,
        )
        results["engine_init_s"] = time.perf_counter() - t0
        print(f"engine ready in {results['engine_init_s']:.1f}s, {engine.kv.num_total_blocks} KV blocks")
        rng = random.Random(0)
        vocab = int(LLAMA3_8B["vocab_size"])

        # -- decode step at batch B, context C, next to the bandwidth bound -------------------------
        b, ctx = args.decode_batch, args.decode_context
        params = SamplingParams(temperature=0, max_tokens=4096 - ctx - 1, ignore_eos=True)
        ids = [f"d{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(vocab) for _ in range(ctx)], params)
        run_until_prefilled(engine, ids)
        step_s = time_decode_steps(engine, 30)
        bound_s, bytes_per_step = decode_bound(engine, b, ctx + 16, bandwidth)
        results["decode_step"] = {
            "batch": b,
            "context": ctx,
            "step_ms": step_s * 1e3,
            "bound_ms": bound_s * 1e3,
            "ratio_to_bound": step_s / bound_s,
            "bytes_per_step_GB": bytes_per_step / 1e9,
            "target": "<= 1.5x the bound",
        }
        print(
            f"decode step @ batch {b}, ctx {ctx}: {step_s * 1e3:.2f} ms, bound {bound_s * 1e3:.2f} ms "
            f"-> {step_s / bound_s:.2f}x (target <= 1.5x)"
        )
        save()
        # -- where the batch-64 step's device time goes: ten graphed steps under the profiler --------
        try:
            results["decode_profile"] = profile = profile_decode_steps(engine, 10)
            save()
            print_profile(profile)
        except Exception as exc:  # the profiler is an aid: its failure must not cost the figures after it
            results["decode_profile"] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"decode profile failed: {exc}")
        for rid in ids:
            engine.abort_request(rid)
        save()
        engine.step()

        # -- batch-1 decode: full decode graphs, piecewise graphs, and truly eager (neither) ----------
        engine.add_request("one", [rng.randrange(vocab) for _ in range(128)], params)
        run_until_prefilled(engine, ["one"])
        runner = engine.runner
        graphs, piecewise = runner.graphs, runner.piecewise
        graphed = time_decode_steps(engine, 50)
        runner.graphs = None  # a decode step then replays the piecewise graphs around eager attention
        pieces = time_decode_steps(engine, 50) if piecewise is not None else float("nan")
        runner.piecewise = None
        eager = time_decode_steps(engine, 50)
        runner.graphs, runner.piecewise = graphs, piecewise
        engine.abort_request("one")
        engine.step()
        results["batch1_decode"] = {
            "graph_ms": graphed * 1e3,
            "piecewise_ms": pieces * 1e3,
            "eager_ms": eager * 1e3,
            "speedup": eager / graphed,
            "target": ">= 1.5x",
        }
        save()
        print(
            f"batch-1 decode: graphs {graphed * 1e3:.2f} ms, piecewise {pieces * 1e3:.2f} ms, "
            f"eager {eager * 1e3:.2f} ms -> {eager / graphed:.2f}x over eager (target >= 1.5x)"
        )

        # -- mixed workloads, all arriving at once: greedy, then temperature 0.8 with top-p 0.95 ----
        finished: list[Any] = []
        engine.metrics.request_listeners.append(finished.append)
        workloads = [
            ("workload", args.num_requests, (0.0, 1.0)),
            ("workload_sampled", args.num_sampled_requests, (0.8, 0.95)),
        ]
        for name, num_requests, (temperature, top_p) in workloads:
            sampling = {"temperature": temperature, "top_p": top_p}
            finished.clear()
            total_out = 0
            for i in range(num_requests):
                n_out = rng.randint(64, 512)
                total_out += n_out
                engine.add_request(
                    f"{name}{i}",
                    [rng.randrange(vocab) for _ in range(rng.randint(128, 1024))],
                    SamplingParams(
                        temperature=temperature, top_p=top_p, max_tokens=n_out, ignore_eos=True, seed=i
                    ),
                )
            start = time.perf_counter()
            run_to_completion(engine)
            elapsed = time.perf_counter() - start
            ttft = [r.ttft for r in finished if r.ttft is not None]
            tpot = [r.tpot for r in finished if r.tpot is not None]
            results[name] = w = {
                "sampling": sampling,
                "num_requests": num_requests,
                "output_tokens": total_out,
                "seconds": elapsed,
                "output_tokens_per_s": total_out / elapsed,
                "ttft_p50_ms": percentile(ttft, 50) * 1e3,
                "ttft_p99_ms": percentile(ttft, 99) * 1e3,
                "tpot_p50_ms": percentile(tpot, 50) * 1e3,
                "tpot_p99_ms": percentile(tpot, 99) * 1e3,
                "target": ">= 8000 output tok/s",
            }
            print(
                f"{name} {sampling}: {num_requests} requests, {w['output_tokens_per_s']:.0f} output tok/s "
                f"(target >= 8000), TTFT p50 {w['ttft_p50_ms']:.0f} ms p99 {w['ttft_p99_ms']:.0f} ms, "
                f"TPOT p50 {w['tpot_p50_ms']:.1f} ms p99 {w['tpot_p99_ms']:.1f} ms"
            )
            save()

    save()
    print(f"wrote {out_path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
