"""``python -m bench memory``: the W8A16 copy it makes of a float checkpoint loads as int8 and decodes as
the float model does (greedy, on the tiny checkpoint), and the fit table follows the planner's
arithmetic (an 8B model needs more than 24 GB in float32, fits as bf16 and 4-bit; 70B fits in none)."""

from __future__ import annotations

from pathlib import Path

from bench.memory import fit, write_w8a16_copy
from engine import LLM, SamplingParams
from engine.quant.channel import ChannelWeight


def test_w8a16_copy_serves_int8(tiny_model: Path, tmp_path: Path) -> None:
    copy = write_w8a16_copy(tiny_model, tmp_path / "w8")
    assert write_w8a16_copy(tiny_model, tmp_path / "w8") == copy, "a second call keeps the copy"
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [[5, 9, 13, 2, 7], [40, 41]]
    runs = {}
    for name, path in (("float", tiny_model), ("int8", copy)):
        llm = LLM(str(path), dtype="float32", max_num_seqs=2)
        weight = llm.engine.runner.model.layers[0].qkv_proj.weight
        assert isinstance(weight, ChannelWeight) == (name == "int8")
        runs[name] = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    # The tiny checkpoint's logits are far apart: int8 rounding moves none of its greedy choices.
    assert runs["int8"] == runs["float"]


def test_fit_follows_the_planner() -> None:
    rows = {(r["model"], r["format"]): r for r in fit(24.0, 8192, 2)}
    assert not rows["llama-3-8b", "float32"]["fits"]
    assert rows["llama-3-8b", "bfloat16"]["fits"] and rows["llama-3-8b", "Q4_K"]["fits"]
    assert not any(r["fits"] for (model, _), r in rows.items() if model == "llama-3-70b")
    q4 = rows["llama-3-8b", "Q4_K"]["weights_gb"]
    assert abs(q4 - rows["llama-3-8b", "float32"]["weights_gb"] * 4.5 / 32) < 0.01
    w8, bf16 = rows["llama-3-8b", "W8A16 or fp8"]["weights_gb"], rows["llama-3-8b", "bfloat16"]["weights_gb"]
    assert bf16 / 2 < w8 < bf16, "int8 linears, the bf16 embedding and LM head kept"
