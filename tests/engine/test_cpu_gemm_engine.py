"""A model served on the CPU engine's own packed linear kernels (engine/models/cpu_gemm.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu as cpu_kernels
from engine.models import cpu_gemm, onednn

pytestmark = pytest.mark.skipif(
    not (cpu_kernels.load() and cpu_gemm.supported(torch.float32)),
    reason="the C++ CPU kernels cannot be built here, or this CPU lacks AVX-512",
)

_ARGS: dict[str, Any] = dict(
    block_size=8, max_num_seqs=8, max_num_batched_tokens=64, enable_prefix_caching=False
)


def _greedy(path: Path, dtype: str) -> tuple[LLM, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42], list(range(100, 160)), [7] * 21]
    llm = LLM(str(path), dtype=dtype, **_ARGS)
    return llm, [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def test_a_model_served_on_its_own_kernels(tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """float32: the weights in column panels, no row padding, and the same greedy tokens as oneDNN's
    packed weights and torch's matmul (a chunked prefill beside decodes, batches of 1-4 rows)."""
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "inflight")
    own, tokens = _greedy(tiny_llama_path, "float32")
    model = own.engine.runner.model
    assert model.kernels.gemm == "inflight" and model.kernels.row_padding is None
    assert all(
        w is not None and w.dim() == 3
        for w in (model.layers[0].qkv_proj.weight, model.layers[0].mlp.down_proj.weight)
    )
    assert model.lm_head.weight.dim() == 3
    own.engine.kv.check_integrity()
    for other in ("onednn", "torch"):
        monkeypatch.setenv("INFLIGHT_CPU_GEMM", other)
        llm, expected = _greedy(tiny_llama_path, "float32")
        assert llm.engine.runner.model.kernels.gemm in (other, "torch")
        assert tokens == expected, other


def test_weights_the_kernels_cannot_take_stay_with_onednn(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight the panels cannot hold (here: every square one, as if its out features were not a
    multiple of 16) is packed by oneDNN, or kept plain where oneDNN cannot pack, beside panels for
    the rest; the greedy tokens stay those of the all-panel model."""
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "inflight")
    _, expected = _greedy(tiny_llama_path, "float32")
    packable = cpu_gemm.packable
    monkeypatch.setattr(cpu_gemm, "packable", lambda w: packable(w) and w.shape[0] != w.shape[1])
    mixed, tokens = _greedy(tiny_llama_path, "float32")
    layer = mixed.engine.runner.model.layers[0]
    assert layer.o_proj.weight.dim() == 2  # square: oneDNN's (or torch's)
    assert layer.qkv_proj.weight.dim() == 3
    assert (mixed.engine.runner.model.kernels.prepack_rows > 0) == onednn.can_prepack(torch.float32)
    assert tokens == expected
