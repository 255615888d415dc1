"""``inflight plan preset``: the command around inflight/plan/presets.py (list the GPUs and model
shapes, or build a preset from the flags, save it and print what it rests on)."""

from __future__ import annotations

import argparse
from dataclasses import replace

from inflight.plan import presets
from inflight.plan.calibrate import describe


def run_from_args(args: argparse.Namespace) -> int:
    """``inflight plan preset``: list, or build, save and describe a preset."""
    if args.list:
        for gpu in presets.GPUS.values():
            print(
                f"{gpu.name:>10}: {gpu.description}; {gpu.hbm_bytes_per_s / 1e12:g} TB/s, "
                f"{gpu.bf16_flops / 1e12:g} dense bf16 TFLOP/s (datasheet)"
            )
        print("models (or a checkpoint directory with a config.json):")
        for shape in presets.MODELS.values():
            print(f"  {shape.describe()}")
        return 0
    if not (args.gpu and args.model and args.out):
        raise SystemExit("plan preset needs --gpu, --model and --out (or --list)")
    given = {
        "mbu": args.mbu,
        "mfu": args.mfu,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "step_overhead_s": None if args.step_overhead_ms is None else args.step_overhead_ms / 1e3,
        "seq_overhead_s": None if args.seq_overhead_us is None else args.seq_overhead_us / 1e6,
    }
    try:
        assumptions = replace(presets.Assumptions(), **{k: v for k, v in given.items() if v is not None})
        settings = presets.EngineLimits(
            args.max_num_seqs, args.max_num_batched_tokens, args.max_model_len, args.block_size
        )
        shape = replace(presets.model_shape(args.model), kv_cache_dtype=args.kv_cache_dtype)
        cost = presets.build(args.gpu, shape, settings, assumptions, tp=args.tp)
    except presets.PresetError as err:
        raise SystemExit(f"plan preset: {err}") from None
    cost.save(args.out)
    print(describe(cost))
    memory = cost.host["memory"]
    print(
        f"{shape.describe()}; KV cache ({args.kv_cache_dtype}) {cost.engine['num_blocks']} blocks of "
        f"{args.block_size} ({memory['kv_bytes'] / 1e9:.1f} GB after {memory['weight_bytes'] / 1e9:.1f} GB "
        f"of weights and {memory['reserve_bytes'] / 1e9:.1f} GB reserved"
        + (f", each of {args.tp} ranks)" if args.tp > 1 else ")")
    )
    fit = cost.fit
    print(
        "linear fit vs the roofline by kind (rel RMS / worst): "
        + ", ".join(
            f"{kind} {100 * fit[kind + '_rel_rms']:.0f}% / {100 * fit[kind + '_rel_max']:.0f}%"
            for kind in ("decode", "prefill", "mixed")
            if kind + "_rel_rms" in fit
        )
    )
    times = presets.reference_times(cost)
    for name in (n for n in times if not n.endswith("_model_s")):
        label, model = name.removesuffix("_s"), times[name.removesuffix("_s") + "_model_s"]
        print(f"{label:>15}: roofline {times[name] * 1e3:8.2f} ms, linear model {model * 1e3:8.2f} ms")
    print(f"wrote {args.out}")
    return 0
