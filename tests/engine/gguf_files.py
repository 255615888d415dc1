"""GGUF files of tiny HF checkpoints, written in llama.cpp's conventions (its convert_hf_to_gguf.py):
``general.architecture`` and ``<arch>.*`` metadata, ``blk.N.*`` tensor names, Llama's q/k rows
permuted for the interleaved rotary, Gemma's norms stored as 1 + w; float32 tensors and a byte-level
BPE vocabulary of one token per id (no merges). HF transformers reads these files independently
(``from_pretrained(..., gguf_file=...)``), which is what the engine's conversion is checked against."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file

_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_PRE_NORM = {"post_attention_layernorm": "ffn_norm"}
_SANDWICH = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    # HF rotate-half rows -> llama.cpp's interleaved pairs (the inverse of engine/models/gguf.py's).
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(
    checkpoint: Path,
    out: Path,
    arch: str,
    quantize: str | None = None,
    quantize_kinds: Mapping[str, str] | None = None,
) -> Path:
    """``quantize``: a GGUF type name (Q8_0, Q4_0, ...) the 2-D projection weights are stored in.
    ``quantize_kinds``: a type per llama.cpp tensor kind (``attn_v``, ``ffn_down``, ...) in place of
    ``quantize`` for those projections, a mix as llama.cpp's Q4_K_M makes."""
    import gguf

    cfg = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(str(checkpoint / "model.safetensors"))
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    if arch == "gemma3":
        rope = rope.get("full_attention", rope)
    writer.add_rope_freq_base(float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    if arch.startswith("gemma"):
        writer.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    vocab = cfg["vocab_size"]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(vocab)])
    writer.add_token_types([1] * vocab)
    writer.add_bos_token_id(cfg.get("bos_token_id") or 1)
    writer.add_eos_token_id(cfg.get("eos_token_id") or 2)
    norms = _SANDWICH if arch.startswith("gemma") else _PRE_NORM
    for name, tensor in tensors.items():
        array = tensor.to(torch.float32).numpy()
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            gguf_name = f"blk.{layer}.{({**_LAYER, **norms})[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                array = _permute(array, heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                array = _permute(array, kv_heads)
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0
        qtype = (quantize_kinds or {}).get(gguf_name.split(".")[-2], quantize)
        if qtype is not None and "_proj" in name:
            kind = gguf.GGMLQuantizationType[qtype]
            blocks = gguf.quants.quantize(np.ascontiguousarray(array), kind)
            writer.add_tensor(gguf_name, blocks, raw_shape=blocks.shape, raw_dtype=kind)
            continue
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
