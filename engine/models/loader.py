"""Load an HF-format checkpoint (config.json + safetensors, sharded or not) into merged weights."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.config import ModelConfig
from engine.models.gguf import local_checkpoint
from engine.quant.channel import ChannelWeight, quantize_per_channel
from engine.quant.stacked import StackedWeight
from engine.quant.weight import QuantizedWeight

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.distributed.sharding import ShardPlan
    from engine.models.family import Family


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no safetensors weights in {path}")
    return found


def read_safetensors(
    path: Path,
    plan: ShardPlan | None = None,
    family: Family | None = None,
    raw_config: dict[str, Any] | None = None,
    transform: Callable[[str, torch.Tensor], Any] | None = None,
) -> dict[str, Any]:
    """Every tensor of the checkpoint under its canonical name (``family.canonical``); with a
    tensor-parallel ``plan``, only this rank's slice of each (a sliced read: the rest of the file is
    never copied), except tensors the family fuses in its checkpoint, which are read whole and split.
    ``transform(name, tensor)``, where given, replaces each tensor as it is read (without a plan)."""
    from safetensors import safe_open  # not needed for dummy weights (GPU benchmarks)

    tensors: dict[str, Any] = {}
    keep = transform or (lambda _name, tensor: tensor)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt") as f:
            for stored in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = family.canonical(stored) if family is not None else stored
                parts = family.fused(name, raw_config or {}) if family is not None and family.fused else None
                if parts is not None:
                    whole = f.get_tensor(stored)
                    for (part, _), tensor in zip(parts, whole.split([n for _, n in parts]), strict=True):
                        tensors[part] = keep(part, _take(plan, part, tensor))
                    continue
                if plan is None:
                    tensors[name] = keep(name, f.get_tensor(stored))
                    continue
                view = f.get_slice(stored)

                def read(region: tuple[int, int, int] | None, view: object = view) -> torch.Tensor:
                    if region is None:
                        return view[:]  # type: ignore[index]
                    dim, start, stop = region
                    return view[start:stop] if dim == 0 else view[:, start:stop]  # type: ignore[index]

                tensors[name] = plan.take(name, read)
    return tensors


def read_compressed_tensors(
    path: Path, family: Family, raw_config: dict[str, Any], keep_codes: bool
) -> dict[str, torch.Tensor | ChannelWeight]:
    """A compressed-tensors checkpoint's tensors under their canonical names, each quantized linear a
    ``ChannelWeight`` (int8 or fp8 codes; ``keep_codes``) or its dequantised float32 weight. No
    tensor-parallel slicing (refused with 8-bit weights; the dequantised copy is read whole)."""
    from safetensors.torch import load_file

    from engine.quant.compressed_tensors import check_supported, combine

    for scheme in check_supported(raw_config):
        logger.warning(
            "%s: the checkpoint's fp8 activations are not applied; its fp8 weights are served with "
            "activations in the model's dtype",
            scheme,
        )
    stored: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(path):
        stored.update(load_file(str(file)))
    out: dict[str, torch.Tensor | ChannelWeight] = {}
    for stored_name, weight in combine(stored).items():
        if isinstance(weight, ChannelWeight) and not keep_codes:
            weight = weight.dequantize()
        name = family.canonical(stored_name)
        parts = family.fused(name, raw_config) if family.fused else None
        if parts is None:
            out[name] = weight
            continue
        start = 0
        for part, rows in parts:  # a fused checkpoint tensor (Phi-3's qkv_proj): row ranges
            out[part] = (
                weight.narrow_rows(start, start + rows)
                if isinstance(weight, ChannelWeight)
                else weight[start : start + rows].clone()
            )
            start += rows
    return out


def _region_reader(weight: Any) -> Any:
    """``plan.take``'s reader over a tensor already in memory (a dequantised checkpoint's)."""
    from engine.distributed.sharding import slice_region

    return lambda region: slice_region(weight, region).clone()


def _take(plan: ShardPlan | None, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if plan is None:
        return tensor.clone()
    from engine.distributed.sharding import slice_region

    # A copy of the slice: a view would keep the whole tensor's storage alive.
    return plan.take(name, lambda region: slice_region(tensor, region).clone())


def dummy_weights(
    config: ModelConfig,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    plan: ShardPlan | None = None,
) -> dict[str, torch.Tensor]:
    """Random weights with the engine's canonical names and the checkpoint's shapes, for benchmarks
    of a shape, not a model.

    Drawn directly on the target device in the target dtype: an 8B model never passes through host
    memory in float32. With a tensor-parallel ``plan`` every rank draws the same full tensors in the
    same order (so N ranks compute the model one rank would) and keeps only its slice of each, one
    tensor at a time: a rank never holds the whole model.
    """
    device = device or torch.device("cpu")
    gen = torch.Generator(device=device).manual_seed(seed)
    h, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=dtype) * 0.02

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device, dtype=dtype)

    w: dict[str, torch.Tensor] = {}

    def put(name: str, tensor: torch.Tensor) -> None:
        w[name] = tensor if plan is None else _take(plan, name, tensor)

    put("model.embed_tokens.weight", rand(config.vocab_size, h))
    put("model.norm.weight", ones(h))
    if not config.tie_word_embeddings:
        put("lm_head.weight", rand(config.vocab_size, h))
    norms = {"pre": ("input_norm", "mlp_norm"), "post": ("attn_out_norm", "mlp_out_norm")}.get(
        config.norm_placement, ("input_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm")
    )
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        for norm in norms:
            put(p + f"{norm}.weight", ones(h))
        put(p + "self_attn.q_proj.weight", rand(q, h))
        put(p + "self_attn.k_proj.weight", rand(kv, h))
        put(p + "self_attn.v_proj.weight", rand(kv, h))
        if config.attention_bias:
            for name, size in (("q", q), ("k", kv), ("v", kv)):
                put(p + f"self_attn.{name}_proj.bias", rand(size))
        if config.qk_norm is not None:
            width = (q, kv) if config.qk_norm == "full" else (d, d)
            put(p + "self_attn.q_norm.weight", ones(width[0]))
            put(p + "self_attn.k_norm.weight", ones(width[1]))
        put(p + "self_attn.o_proj.weight", rand(h, q))
        if config.is_moe_layer(i):
            moe = config.moe_intermediate_size
            put(p + "mlp.gate.weight", rand(config.num_experts, h))
            for e in range(config.num_experts):
                put(p + f"mlp.experts.{e}.gate_proj.weight", rand(moe, h))
                put(p + f"mlp.experts.{e}.up_proj.weight", rand(moe, h))
                put(p + f"mlp.experts.{e}.down_proj.weight", rand(h, moe))
            continue
        put(p + "mlp.gate_proj.weight", rand(inter, h))
        put(p + "mlp.up_proj.weight", rand(inter, h))
        put(p + "mlp.down_proj.weight", rand(h, inter))
    return w


Weight = torch.Tensor | QuantizedWeight | ChannelWeight | StackedWeight


def _cat(parts: list[Weight]) -> Weight:
    """Rows one after another: q/k/v into qkv, gate/up into gate_up (block and 8-bit rows as stored).

    Parts in different formats (llama.cpp's mixes: Q4_K_M keeps v in Q6_K, or Q8_0 where rows are not
    whole 256s, beside Q4_K or Q5_0 q and k; int8 beside fp8 codes) stay as they are, side by side
    (engine/quant/stacked.py): each is multiplied on its own kernel."""
    blocks = [p for p in parts if isinstance(p, QuantizedWeight)]
    if len(blocks) == len(parts) and len({(p.format, p.in_features) for p in blocks}) == 1:
        return QuantizedWeight.cat_rows(blocks)
    codes = {p.qweight.dtype for p in parts if isinstance(p, ChannelWeight)}
    if all(isinstance(p, ChannelWeight) for p in parts) and len(codes) == 1:
        return ChannelWeight.cat_rows(parts)  # type: ignore[arg-type]
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)  # type: ignore[arg-type]
    return StackedWeight.of(parts)  # type: ignore[arg-type]


def _place(weight: Weight, dtype: torch.dtype, device: torch.device) -> Weight:
    if isinstance(weight, StackedWeight):
        return weight.map(lambda part: _place(part, dtype, device))  # type: ignore[arg-type,return-value]
    if isinstance(weight, QuantizedWeight | ChannelWeight):
        return weight.to(device)
    return weight.to(device=device, dtype=dtype).contiguous()


def merge_weights(
    config: ModelConfig, raw: dict[str, Any], dtype: torch.dtype, device: torch.device
) -> dict[str, Any]:
    """Cast, move, fuse q/k/v and gate/up (two fewer matmuls a layer), and stack each MoE layer's
    experts into ``mlp.experts.w13`` [E, 2I, H] (gate rows, then up) and ``mlp.experts.w2`` [E, H, I].
    Weights kept in a GGUF block format (``QuantizedWeight``) or as 8-bit codes (``ChannelWeight``) are
    fused by whole rows, never cast."""

    def take(name: str) -> Any:
        if name not in raw:
            raise KeyError(f"checkpoint is missing tensor {name!r}")
        return raw.pop(name)

    out: dict[str, Any] = {}
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        out[a + "qkv_proj.weight"] = _cat(
            [take(a + "q_proj.weight"), take(a + "k_proj.weight"), take(a + "v_proj.weight")]
        )
        if a + "q_proj.bias" in raw:
            out[a + "qkv_proj.bias"] = torch.cat(
                [take(a + "q_proj.bias"), take(a + "k_proj.bias"), take(a + "v_proj.bias")]
            )
        out[a + "o_proj.weight"] = take(a + "o_proj.weight")
        for name in (a + "o_proj.bias", a + "q_norm.weight", a + "k_norm.weight"):
            if name in raw:
                out[name] = take(name)
        for norm in ("input_norm", "attn_out_norm", "mlp_norm", "mlp_out_norm"):
            if f"{p}{norm}.weight" in raw:
                out[f"{p}{norm}.weight"] = take(f"{p}{norm}.weight")
        if config.is_moe_layer(i):
            experts = range(config.num_experts)
            out[m + "gate.weight"] = take(m + "gate.weight")
            out[m + "experts.w13"] = torch.stack(
                [
                    torch.cat(
                        [take(f"{m}experts.{e}.gate_proj.weight"), take(f"{m}experts.{e}.up_proj.weight")]
                    )
                    for e in experts
                ]
            )
            out[m + "experts.w2"] = torch.stack([take(f"{m}experts.{e}.down_proj.weight") for e in experts])
            continue
        out[m + "gate_up_proj.weight"] = _cat([take(m + "gate_proj.weight"), take(m + "up_proj.weight")])
        out[m + "down_proj.weight"] = take(m + "down_proj.weight")
    out["model.embed_tokens.weight"] = take("model.embed_tokens.weight")
    out["model.norm.weight"] = take("model.norm.weight")
    if not config.tie_word_embeddings and "lm_head.weight" in raw:
        out["lm_head.weight"] = take("lm_head.weight")
    raw.pop("lm_head.weight", None)
    # Rotary buffers some exporters save are recomputed here.
    leftover = [k for k in raw if not k.endswith("rotary_emb.inv_freq")]
    if leftover:
        raise KeyError(f"checkpoint has tensors this architecture does not use: {leftover[:5]}")
    return {k: _place(v, dtype, device) for k, v in out.items()}


def load_weights(
    path: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    load_format: str = "auto",
    seed: int = 0,
    plan: ShardPlan | None = None,
    quantization: str | None = None,
) -> dict[str, Any]:
    """The merged weights; with a tensor-parallel ``plan``, this rank's shard of them; with
    ``quantization="gguf"``, a GGUF file's linear layers and embedding in its block formats; with
    ``"compressed-tensors"``, a checkpoint's int8 or fp8 linears as stored (without it, dequantised);
    with ``"fp8"``, a float checkpoint's decoder linears quantized to fp8 per output channel."""
    from engine.models.registry import family_of

    if quantization == "gguf":
        from engine.quant.gguf_weights import read_gguf_weights

        family = family_of(config.architecture)
        stored = read_gguf_weights(path)
        raw: dict[str, Any] = {family.canonical(name): w for name, w in stored.items()}
        if config.tie_word_embeddings:
            raw.pop("lm_head.weight", None)  # the LM head is the embedding, quantized or not
    elif load_format == "dummy":
        raw = dummy_weights(config, seed, dtype, device, plan)
    else:
        local = local_checkpoint(path)
        raw_config = json.loads((local / "config.json").read_text())
        if raw_config.get("quantization_config"):
            keep = quantization == "compressed-tensors"
            raw = read_compressed_tensors(local, family_of(config.architecture), raw_config, keep)
            if plan is not None:
                raw = {name: plan.take(name, _region_reader(w)) for name, w in raw.items()}
        else:
            fp8 = _quantize_linear if quantization == "fp8" else None
            raw = read_safetensors(local, plan, family_of(config.architecture), raw_config, fp8)
    return merge_weights(config, raw, dtype, device)


# The decoder's dense linear layers, by canonical name: what quantization="fp8" quantizes. The
# embedding and LM head (a row lookup and the logits' precision) and MoE experts stay float.
_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def _quantize_linear(name: str, tensor: torch.Tensor) -> Any:
    """A decoder linear as fp8 codes with per-channel scales, made on the CPU as the checkpoint is read:
    each float tensor is dropped once quantized, so loading never holds the float model (and a GPU
    never sees it). Rows are independent, so q/k/v quantized apart are the fused qkv quantized. Every
    other tensor is copied out of safetensors' file mapping, which otherwise stays mapped (and its pages
    resident) while any tensor read from it lives: the whole file's, for an embedding's sake."""
    if _LINEAR.fullmatch(name) is None:
        return tensor.clone()
    return quantize_per_channel(tensor, torch.float8_e4m3fn)
