"""Perplexity of a GGUF Llama on a text, its linear layers multiplied in their block formats.

A plain full-sequence forward (no KV cache, no batching: the serving engine is not involved), written to
compare formats on the same text and the same tokens: each linear goes through ``quant_linear`` when
the weight is a :class:`QuantizedWeight` and ``F.linear`` when it is a float tensor, so the same file
read with ``dequantize_embeddings`` and every weight dequantized gives the float32 reference.
Perplexity = exp(mean over positions 1..T-1 of -log p(token | the tokens before it)).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.quant.channel import ChannelWeight, channel_linear
from engine.quant.gguf_weights import Weight, embedding_rows, read_gguf_weights
from engine.quant.linear import quant_linear
from engine.quant.weight import QuantizedWeight

# (layer index, q [T, Hq, D] rotated, k [T, Hkv, D] rotated, v [T, Hkv, D]) -> [T, Hq, D]: causal
# attention of the T positions; None: SDPA on the tensors as they are (no KV cache).
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LlamaShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float

    @staticmethod
    def from_gguf(reader: Any) -> LlamaShape:
        def get(key: str, default: Any = None) -> Any:
            field = reader.fields.get(f"llama.{key}")
            return default if field is None else field.contents()

        heads = int(get("attention.head_count"))
        hidden = int(get("embedding_length"))
        return LlamaShape(
            num_layers=int(get("block_count")),
            num_heads=heads,
            num_kv_heads=int(get("attention.head_count_kv", heads)),
            head_dim=int(get("attention.key_length", hidden // heads)),
            rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
            rope_theta=float(get("rope.freq_base", 10000.0)),
        )


def _linear(x: torch.Tensor, w: Weight | ChannelWeight) -> torch.Tensor:
    if isinstance(w, ChannelWeight):
        return channel_linear(x, w)
    return quant_linear(x, w) if isinstance(w, QuantizedWeight) else F.linear(x, w)


def _rms_norm(x: torch.Tensor, weight: Weight, eps: float) -> torch.Tensor:
    assert isinstance(weight, torch.Tensor)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half rotary on [T, H, D] (the GGUF reader restored that row order)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


@torch.inference_mode()
def llama_logits(
    weights: dict[str, Any], shape: LlamaShape, token_ids: torch.Tensor, attend: Attend | None = None
) -> torch.Tensor:
    """[T, vocab] float32 logits of a causal Llama over ``token_ids`` [T]; ``attend`` replaces the
    attention (bench/kv_dtype.py passes the engine's backends over a paged cache)."""
    embed = weights["model.embed_tokens.weight"]
    x = embedding_rows(embed, token_ids) if isinstance(embed, QuantizedWeight) else embed[token_ids]
    num_tokens, d = token_ids.shape[0], shape.head_dim
    inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = torch.arange(num_tokens, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    for i in range(shape.num_layers):
        layer = f"model.layers.{i}."
        h = _rms_norm(x, weights[layer + "input_layernorm.weight"], shape.rms_norm_eps)
        q = _linear(h, weights[layer + "self_attn.q_proj.weight"]).view(num_tokens, shape.num_heads, d)
        k = _linear(h, weights[layer + "self_attn.k_proj.weight"]).view(num_tokens, shape.num_kv_heads, d)
        v = _linear(h, weights[layer + "self_attn.v_proj.weight"]).view(num_tokens, shape.num_kv_heads, d)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if attend is not None:
            attn = attend(i, q, k, v)  # [T, H, D]
        else:
            group = shape.num_heads // shape.num_kv_heads
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
            # [H, T, D] each; causal: position t sees 0..t.
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
            ).transpose(0, 1)
        x = x + _linear(attn.reshape(num_tokens, -1), weights[layer + "self_attn.o_proj.weight"])
        h = _rms_norm(x, weights[layer + "post_attention_layernorm.weight"], shape.rms_norm_eps)
        gate = _linear(h, weights[layer + "mlp.gate_proj.weight"])
        up = _linear(h, weights[layer + "mlp.up_proj.weight"])
        x = x + _linear(F.silu(gate) * up, weights[layer + "mlp.down_proj.weight"])
    x = _rms_norm(x, weights["model.norm.weight"], shape.rms_norm_eps)
    return _linear(x, weights.get("lm_head.weight", embed))


def perplexity_of_ids(weights: dict[str, Any], shape: LlamaShape, token_ids: torch.Tensor) -> float:
    logits = llama_logits(weights, shape, token_ids)
    nll = F.cross_entropy(logits[:-1].float(), token_ids[1:].long())
    return math.exp(float(nll))


def gguf_perplexity(path: str | Path, text: str, dequantize: bool = False) -> tuple[float, int]:
    """(perplexity, number of tokens) of the GGUF at ``path`` on ``text``, tokenized by the file's own
    tokenizer; ``dequantize``: every weight as float32 (the reference the formats compare with)."""
    from gguf import GGUFReader

    reader = GGUFReader(str(path))
    token_ids = torch.tensor(gguf_token_ids(reader, text), dtype=torch.long)
    weights = read_gguf_weights(path, dequantize_embeddings=dequantize)
    if dequantize:
        weights = {n: w.dequantize() if isinstance(w, QuantizedWeight) else w for n, w in weights.items()}
    return perplexity_of_ids(weights, LlamaShape.from_gguf(reader), token_ids), int(token_ids.shape[0])


def gguf_token_ids(reader: Any, text: str) -> list[int]:
    """``text`` tokenized by the tokenizer in a GGUF's metadata (``reader``: a ``gguf.GGUFReader``): the
    tokens a peer's perplexity on the same file is computed over too."""
    from engine.models.gguf import build_tokenizer

    meta = {name: f.contents() for name, f in reader.fields.items() if name.startswith("tokenizer.ggml")}
    return list(build_tokenizer(meta).encode(text).ids)
