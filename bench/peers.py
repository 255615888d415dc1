"""``python -m bench peers``: this engine against vLLM's CPU backend, side by side in one run.

The workload: N requests at t = 0 (default 64), a quarter of the prompts
256-512 tokens and the rest 16-128, outputs log-uniform 8-256, greedy with EOS ignored, prefix
caching off, the same dtype, threads, batch limit, token budget and KV capacity for both. Each
configuration (threads x model x dtype x batch limit) runs continuous, then vllm, then continuous
again, and reports the mean of the two engine runs, so a slow minute of a shared machine hits both
sides. At n threads the engine runs n torch threads and vLLM's OpenMP threads are bound to n cores
of this process's affinity mask (bench/targets/vllm_cpu.py). Outputs are compared token by token.
Optionally the same engine with static batching joins the runs, and the decode probe (one decode
step at a full batch vs the model's own linear layers alone on its packed weights, same rows; see
bench/micro.py) runs per thread count and dtype.

Writes ``peers.json`` and prints a Markdown table. Needs ``make bench-peers`` for vllm. With
``--llamacpp FORMATS`` llama.cpp joins too (``make bench-llamacpp``), on the shipped GGUF in those file
types, in its own table (bench/llamacpp.py: perplexity, prefill, batch-1 decode and bursts beside this
engine on the same files), kept in ``peers.json`` under ``llamacpp``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

from bench.compare import identical_outputs
from bench.micro import decode_probe
from bench.results import write_json
from bench.run_support import Session, set_threads
from bench.targets import TargetConfig
from engine.platform.cpu import cpu_auto_dtype, cpu_flags, cpu_model_name
from engine.platform.threads import physical_cores
from inflight.plan.workload import LengthMix, bench_model_path, synthetic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models", default="bench", help="comma list of checkpoints; 'bench' = the bench preset (default)"
    )
    p.add_argument("--dtypes", default="float32,bfloat16", help="comma list (auto: this CPU's pick)")
    p.add_argument(
        "--batches",
        default="64:2048,16:512",
        help="comma list of max_num_seqs:max_num_batched_tokens (default: %(default)s)",
    )
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument(
        "--threads",
        default="1",
        help="comma list of compute thread counts; every configuration runs at each (default: %(default)s)",
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--static", action="store_true", help="also run the engine with static batching")
    p.add_argument("--probe", action="store_true", help="also run the decode probe per dtype")
    p.add_argument("--no-vllm", action="store_true", help="the engine alone (no .venv-peers needed)")
    p.add_argument("--vllm-compile", action="store_true", help="let vLLM torch.compile (default: eager)")
    p.add_argument(
        "--async-scheduling",
        choices=["auto", "on", "off", "both"],
        default="auto",
        help="the engine's async_scheduling (auto: its own rule); both: runs with it off (the main "
        "figures), then once with it on, and reports async_tok_s and async_over_sync",
    )
    p.add_argument(
        "--llamacpp",
        default="",
        metavar="FORMATS",
        help="also run llama.cpp against this engine on the shipped GGUF in these llama.cpp file types "
        "(comma list, e.g. Q4_1,Q8_0,Q4_K_M; `python -m bench llamacpp` at the first thread count, "
        "its defaults otherwise): vLLM reads the float checkpoint, llama.cpp its GGUF files, so each "
        "peer gets its own table (default: none)",
    )
    p.add_argument("--out", default="bench-results/peers")


def llamacpp_args(formats: str, threads: int, out: Path) -> argparse.Namespace:
    """``bench llamacpp``'s arguments for ``--llamacpp``: its defaults, these formats and threads."""
    from bench import llamacpp

    parser = argparse.ArgumentParser()
    llamacpp.add_arguments(parser)
    return parser.parse_args(
        ["--formats", formats, "--threads", str(threads), "--out", str(out / "llamacpp.json")]
    )


def _tok_s(summary: dict[str, Any]) -> float:
    return float(summary["output_throughput"])


def run_config(
    model: str, dtype: str, batch: int, budget: int, threads: int, args: argparse.Namespace, out: Path
) -> dict[str, Any]:
    """One configuration at ``threads`` (already set on this process's torch): its row."""
    from engine.config import ModelConfig

    mc = ModelConfig.from_path(model)
    mix = LengthMix()
    engine_args: dict[str, Any] = {"dtype": dtype, "enable_prefix_caching": False}
    overlap = {"on": True, "off": False, "both": False}.get(args.async_scheduling)
    if overlap is not None:
        engine_args["async_scheduling"] = overlap
    config = TargetConfig(
        model=model,
        max_num_seqs=batch,
        max_num_batched_tokens=budget,
        block_size=args.block_size,
        max_model_len=mix.long_prompt[1] + mix.output[1] + args.block_size,
        seed=args.seed,
        engine_args=engine_args,
        vllm_eager=not args.vllm_compile,
    )
    specs = synthetic(args.num_requests, math.inf, mc.vocab_size, mix=mix, seed=args.seed, prefix="peer")
    session = Session(config, out, None, mc.vocab_size)
    row: dict[str, Any] = {
        "threads": threads,
        "model": model,
        "dtype": dtype,
        "max_num_seqs": batch,
        "budget": budget,
    }
    tag = f"t{threads}_{dtype}_{batch}"  # names the runs' files under out/runs
    try:
        first, s1 = session.run("continuous", specs, f"{tag}_a", math.inf)
        runs = [s1]
        if not args.no_vllm:
            vllm_run, sv = session.run("vllm", specs, tag, math.inf)
            session.release("vllm")
            row["vllm_tok_s"] = _tok_s(sv)
            row["vllm_tok_per_cpu_s"] = sv["output_tokens_per_cpu_s"]
            same = identical_outputs(first, vllm_run)
            row["identical"] = f"{same['identical']}/{same['compared']}"
            _, s2 = session.run("continuous", specs, f"{tag}_b", math.inf)
            runs.append(s2)
        row["inflight_tok_s"] = statistics.mean(_tok_s(s) for s in runs)
        row["inflight_tok_s_runs"] = [_tok_s(s) for s in runs]
        row["inflight_tok_per_cpu_s"] = statistics.mean(s["output_tokens_per_cpu_s"] for s in runs)
        if "vllm_tok_s" in row:
            row["ratio"] = row["inflight_tok_s"] / row["vllm_tok_s"]
            row["ratio_per_cpu_s"] = row["inflight_tok_per_cpu_s"] / row["vllm_tok_per_cpu_s"]
        if args.async_scheduling == "both":
            session.release("continuous")
            lagged = dataclasses.replace(config, engine_args={**engine_args, "async_scheduling": True})
            on = Session(lagged, out, None, mc.vocab_size)
            try:
                on_run, so = on.run("continuous", specs, f"{tag}_async", math.inf)
            finally:
                on.close()
            row["async_tok_s"] = _tok_s(so)
            row["async_over_sync"] = row["async_tok_s"] / row["inflight_tok_s"]
            same = identical_outputs(first, on_run)
            row["async_identical"] = f"{same['identical']}/{same['compared']}"
            print(
                f"async scheduling: {row['async_tok_s']:.1f} tok/s on vs {row['inflight_tok_s']:.1f} off "
                f"({row['async_over_sync']:.2f}x), identical outputs {row['async_identical']}",
                flush=True,
            )
        if args.static:
            _, ss = session.run("static", specs, tag, math.inf)
            row["static_tok_s"] = _tok_s(ss)
            row["continuous_over_static"] = row["inflight_tok_s"] / row["static_tok_s"]
    finally:
        session.close()
    return row


def parse_threads(text: str) -> list[int]:
    """A comma list ("1,2") as thread counts, each positive, in the order given, without repeats."""
    try:
        counts = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise SystemExit(f"--threads: a comma list of positive integers, got {text!r}") from None
    if not counts or min(counts) < 1:
        raise SystemExit(f"--threads: a comma list of positive integers, got {text!r}")
    return list(dict.fromkeys(counts))


def table(rows: list[dict[str, Any]]) -> str:
    head = "| threads | model | dtype | seqs / budget | inflight tok/s | vLLM tok/s | inflight / vLLM |"
    lines = [head + " per CPU-s | identical |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}" if "ratio" in r else "-"
        per_cpu = f"{r['ratio_per_cpu_s']:.2f}" if "ratio_per_cpu_s" in r else "-"
        vllm = f"{r['vllm_tok_s']:.1f}" if "vllm_tok_s" in r else "-"
        lines.append(
            f"| {r['threads']} | {Path(r['model']).name} | {r['dtype']} | "
            f"{r['max_num_seqs']} / {r['budget']} | {r['inflight_tok_s']:.1f} | {vllm} | {ratio} | "
            f"{per_cpu} | {r.get('identical', '-')} |"
        )
    return "\n".join(lines)


def run_probe(model: str, dtype: str, threads: int) -> dict[str, Any]:
    """The decode probe at 64 running sequences, printed; its JSON with the thread count."""
    p = decode_probe(model, batch=64, prompt_len=256, rounds=6, dtype=dtype)
    print(
        f"decode probe {dtype}, {threads} threads: step at 64 running {p.step_ms:.1f} ms, its linear "
        f"layers alone {p.packed_linear_ms:.1f} ms on the model's own weights at {p.linear_rows} rows "
        f"({p.step_over_linear:.2f}x; raw F.linear on unpacked weights {p.raw_linear_ms:.1f} ms), "
        f"context {p.context_mean:.0f}",
        flush=True,
    )
    return {"threads": threads, "dtype": dtype, **p.to_json()}


def main(args: argparse.Namespace) -> int:
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    thread_counts = parse_threads(args.threads)
    models = [str(bench_model_path()) if m == "bench" else m for m in args.models.split(",")]
    auto = str(cpu_auto_dtype()).removeprefix("torch.")
    dtypes = [auto if d == "auto" else d for d in args.dtypes.split(",")]
    batches = [tuple(int(x) for x in b.split(":")) for b in args.batches.split(",")]
    host = {
        "cpu": cpu_model_name(),
        "bf16_units": sorted(cpu_flags() & {"avx512_bf16", "amx_bf16"}),
        "avx512f": "avx512f" in cpu_flags(),
        "threads": thread_counts,
        "cores": physical_cores(),
        "auto_dtype": auto,
        "async_scheduling": args.async_scheduling,
    }
    print(f"host: {host}", flush=True)
    probes: list[dict[str, Any]] = []
    rows: list[dict[str, Any]] = []
    for threads in thread_counts:
        # The engine runs in this process: its torch threads are the process's. The vllm target reads
        # the same count when it starts its child (one Session per configuration, so after this).
        set_threads(threads)
        if args.probe:
            for dtype in dtypes:
                probes.append(run_probe(models[0], dtype, threads))
        for model in models:
            for dtype in dtypes:
                for batch, budget in batches:
                    rows.append(run_config(model, dtype, batch, budget, threads, args, out))
                    write_json(out / "peers.json", {"host": host, "probes": probes, "rows": rows})
    report: dict[str, Any] = {"host": host, "probes": probes, "rows": rows}
    write_json(out / "peers.json", report)
    print(table(rows))
    if args.llamacpp:
        from bench import llamacpp

        print(f"\nllama.cpp, {args.llamacpp} ({thread_counts[0]} thread(s)):", flush=True)
        lc_args = llamacpp_args(args.llamacpp, thread_counts[0], out)
        if llamacpp.main(lc_args) != 0:
            return 2
        report["llamacpp"] = json.loads(Path(lc_args.out).read_text())
        write_json(out / "peers.json", report)
    print(f"done in {time.time() - started:.0f} s", flush=True)
    return 0
