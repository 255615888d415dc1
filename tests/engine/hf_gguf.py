"""HF transformers reading a GGUF file: the tests' independent reference for the engine's own reader.

transformers parses a file's metadata again for each thing it loads (the config, the weights, the
tokenizer: the shipped model's 49,152-token vocabulary and merges each time) and rebuilds gguf-py's
tensor-name table once per submodule of the model (397 times for SmolLM2). Here both are done once per
load: the values transformers computes are unchanged, a 135M model loads in about a third of the time.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


@contextmanager
def _read_once() -> Iterator[None]:
    """gguf-py's reader kept per path and its name table per (architecture, layers), while inside."""
    import gguf

    real_reader, real_name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    readers: dict[tuple[str, str], Any] = {}

    def reader(path: str | Path, mode: str = "r") -> Any:
        key = (str(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)  # type: ignore[arg-type]
        return readers[key]

    # transformers imports both names from ``gguf`` where it uses them, so the module's attributes are
    # what it calls.
    gguf.GGUFReader = reader  # type: ignore[assignment,misc]
    gguf.get_tensor_name_map = functools.cache(real_name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map  # type: ignore[misc]


def hf_model(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    """transformers' causal LM from the GGUF file at ``path``, in eval mode."""
    from transformers import AutoModelForCausalLM

    with _read_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
    return model.eval()


def hf_model_and_tokenizer(path: Path, dtype: torch.dtype = torch.float32) -> tuple[Any, Any]:
    """The model and transformers' tokenizer of the same file, its metadata read once for both."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _read_once():
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tokenizer
