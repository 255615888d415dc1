"""A bf16 model served with its decode steps' linear layers on AMX tiles over oneDNN's packed weights
(engine/models/amx_gemm.py): every dense weight proven and shared, decode rows on the tiles, prefill
rows on oneDNN, and the greedy tokens of oneDNN alone. Skipped where the CPU has no AMX."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu as cpu_kernels
from engine.models import amx_gemm, onednn
from tests.kernels.test_amx_gemm import count_tile_calls

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and amx_gemm.supported() and onednn.can_prepack(torch.bfloat16)),
    reason="this CPU has no AMX bf16 tiles (or the C++ kernels or oneDNN's packing are missing)",
)


def _greedy(path: Path) -> tuple[LLM, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # 4 sequences (a 16-row decode step once padded), one prompt longer than the 64-row bound.
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 180)), [7] * 21]
    llm = LLM(str(path), dtype="bfloat16", block_size=8, max_num_seqs=8, max_num_batched_tokens=128)
    tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # A prefill on oneDNN after decode steps on the tiles, in the same threads: each sets up its own.
    tokens += [o.outputs[0].token_ids for o in llm.generate([list(range(200, 300))], params)]
    return llm, tokens


def test_decode_rows_on_the_tiles_prefill_on_onednn(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = count_tile_calls(monkeypatch)
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "auto")
    llm, tokens = _greedy(tiny_llama_path)
    model = llm.engine.runner.model
    assert model.kernels.gemm == "onednn" and model.kernels.amx_rows == amx_gemm.MAX_ROWS
    assert model.kernels.label == f"onednn (AMX tiles up to {amx_gemm.MAX_ROWS} rows)"  # the start-up line's
    weights = [w for w, _ in model.linear_weights()]
    assert weights and all(isinstance(w, torch.Tensor) and amx_gemm.panels_of(w) is not None for w in weights)
    assert rows and all(r % 16 == 0 and r <= amx_gemm.MAX_ROWS for r in rows)
    llm.engine.kv.check_integrity()

    rows.clear()
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "onednn")  # a named path: oneDNN at every size
    other, expected = _greedy(tiny_llama_path)
    kernels = other.engine.runner.model.kernels
    assert kernels.amx_rows == 0 and kernels.label == "onednn" and rows == []
    assert tokens == expected
