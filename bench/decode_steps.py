"""A decode step's time by batch size: where a low load's CPU per request comes from.

    python -m bench.decode_steps [--model bench] [--batches 1,4,8,16,32] [--dtypes float32,bfloat16]

For each batch size, an engine in this process holds that many requests past their prefills and times
decode steps (``bench.micro.decode_probe``: the whole ``engine.step()``, median of --rounds, beside its
linear layers alone). Printed: the step, the step per sequence, and the rate the step reads the
model's weights at (every linear weight and the LM head once a step, over the step's time). Where
that rate sits near the core's memory bandwidth and the step barely grows with the batch, an engine
at a low load pays nearly a whole step per token of each of the few sequences it runs: the stack's
engine core CPU per request at the Poisson load of ``bench service`` is that.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.micro import decode_probe
from bench.service_load_args import MODELS, resolve_model
from inflight.plan.shapes import shape_from_config

BYTES = {"float32": 4, "bfloat16": 2}


def weight_bytes(model: str, dtype: str) -> int:
    """What a decode step streams: every linear weight and the LM head, in ``dtype``."""
    raw = json.loads((Path(model) / "config.json").read_text())
    shape = shape_from_config(raw, model)
    return shape.num_layers * shape.layer_params * BYTES[dtype] + shape.lm_head_params * BYTES[dtype]


def main(argv: list[str] | None = None) -> int:
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=formatter)
    parser.add_argument("--model", default="bench", help=f"{', '.join(MODELS)} or a checkpoint directory")
    parser.add_argument("--batches", default="1,4,8,16,32", help="comma list of batch sizes")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma list: float32, bfloat16")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument(
        "--rounds", type=int, default=8, help="timed decode steps per batch (the median counts)"
    )
    args = parser.parse_args(argv)
    model = resolve_model(args.model)
    if not (Path(model) / "config.json").is_file():
        raise SystemExit(f"decode_steps: {model} is not a checkpoint directory with a config.json")
    torch.set_num_threads(args.threads)
    print(f"{model}, {torch.get_num_threads()} thread(s)")
    print(f"{'dtype':>9} {'batch':>6} {'step ms':>8} {'linear ms':>10} {'ms a seq':>9} {'weights GB/s':>13}")
    for dtype in args.dtypes.split(","):
        if dtype not in BYTES:
            raise SystemExit(f"decode_steps: --dtypes takes float32 and bfloat16, not {dtype!r}")
        streamed = weight_bytes(model, dtype)
        for batch in (int(b) for b in args.batches.split(",")):
            r = decode_probe(model, batch=batch, rounds=args.rounds, dtype=dtype, prompt_len=32)
            print(
                f"{dtype:>9} {batch:>6} {r.step_ms:>8.2f} {r.packed_linear_ms:>10.2f} "
                f"{r.step_ms / batch:>9.2f} {streamed / (r.step_ms / 1e3) / 1e9:>13.1f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
