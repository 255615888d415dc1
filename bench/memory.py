"""``python -m bench memory``: what a model costs in memory, quantized or not.

Measured: the resident memory (VmRSS, and its peak VmHWM) of a fresh process after ``LLM(...)`` has
loaded the model with a fixed KV cache (``--num-blocks``), for the default model (SmolLM2-135M) served
from its own Q4_1 blocks, as W8A16 int8 (a compressed-tensors checkpoint made here from its float copy),
as fp8 (its float copy quantized at load, ``quantization="fp8"``) and as its float32 copy; then, in
the same process, batch-1 decode tok/s. One child process per configuration, so no one's pages stay
behind.

Computed: the largest of the planner's model shapes (inflight/plan/shapes.py) that fits a host of
``--host-gb`` GB for each weight format, by the planner's arithmetic (``activation_reserve``: 1 GiB of
runtime plus a full-budget step's activations; the weights; a KV cache holding ``--context`` tokens
in the activations' dtype). Block formats count their bytes per value as stored (Q4_K: 144 bytes per
256 values); W8A16 and fp8 keep the embedding and the LM head in bf16 (both quantize linears only).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.results import write_json

GB = 1e9
# Bytes a weight value takes in each format: the block formats' own sizes (engine/quant/formats.py).
_BYTES_PER_VALUE = {
    "float32": 4.0,
    "bfloat16": 2.0,
    "W8A16 or fp8": 1.0,
    "Q8_0": 34 / 32,
    "Q6_K": 210 / 256,
    "Q5_K": 176 / 256,
    "Q4_1": 20 / 32,
    "Q4_K": 144 / 256,
    "Q4_0": 18 / 32,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="a GGUF (default: the shipped SmolLM2-135M-Instruct Q4_1)")
    p.add_argument("--num-blocks", type=int, default=256, help="KV blocks every configuration gets")
    p.add_argument("--host-gb", type=float, default=24.0)
    p.add_argument("--context", type=int, default=8192, help="KV tokens the fit keeps room for")
    p.add_argument("--kv-dtype-bytes", type=int, default=2, help="bytes a KV value takes (2: bf16)")
    p.add_argument("--skip-measure", action="store_true", help="only the computed fit")
    p.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode timed after load (0: none)")
    p.add_argument("--one", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    p.add_argument("--out", default="bench-results/memory.json")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _one(model: str, quantization: str, num_blocks: int, decode_tokens: int) -> dict[str, Any]:
    """In this (fresh) process: load, report resident memory and the weights' own bytes, then time a
    batch-1 decode (a 128-token prompt, then ``decode_tokens`` greedy tokens; best of two)."""
    import time

    from engine import LLM, SamplingParams

    llm = LLM(
        model,
        dtype="float32",
        quantization=quantization,
        num_blocks=num_blocks,
        max_num_seqs=16,
        enable_prefix_caching=False,
    )
    weights = llm.engine.runner.model.weight_bytes()
    out = {
        "rss_mib": _status_kib("VmRSS") / 1024,
        "peak_rss_mib": _status_kib("VmHWM") / 1024,
        "weight_mib": sum(weights.values()) / 2**20,
    }
    if decode_tokens > 1:
        prompt = [100 + (37 * i) % 20000 for i in range(128)]

        def timed(n: int) -> float:
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            return time.perf_counter() - start

        timed(2)  # warm-up
        first = min(timed(1) for _ in range(2))
        total = min(timed(decode_tokens) for _ in range(2))
        out["decode_tok_s"] = (decode_tokens - 1) / max(total - first, 1e-9)
    return out


def write_w8a16_copy(float_dir: Path, target: Path) -> Path:
    """A compressed-tensors W8A16 checkpoint (int-quantized: int8 weights, float32 per-channel scales) of
    the float checkpoint at ``float_dir``: every decoder linear quantized, the rest as stored."""
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.quant.channel import quantize_per_channel

    if (target / "config.json").is_file():
        return target
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tensors: dict[str, Any] = {}
    for name, tensor in load_file(str(float_dir / "model.safetensors")).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            w = quantize_per_channel(tensor)
            tensors[name] = w.qweight
            tensors[name.removesuffix("weight") + "weight_scale"] = w.scale[:, None].contiguous()
        else:
            tensors[name] = tensor.contiguous()
    save_file(tensors, str(partial / "model.safetensors"))
    for extra in float_dir.iterdir():
        if extra.name != "model.safetensors" and extra.is_file():
            shutil.copy(extra, partial / extra.name)
    config = json.loads((float_dir / "config.json").read_text())
    weights = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "ignore": ["lm_head"],
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None}},
    }
    (partial / "config.json").write_text(json.dumps(config, indent=1))
    partial.rename(target)
    return target


def _measure(args: argparse.Namespace, gguf: Path) -> list[dict[str, Any]]:
    from engine.models.gguf import local_checkpoint
    from engine.paths import models_dir

    float_dir = local_checkpoint(gguf)  # the float32 copy (converted once into the model cache)
    w8 = write_w8a16_copy(float_dir, models_dir() / f"{float_dir.name}-w8a16")
    rows = []
    for label, model, quantization in (
        (f"{gguf.name} blocks", str(gguf), "auto"),
        ("W8A16 int8 (from the float copy)", str(w8), "auto"),
        ("fp8 at load (from the float copy)", str(float_dir), "fp8"),
        ("float32 copy", str(gguf), "none"),
    ):
        cmd = [sys.executable, "-m", "bench", "memory", "--one", model, quantization]
        cmd += ["--num-blocks", str(args.num_blocks), "--decode-tokens", str(args.decode_tokens)]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=True)
        rows.append({"label": label, **json.loads(proc.stdout.strip().splitlines()[-1])})
        print(f"{label}: {rows[-1]}", flush=True)
    return rows


def fit(host_gb: float, context: int, kv_bytes: int) -> list[dict[str, Any]]:
    """For each planner model shape and weight format: the memory it needs and whether it fits."""
    from inflight.plan.presets import MODELS, activation_reserve

    rows = []
    for shape in sorted(MODELS.values(), key=lambda s: s.params):
        reserve = activation_reserve(shape, 2048, 64)
        kv = context * shape.kv_bytes_per_token // shape.bytes_per_param * kv_bytes
        table = shape.embedding_params + (0 if shape.tie_word_embeddings else shape.lm_head_params)
        linears = shape.params - table
        for fmt, per_value in _BYTES_PER_VALUE.items():
            weights = linears * per_value + table * (2.0 if fmt == "W8A16 or fp8" else per_value)
            total = weights + reserve + kv
            rows.append(
                {
                    "model": shape.name,
                    "params_b": shape.params / 1e9,
                    "format": fmt,
                    "weights_gb": weights / GB,
                    "total_gb": total / GB,
                    "fits": total <= host_gb * GB,
                }
            )
    return rows


def main(args: argparse.Namespace) -> int:
    if args.one:
        print(json.dumps(_one(args.one[0], args.one[1], args.num_blocks, args.decode_tokens)))
        return 0
    from engine.models.gguf import default_gguf_path

    gguf = Path(args.model) if args.model else default_gguf_path()
    measured = [] if args.skip_measure or gguf is None else _measure(args, gguf)
    fits = fit(args.host_gb, args.context, args.kv_dtype_bytes)
    write_json(args.out, {"args": vars(args), "measured": measured, "fit": fits})
    if measured:
        print("\n| served as | resident memory after load | peak | the weights' own bytes | decode b=1 |")
        print("|---|---|---|---|---|")
        for r in measured:
            speed = f"{r['decode_tok_s']:.1f} tok/s" if "decode_tok_s" in r else "-"
            print(
                f"| {r['label']} | {r['rss_mib']:,.0f} MiB | {r['peak_rss_mib']:,.0f} MiB "
                f"| {r['weight_mib']:,.0f} MiB | {speed} |"
            )
    formats = list(_BYTES_PER_VALUE)
    print(f"\nGB needed on a {args.host_gb:g} GB host ({args.context} KV tokens; * = does not fit):\n")
    print("| model | " + " | ".join(formats) + " |\n|---|" + "---|" * len(formats))
    for name in dict.fromkeys(r["model"] for r in fits):
        cells = [r for r in fits if r["model"] == name]
        line = " | ".join(f"{r['total_gb']:.1f}{'' if r['fits'] else ' *'}" for r in cells)
        print(f"| {name} ({cells[0]['params_b']:.1f}B) | {line} |")
    from inflight.plan.presets import MODELS, activation_reserve

    # Past the named shapes: the parameters that fit beside llama-3-8b's reserve and KV cache.
    ref = MODELS["llama-3-8b"]
    room = args.host_gb * GB - activation_reserve(ref, 2048, 64)
    room -= args.context * ref.kv_bytes_per_token // ref.bytes_per_param * args.kv_dtype_bytes
    print()
    for fmt in formats:
        fitting = [r for r in fits if r["format"] == fmt and r["fits"]]
        best = max(fitting, key=lambda r: r["params_b"])["model"] if fitting else "none"
        print(
            f"{fmt}: largest named shape that fits {best}; "
            f"about {room / _BYTES_PER_VALUE[fmt] / 1e9:.0f}B params at most"
        )
    return 0
