"""Greedy continuations from HF transformers, the reference the engine must match token for token."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch


@lru_cache(maxsize=4)
def _load(path: str):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    # Eager attention: the plain reference (soft-capping and sliding windows included).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    return model


def hf_greedy(path: str | Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """Greedy decoding with HF's own KV cache and no stop condition (the engine runs ignore_eos)."""
    model = _load(str(path))
    out: list[int] = []
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        result = model(input_ids=ids, use_cache=True)
        for _ in range(max_new_tokens):
            token = int(result.logits[0, -1].argmax())
            out.append(token)
            result = model(
                input_ids=torch.tensor([[token]]), past_key_values=result.past_key_values, use_cache=True
            )
    return out


def hf_prompt_logprobs(path: str | Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: row i is the log-softmax that scores prompt token i + 1 (one full forward)."""
    model = _load(str(path))
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)
