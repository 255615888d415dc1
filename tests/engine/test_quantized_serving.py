"""A GGUF served in its own block formats (``quantization="auto"``/``"gguf"``): the linear layers hold
the file's blocks (engine/quant) and decode the same greedy tokens as the file's float copy
(``quantization="none"``): both compute with the same dequantised values, in a different order."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.quant.weight import QuantizedWeight
from tests.engine.gguf_files import write_gguf
from tests.engine.hf_checkpoints import write_hf_checkpoint


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0"])
def test_block_formats_decode_as_their_float_copy(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "home"))
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=4)
    path = write_gguf(checkpoint, tmp_path / "tiny.gguf", "llama", quantize=kind)
    rng = random.Random(3)
    # Short prompts (rows multiplied as stored) and a long one (a prefill past the kernel's row bound).
    batch = [[rng.randrange(3, 500) for _ in range(n)] for n in (3, 9, 70)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    runs = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), dtype="float32", quantization=quantization, max_num_seqs=4)
        runs[quantization] = [o.outputs[0].token_ids for o in llm.generate(batch, greedy)]
        layer = llm.engine.runner.model.layers[0]
        assert isinstance(layer.qkv_proj.weight, QuantizedWeight) == (quantization == "auto")
        if quantization == "auto":
            assert layer.qkv_proj.weight.format == kind
    assert runs["auto"] == runs["none"]


def test_gguf_quantization_needs_a_gguf_file(tmp_path: Path) -> None:
    checkpoint = write_hf_checkpoint(tmp_path / "hf", "llama3", seed=1)
    with pytest.raises(ValueError, match=r"needs a \.gguf checkpoint"):
        LLM(str(checkpoint), quantization="gguf")
    with pytest.raises(ValueError, match="unsupported quantization 'fp8'"):
        LLM(str(checkpoint), quantization="fp8")
