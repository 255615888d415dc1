"""Persistent input buffers (engine/runner/staging.py). On CUDA they are pinned; here the same
buffers and logic run in pageable memory: values, dtypes and shapes across steps of different sizes,
and a whole generation through them equal to one without."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from engine import LLM, SamplingParams
from engine.runner.staging import InputStaging


def test_stage_across_steps_of_different_sizes() -> None:
    staging = InputStaging(
        {"ids": (16, torch.int64), "table": (12, torch.int32)}, torch.device("cpu"), pin=False
    )
    for step, (n, rows, cols) in enumerate([(16, 3, 4), (5, 2, 2), (0, 1, 1), (9, 4, 3)]):
        ids = np.arange(n, dtype=np.int64) * (step + 1)
        table = np.arange(rows * cols, dtype=np.int64).reshape(rows, cols) + step  # int64 in, int32 out
        staging.begin()
        got_ids, got_table = staging.stage("ids", ids), staging.stage("table", table)
        staging.end()
        assert got_ids.dtype == torch.int64 and got_ids.tolist() == ids.tolist()
        assert got_table.dtype == torch.int32 and got_table.shape == (rows, cols)
        assert got_table.tolist() == table.tolist()
    assert staging.fits("ids", 16) and not staging.fits("ids", 17)


def test_generation_through_staging_matches(tiny_llama_path: Path) -> None:
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=8, seed=7, ignore_eos=True)
    prompts = [[5 + i] * (2 + 9 * i) for i in range(4)]  # prefill chunks and decodes mixed
    plain = LLM(str(tiny_llama_path), max_num_seqs=4, block_size=8, max_num_batched_tokens=16)
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    staged = LLM(str(tiny_llama_path), max_num_seqs=4, block_size=8, max_num_batched_tokens=16)
    runner = staged.engine.runner
    runner.staging = runner._make_staging(pin=False)
    assert [o.outputs[0].token_ids for o in staged.generate(prompts, params)] == expected
    assert runner.staging is not None and int(runner.staging.dev["query_start_loc"][1]) > 0  # it was used
