"""A GGUF served in its own block formats (``quantization="auto"``/``"gguf"``): the linear layers hold
the file's blocks (engine/quant) and decode the same greedy tokens as the file's float copy
(``quantization="none"``): both compute with the same dequantised values, in a different order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import onednn
from engine.models.decoder import DenseMLP
from engine.quant.stacked import StackedWeight
from engine.quant.weight import QuantizedWeight
from tests.engine.gguf_files import write_gguf
from tests.engine.hf_checkpoints import write_hf_checkpoint

Formats = dict[str, str | None]  # linear -> its weight's block format ("Q5_0+Q5_0+Q8_0": parts), None: dense


def _format(weight: object) -> str | None:
    if isinstance(weight, StackedWeight):
        return "+".join(str(_format(part)) for part in weight.parts)
    return weight.format if isinstance(weight, QuantizedWeight) else None


def _greedy_runs(path: Path) -> tuple[dict[str, list[list[int]]], dict[str, Formats]]:
    """Greedy tokens of the file served in its blocks (``auto``) and as its float copy (``none``), and
    the formats layer 0's linears held in each."""
    rng = random.Random(3)
    # Short prompts (rows multiplied as stored) and a long one (a prefill past the kernel's row bound).
    batch = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 70)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs, served = {}, {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, max_num_seqs=4)
        runs[quantization] = [list(o.outputs[0].token_ids) for o in llm.generate(batch, greedy)]
        layer = llm.engine.runner.model.layers[0]
        assert isinstance(layer.mlp, DenseMLP)
        served[quantization] = {
            name: _format(weight)
            for name, weight in (
                ("qkv", layer.qkv_proj.weight),
                ("o", layer.o_proj.weight),
                ("gate_up", layer.mlp.gate_up_proj.weight),
                ("down", layer.mlp.down_proj.weight),
            )
        }
    return runs, served


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q5_0", "Q5_1"])
def test_block_formats_decode_as_their_float_copy(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "home"))
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=4)
    path = write_gguf(checkpoint, tmp_path / "tiny.gguf", "llama", quantize=kind)
    runs, served = _greedy_runs(path)
    assert set(served["auto"].values()) == {kind}
    assert set(served["none"].values()) == {None}
    assert runs["auto"] == runs["none"]


def test_a_mix_of_formats_in_one_fused_weight_serves_each_part_as_stored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """llama.cpp's Q4_K_M of a model whose hidden size is not whole 256s (SmolLM2-135M: 576) keeps
    q and k in Q5_0 and v in Q8_0 in some layers: the fused qkv cannot be one format's rows, so it is
    held as its parts, each multiplied in its own format (engine/quant/stacked.py)."""
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "home"))
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=5)
    kinds = {"attn_v": "Q8_0", "ffn_down": "Q5_1"}
    path = write_gguf(checkpoint, tmp_path / "tiny.gguf", "llama", quantize="Q5_0", quantize_kinds=kinds)
    runs, served = _greedy_runs(path)
    assert served["auto"] == {"qkv": "Q5_0+Q5_0+Q8_0", "o": "Q5_0", "gate_up": "Q5_0", "down": "Q5_1"}
    assert runs["auto"] == runs["none"]


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path) -> None:
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=1)
    with pytest.raises(ValueError, match=r"needs a \.gguf checkpoint"):
        LLM(str(checkpoint), quantization="gguf")
    with pytest.raises(ValueError, match="unsupported quantization 'int4'"):
        LLM(str(checkpoint), quantization="int4")


@pytest.mark.skipif(not onednn.can_prepack(torch.float32), reason="torch without oneDNN's packed float32")
def test_a_model_kept_quantized_pads_no_rows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """oneDNN's row padding (engine/models/row_padding.py) rounds a step's rows up to its tiles; the
    quantized kernels pay for every padded row, so a model kept in its blocks is not padded, where
    its float copy on the same kernels is."""
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("INFLIGHT_CPU_GEMM", "onednn")
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=6)
    path = write_gguf(checkpoint, tmp_path / "tiny.gguf", "llama", quantize="Q8_0")
    padding = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, max_num_seqs=4)
        padding[quantization] = llm.engine.runner.model.kernels.row_padding
    assert padding["auto"] is None
    assert padding["none"] is not None and padding["none"].padded(17) > 17
