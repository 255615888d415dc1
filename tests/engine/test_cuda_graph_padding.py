"""The CUDA-graph decode path's bucketing and padding, run eagerly on the CPU.

No GPU here, so nothing is captured; what is checked is everything around the capture: a decode
step padded to its bucket gives the same tokens as the unpadded step, and padding rows write
nothing into the KV cache.
"""

from __future__ import annotations

from pathlib import Path

import torch

from engine import LLM, SamplingParams
from engine.runner.cuda_graph import GraphedDecode, graph_buckets


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(8) == [1, 2, 4, 8]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(100) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100]


def test_padded_decode_matches_eager(tiny_llama_path: Path) -> None:
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5 + i] * (3 + 5 * i) for i in range(5)]  # 5 requests: padded to the bucket of 8
    eager = LLM(str(tiny_llama_path), max_num_seqs=8, block_size=8)
    expected = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]

    padded = LLM(str(tiny_llama_path), max_num_seqs=8, block_size=8)
    runner = padded.engine.runner
    runner.graphs = GraphedDecode(
        runner.model, runner.kv_caches, 8, runner.max_blocks_per_req, 512, torch.device("cpu"), capture=False
    )
    calls: list[int] = []
    real_run = runner.graphs.run

    def counting_run(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(args[2].num_seqs)
        return real_run(*args, **kwargs)

    runner.graphs.run = counting_run  # type: ignore[method-assign]
    got = [o.outputs[0].token_ids for o in padded.generate(prompts, params)]
    assert got == expected
    assert calls and 5 in calls, "decode steps should have taken the padded path"
    padded.engine.kv.check_integrity()
