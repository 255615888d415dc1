"""Tensor parallelism on GPUs: two NCCL ranks against one, greedy tokens, CUDA graphs on.

    python -m bench.gpu_tp_check --out bench-results

With fewer than two GPUs it writes ``{"skipped": ...}`` to tp_check.json and exits 0 (one GPU cannot
hold two NCCL ranks). Otherwise a small random-weight Llama in float32 (dummy weights: the same on
every rank) generates greedily with ``tensor_parallel_size=1`` and ``=2``, CUDA graphs on (the
all-reduces are captured inside the decode graphs), chunked prefill under a small budget; the
check passes when the token streams are identical, and it reports how many differ otherwise (an
all-reduce sums in another order than one GPU's matmul).
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from bench.gpu_graph_check import SMALL_LLAMA
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams


def generate(model: str, tp: int, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    engine = LLMEngine.from_engine_args(
        model,
        dtype="float32",
        load_format="dummy",
        tensor_parallel_size=tp,
        max_model_len=1024,
        max_num_batched_tokens=256,
        max_num_seqs=16,
    )
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    start = time.perf_counter()
    for _ in range(2000):  # a step cap: a step that makes no progress fails instead of hanging
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            got[out.request_id].extend(out.outputs[0].token_ids if out.outputs else [])
    seconds = time.perf_counter() - start
    engine.runner.close()
    return [got[f"r{i}"] for i in range(len(prompts))], seconds


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_tp_check")
    p.add_argument("--out", default="bench-results")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    gpus = torch.cuda.device_count()
    if gpus < 2:
        report: dict[str, object] = {"skipped": f"{gpus} GPU(s) visible; tensor parallelism needs 2"}
        (out / "tp_check.json").write_text(json.dumps(report, indent=2) + "\n")
        print(report["skipped"])
        return 0
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 32000) for _ in range(rng.randint(8, 400))] for _ in range(12)]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(SMALL_LLAMA))
        one, one_s = generate(tmp, 1, prompts)
        two, two_s = generate(tmp, 2, prompts)
    differing = sum(a != b for a, b in zip(one, two, strict=True))
    report = {
        "gpus": gpus,
        "sequences": len(prompts),
        "differing_sequences": differing,
        "greedy_identical": differing == 0,
        "seconds_tp1": one_s,
        "seconds_tp2": two_s,
    }
    (out / "tp_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))
    return 0 if differing == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
