"""GGUF files of the families whose GGUFs are common (llama, qwen2, qwen3, gemma2, gemma3), written in
llama.cpp's conventions from tiny HF checkpoints: the engine converts each and decodes token for token
as HF transformers does when it reads the same file itself."""

from __future__ import annotations

import functools
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from tests.engine.gguf_files import write_gguf
from tests.engine.hf_checkpoints import WINDOW, write_hf_checkpoint
from tests.engine.hf_reference import hf_greedy

CASES = {"llama": "llama3", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3"}
MAX_NEW = 8


@functools.cache
def _hf(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    p = Path(path)
    model = AutoModelForCausalLM.from_pretrained(
        str(p.parent), gguf_file=p.name, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _hf_greedy(path: Path, prompt: list[int]) -> list[int]:
    model = _hf(str(path))
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, min_new_tokens=MAX_NEW
        )
    return [int(t) for t in out[0, len(prompt) :]]


@pytest.mark.parametrize("arch", sorted(CASES))
def test_gguf_family_matches_hf_on_the_same_file(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path / "home"))  # the converted copy goes there
    overrides = {"tie_word_embeddings": True} if arch == "llama" else {}
    if arch == "gemma2":
        overrides["layer_types"] = ["sliding_attention", "full_attention"] * 2  # llama.cpp's order
    if arch == "gemma3":
        overrides["layer_types"] = ["sliding_attention"] * 4  # llama.cpp: every sixth layer global
    checkpoint = write_hf_checkpoint(tmp_path / "hf", CASES[arch], seed=11, **overrides)
    path = write_gguf(checkpoint, tmp_path / f"tiny-{arch}.gguf", arch)
    rng = random.Random(5)
    batch = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, WINDOW + 7)]
    llm = LLM(str(path), dtype="float32", max_num_batched_tokens=16, max_num_seqs=2)
    got = [
        o.outputs[0].token_ids
        for o in llm.generate(batch, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True))
    ]
    if arch == "qwen3":
        # HF's GGUF reader leaves Qwen3's head_dim at its config default (128), whatever the file's
        # key_length says: compare with the checkpoint the file was written from instead.
        assert got == [hf_greedy(checkpoint, prompt, MAX_NEW) for prompt in batch]
    else:
        assert got == [_hf_greedy(path, prompt) for prompt in batch]
