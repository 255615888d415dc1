"""A GGUF file's tensors by HF name, the linear weights left in their block formats.

The names and the q/k row order are engine/models/gguf.py's (the conversion to float32 reads the same
tensors): llama.cpp stores each head's q/k rows permuted for its interleaved rotary, and since a row's
blocks hold exactly that row's values, the same permutation applied to rows of blocks restores HF's
order without touching a byte inside a row.

What comes back, per tensor:
  * a linear weight (``*_proj.weight``, ``lm_head.weight``) in Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K,
    Q5_K or Q6_K: a :class:`QuantizedWeight` of the file's bytes, rows in HF order;
  * the token embedding: a ``QuantizedWeight`` too where its format is one of those (a lookup
    dequantizes the rows it reads: :func:`embedding_rows`), unless ``dequantize_embeddings``;
  * everything else (norms, biases, float or other-format tensors): a float32 tensor.
A checkpoint with tied embeddings (no ``output.weight``) gets ``lm_head.weight`` as the embedding's
quantized rows, the same object, so the LM head multiplies the file's bytes too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.models.gguf import hf_name, stored_permuted, stores_norm_plus_one, unpermute_rows
from engine.quant.formats import FORMATS, dequantize_rows
from engine.quant.weight import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight

_EMBEDDING = "model.embed_tokens.weight"
_LM_HEAD = "lm_head.weight"


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _head_counts(reader: Any) -> tuple[int, int]:
    arch = _field(reader, "general.architecture")
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    return heads, int(_field(reader, f"{arch}.attention.head_count_kv", heads))


def _rows_in_hf_order(name: str, array: np.ndarray, heads: int, kv_heads: int, permuted: bool) -> np.ndarray:
    if permuted and name.endswith("q_proj.weight"):
        array = unpermute_rows(array, heads)
    elif permuted and name.endswith("k_proj.weight"):
        array = unpermute_rows(array, kv_heads)
    return np.ascontiguousarray(array)


def read_gguf_weights(path: str | Path, dequantize_embeddings: bool = False) -> dict[str, Weight]:
    """Every tensor of the GGUF at ``path`` that the engine reads, by HF name (see the module's notes).

    Copies the bytes into memory (the file is mmapped while reading and closed after)."""
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    heads, kv_heads = _head_counts(reader)
    arch = str(_field(reader, "general.architecture"))
    permuted, plus_one = stored_permuted(arch), stores_norm_plus_one(arch)
    weights: dict[str, Weight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        if name is None:
            continue  # e.g. rope_freqs, recomputed by the engine
        # ggml shapes are fastest-dimension first; torch's slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        kind = tensor.tensor_type.name
        linear = name.endswith("_proj.weight") or name == _LM_HEAD
        embedding = name == _EMBEDDING and not dequantize_embeddings
        if len(shape) == 2 and kind in FORMATS and (linear or embedding):
            rows = np.asarray(tensor.data).reshape(shape[0], -1)
            rows = _rows_in_hf_order(name, rows, heads, kv_heads, permuted)
            weights[name] = QuantizedWeight(kind, shape[0], shape[1], torch.from_numpy(rows.copy()))
        else:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
            if len(shape) == 2:
                values = _rows_in_hf_order(name, values, heads, kv_heads, permuted)
            elif plus_one and name.endswith("norm.weight"):
                values = values - 1.0
            weights[name] = torch.from_numpy(values.copy())
    embedding_weight = weights.get(_EMBEDDING)
    if _LM_HEAD not in weights and isinstance(embedding_weight, QuantizedWeight):
        weights[_LM_HEAD] = embedding_weight
    return weights


def embedding_rows(weight: QuantizedWeight, token_ids: torch.Tensor) -> torch.Tensor:
    """The embeddings of ``token_ids`` [T]: [T, hidden] float32, dequantizing only those rows."""
    return dequantize_rows(weight.fmt, weight.blocks[token_ids.long()], weight.in_features)
