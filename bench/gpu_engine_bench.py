"""Engine benchmark on one GPU: a Llama-3-8B-shaped random-weight model in bfloat16.

    python -m bench.gpu_engine_bench --out bench-results

Prints output tokens/s, TTFT and TPOT for a mixed batch, greedy and at temperature 0.8 with top-p
0.95; the decode step at batch 64 next to its
bandwidth bound ((weights + KV read per step) / measured copy bandwidth); and batch-1 decode with
CUDA graphs vs eager. Needs only torch, triton, numpy and this repository (weights are drawn on the
device, no tokenizer).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.llm_engine import LLMEngine
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


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


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


def weight_bytes(engine: LLMEngine) -> int:
    return sum(t.numel() * t.element_size() for t in engine.runner.model.w.values())


def decode_bound(engine: LLMEngine, batch: int, context: int, bandwidth: float) -> tuple[float, float]:
    mc = engine.config.model
    elem = torch.empty((), dtype=engine.config.dtype).element_size()
    kv = batch * context * mc.num_hidden_layers * 2 * mc.num_key_value_heads * mc.head_dim * elem
    w = weight_bytes(engine)
    return (w + kv) / bandwidth, float(w + kv)


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
        for rid in ids:
            engine.abort_request(rid)
        save()
        engine.step()

        # -- batch-1 decode: CUDA graphs vs eager --------------------------------------------------
        engine.add_request("one", [rng.randrange(vocab) for _ in range(128)], params)
        run_until_prefilled(engine, ["one"])
        graphed = time_decode_steps(engine, 50)
        graphs, engine.runner.graphs = engine.runner.graphs, None
        eager = time_decode_steps(engine, 50)
        engine.runner.graphs = graphs
        engine.abort_request("one")
        engine.step()
        results["batch1_decode"] = {
            "graph_ms": graphed * 1e3,
            "eager_ms": eager * 1e3,
            "speedup": eager / graphed,
            "target": ">= 1.5x",
        }
        save()
        print(
            f"batch-1 decode: graphs {graphed * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms "
            f"-> {eager / graphed:.2f}x (target >= 1.5x)"
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
                "ttft_p50_ms": pct(ttft, 50) * 1e3,
                "ttft_p99_ms": pct(ttft, 99) * 1e3,
                "tpot_p50_ms": pct(tpot, 50) * 1e3,
                "tpot_p99_ms": pct(tpot, 99) * 1e3,
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
