"""Tensor parallelism on this CPU: one rank with T threads against T ranks with one thread each
(and one rank with one thread, the control).

The same workload on the same random-weight checkpoint (engine/models/tiny.py's "bench" shape,
float32): ``--requests`` prompts of ``--prompt-len`` random tokens, ``--max-tokens`` greedy tokens each,
all submitted at once, async scheduling off so that a step is one forward. Each configuration runs in a
fresh process (torch's thread count and the process group are per process). Reported per
configuration: output tokens per second over the whole run, and the mean step split into rank 0's time
inside the collectives (the all-reduces and the logits gather, including any wait for the slower rank)
and the rest (its own compute, packing and sampling).

    python -m bench.tp_bench --out bench-results
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.platform.cpu import cpu_model_name


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.tp_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="bench-results", help="directory for tp_bench.json")
    p.add_argument("--threads", type=int, default=2, help="cores to split (default 2)")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--one", nargs=2, type=int, metavar=("TP", "THREADS"), help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    return p


def run_one(model: str, tp: int, threads: int, args: argparse.Namespace) -> dict[str, Any]:
    """One configuration, in this process."""
    import torch

    torch.set_num_threads(threads * tp)  # the launcher gives each of the tp ranks threads of these
    from engine import SamplingParams
    from engine.llm_engine import LLMEngine
    from engine.metrics import StepRecord

    engine = LLMEngine.from_engine_args(
        model,
        dtype="float32",
        tensor_parallel_size=tp,
        async_scheduling=False,
        max_num_seqs=args.requests,
        enable_prefix_caching=False,
    )
    steps: list[StepRecord] = []
    engine.metrics.step_listeners.append(steps.append)
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)

    def generate(n: int, tag: str) -> int:
        for i in range(n):
            engine.add_request(f"{tag}{i}", [rng.randrange(5, 8000) for _ in range(args.prompt_len)], params)
        tokens = 0
        while engine.has_unfinished_requests():
            tokens += sum(len(c.token_ids) for out in engine.step() for c in out.outputs)
        return tokens

    generate(2, "warm")  # first-step costs (allocations, the kernels' first runs) stay out
    steps.clear()
    tp_state = engine.runner.tp
    tp_state.timed, tp_state.collective_s = True, 0.0
    start = time.perf_counter()
    tokens = generate(args.requests, "r")
    seconds = time.perf_counter() - start
    engine.runner.close()
    step_s = sum(s.schedule_time + s.execute_time for s in steps) / len(steps)
    collective_s = tp_state.collective_s / len(steps)
    return {
        "tensor_parallel_size": tp,
        "torch_threads_per_rank": torch.get_num_threads(),
        "output_tokens": tokens,
        "seconds": seconds,
        "output_tok_s": tokens / seconds,
        "steps": len(steps),
        "mean_step_ms": 1e3 * step_s,
        "mean_collective_ms": 1e3 * collective_s,
        "mean_compute_ms": 1e3 * (step_s - collective_s),
    }


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.one:
        tp, threads = args.one
        print(json.dumps(run_one(args.model, tp, threads, args)))
        return 0
    from engine.models.tiny import write_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        model = str(write_tiny_checkpoint(tmp, preset="bench", dtype="float32", with_tokenizer=False))
        results = []
        # One rank with one thread too: on a busy host, T threads of one rank can lose more to
        # OpenMP's spinning than they gain, and that control says whether they did.
        for tp, threads in ((1, 1), (1, args.threads), (args.threads, 1)):
            cmd = [sys.executable, "-m", "bench.tp_bench", "--one", str(tp), str(threads), "--model", model]
            cmd += ["--requests", str(args.requests), "--prompt-len", str(args.prompt_len)]
            cmd += ["--max-tokens", str(args.max_tokens)]
            done = subprocess.run(cmd, capture_output=True, text=True, check=True)
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    report = {
        "command": "python -m bench.tp_bench " + " ".join(argv if argv is not None else sys.argv[1:]),
        "host": {
            "cpu": cpu_model_name(),
            "cores_split": args.threads,
            "load_average_1m": os.getloadavg()[0],  # other work on the host skews every figure
        },
        "workload": {"requests": args.requests, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens},
        "results": results,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tp_bench.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"{'ranks x threads':>16} {'tok/s':>8} {'step ms':>8} {'collective ms':>14} {'rest ms':>8}")
    for r in results:
        label = f"{r['tensor_parallel_size']} x {r['torch_threads_per_rank']}"
        print(
            f"{label:>16} {r['output_tok_s']:8.1f} {r['mean_step_ms']:8.2f} "
            f"{r['mean_collective_ms']:14.2f} {r['mean_compute_ms']:8.2f}"
        )
    print(f"wrote {out / 'tp_bench.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
