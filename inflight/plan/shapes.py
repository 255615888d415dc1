"""The shapes a roofline preset is computed from: GPUs by their datasheet peaks, and Llama-family
decoders by the fields of their HF config.json (named ones, or read from a checkpoint). Pure data and
arithmetic on it; inflight/plan/presets.py turns a pair of them into step times.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GB = 1e9
GIB = 1 << 30


class PresetError(ValueError):
    """A preset that cannot exist: the weights do not fit, an unknown GPU or model, bad settings."""


@dataclass(frozen=True)
class Gpu:
    name: str
    description: str
    hbm_bytes: float
    hbm_bytes_per_s: float
    bf16_flops: float  # dense (no 2:4 sparsity), tensor cores
    # One direction of the GPU-to-GPU link (tensor parallelism's all-reduces): half the datasheet's
    # bidirectional NVLink figure; PCIe Gen4 x16 for a card without NVLink.
    link_bytes_per_s: float = 0.0


# Vendor datasheet peaks (NVIDIA H200, H100 SXM, A100 80GB SXM and L4 datasheets): marketing peaks,
# which no kernel reaches; mbu and mfu below say how much of them a step is assumed to get.
GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("h200", "NVIDIA H200 SXM, 141 GB HBM3e", 141 * GB, 4.8e12, 989e12, 450e9),
        Gpu("h100", "NVIDIA H100 SXM, 80 GB HBM3", 80 * GB, 3.35e12, 989e12, 450e9),
        Gpu("a100-80gb", "NVIDIA A100 SXM 80GB, HBM2e", 80 * GB, 2.0e12, 312e12, 300e9),
        Gpu("l4", "NVIDIA L4, 24 GB GDDR6", 24 * GB, 300e9, 121e12, 32e9),
    )
}


@dataclass(frozen=True)
class ModelShape:
    """What a Llama-family decoder's cost depends on (the fields of its HF config.json)."""

    name: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q, k and v
    bytes_per_param: int = 2  # bf16 weights, and the KV cache at kv_cache_dtype "auto"
    # The engine's kv_cache_dtype: auto (bytes_per_param a value), or int8 / fp8_e4m3 (one byte a value
    # plus a float32 scale per token and KV head: engine/kernels/kv_quant.py).
    kv_cache_dtype: str = "auto"

    @property
    def layer_params(self) -> int:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attention = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * self.intermediate_size  # gate, up, down
        return attention + mlp + 2 * h  # two RMSNorm weights

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size  # the embedding table itself when tied

    @property
    def params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return self.num_layers * self.layer_params + self.embedding_params + head + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Bytes the weights hold in memory."""
        return self.params * self.bytes_per_param

    @property
    def streamed_weight_bytes(self) -> int:
        """Bytes a step reads: every weight but an untied embedding table (gathered by row)."""
        streamed = self.num_layers * self.layer_params + self.lm_head_params + self.hidden_size
        return streamed * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers, in the cache's format."""
        if self.kv_cache_dtype == "auto":
            row = self.head_dim * self.bytes_per_param
        elif self.kv_cache_dtype in ("int8", "fp8_e4m3"):
            row = self.head_dim + 4  # codes, then the row's float32 scale
        else:
            raise PresetError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; use auto, int8 or fp8_e4m3")
        return 2 * self.num_layers * self.num_kv_heads * row

    @property
    def attention_flops_per_pair(self) -> int:
        """FLOPs per (query token, key token) pair over all layers: Q.K^T and P.V, 2 each per MAC."""
        return 4 * self.num_layers * self.num_heads * self.head_dim

    def describe(self) -> str:
        return (
            f"{self.name}: {self.params / 1e9:.2f}B params, {self.num_layers} layers, hidden "
            f"{self.hidden_size}, {self.num_heads} heads / {self.num_kv_heads} KV, "
            f"KV {self.kv_bytes_per_token // 1024} KiB a token"
        )


MODELS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape("llama-3-8b", 4096, 14336, 32, 32, 8, 128, 128256),
        ModelShape("llama-3-70b", 8192, 28672, 80, 64, 8, 128, 128256),
        ModelShape("llama-3.2-1b", 2048, 8192, 16, 32, 8, 64, 128256, tie_word_embeddings=True),
        ModelShape("mistral-7b-v0.3", 4096, 14336, 32, 32, 8, 128, 32768),
        ModelShape("qwen2.5-7b", 3584, 18944, 28, 28, 4, 128, 152064, attention_bias=True),
    )
}


def shape_from_config(raw: dict[str, Any], name: str) -> ModelShape:
    """A model's shape from its HF config.json (Llama, Mistral, Qwen2 and the like)."""
    try:
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        return ModelShape(
            name=name,
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(raw["vocab_size"]),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias="Qwen2ForCausalLM" in (raw.get("architectures") or [])
            or bool(raw.get("attention_bias", False)),
        )
    except KeyError as missing:
        raise PresetError(f"{name}: config.json has no {missing.args[0]!r}") from None


def model_shape(model: str) -> ModelShape:
    """A named shape (``MODELS``) or a checkpoint directory (or its config.json)."""
    if model in MODELS:
        return MODELS[model]
    path = Path(model)
    config = path / "config.json" if path.is_dir() else path
    if not config.is_file():
        raise PresetError(
            f"unknown model {model!r}: not one of {', '.join(MODELS)} nor a checkpoint with a config.json"
        )
    return shape_from_config(json.loads(config.read_text()), model)


def gpu_spec(gpu: str) -> Gpu:
    if gpu.lower() not in GPUS:
        raise PresetError(f"unknown GPU {gpu!r}; presets exist for {', '.join(GPUS)}")
    return GPUS[gpu.lower()]
