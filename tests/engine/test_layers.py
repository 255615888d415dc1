"""The layers' own contracts: every rotary variant's frequencies equal HF's own functions
(transformers.modeling_rope_utils), each layer's C++ path equals its torch reference, and the LM head
scales and soft-caps as Granite and Gemma 2 do."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from engine.distributed.parallel_state import SINGLE
from engine.kernels import cpu as cpu_kernels
from engine.layers.activation import GeluTanhAndMul, SiluAndMul, activation
from engine.layers.embedding import LMHead
from engine.layers.kernels import Kernels
from engine.layers.norm import RMSNorm
from engine.layers.rope_scaling import attention_factor, cos_sin_cache, rope_inv_freq
from engine.layers.rotary import RotaryEmbedding

HEAD, MAX_POS, THETA = 32, 512, 10000.0
SCALINGS: dict[str, dict[str, Any]] = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    "yarn-mscale": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 128,
        "mscale": 1.0,
        "mscale_all_dim": 0.5,
        "beta_fast": 16,
    },
}


def _hf(scaling: dict[str, Any], seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    import transformers as T
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = T.LlamaConfig(
        hidden_size=HEAD * 4,
        num_attention_heads=4,
        max_position_embeddings=MAX_POS,
        rope_parameters={**scaling, "rope_theta": THETA},
    )
    return ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu", seq_len=seq_len)


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_rope_frequencies_equal_hfs(name: str) -> None:
    scaling = SCALINGS[name]
    inv_freq, factor = _hf(scaling)
    torch.testing.assert_close(rope_inv_freq(HEAD, THETA, scaling), inv_freq, rtol=1e-6, atol=0)
    assert attention_factor(scaling, MAX_POS) == pytest.approx(factor)


def test_longrope_uses_short_factors_within_the_original_context_and_long_past_it() -> None:
    scaling = {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.1 * i for i in range(HEAD // 2)],
        "long_factor": [2.0 + 0.3 * i for i in range(HEAD // 2)],
        "original_max_position_embeddings": 128,
    }
    short, factor = _hf(scaling, seq_len=100)
    long, _ = _hf(scaling, seq_len=300)
    cache = cos_sin_cache(HEAD, MAX_POS, THETA, scaling, MAX_POS)
    for pos, inv in ((100, short), (300, long)):
        angles = pos * inv
        torch.testing.assert_close(cache[pos], torch.cat([angles.cos(), angles.sin()]) * factor)
    assert factor == pytest.approx(math.sqrt(1 + math.log(MAX_POS / 128) / math.log(128)))


def test_dynamic_ntk_is_plain_rope_within_max_position_embeddings() -> None:
    scaling = {"rope_type": "dynamic", "factor": 2.0}
    plain = cos_sin_cache(HEAD, MAX_POS, THETA, None)
    dynamic = cos_sin_cache(HEAD, 2 * MAX_POS, THETA, scaling, MAX_POS)
    torch.testing.assert_close(dynamic[:MAX_POS], plain)
    hf_long, _ = _hf(scaling, seq_len=2 * MAX_POS)  # HF's base at the longest sequence served
    angles = (MAX_POS + 7) * hf_long
    torch.testing.assert_close(dynamic[MAX_POS + 7], torch.cat([angles.cos(), angles.sin()]))


def test_unknown_rope_type_is_refused() -> None:
    with pytest.raises(ValueError, match="unsupported rope scaling 'mrope'"):
        rope_inv_freq(HEAD, THETA, {"rope_type": "mrope"})


KERNELS = [Kernels()] + ([Kernels(cpu=True)] if cpu_kernels.load() else [])


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: "cpu" if k.cpu else "torch")
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_and_its_fused_add(kernels: Kernels, offset: float) -> None:
    gen = torch.Generator().manual_seed(0)
    x, res, w = (torch.randn(5, 64, generator=gen) for _ in range(3))
    norm = RMSNorm(w[0].clone(), 1e-6, kernels, offset)
    scale = w[0] + offset
    xd = x.double()
    want = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * scale.double()).float()
    torch.testing.assert_close(norm(x), want, rtol=1e-5, atol=1e-5)
    normed, summed = norm.add(x.clone(), res.clone())
    torch.testing.assert_close(summed, x + res)
    torch.testing.assert_close(normed, norm(x + res), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: "cpu" if k.cpu else "torch")
def test_partial_rotary_turns_only_its_dims(kernels: Kernels) -> None:
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(3, (4 + 2 * 2) * HEAD, generator=gen)
    q = qkv[:, : 4 * HEAD].view(3, 4, HEAD)
    k = qkv[:, 4 * HEAD : 6 * HEAD].view(3, 2, HEAD)
    before_q, before_k = q.clone(), k.clone()
    rotary = RotaryEmbedding(HEAD // 2, 64, THETA, None, 64, kernels, torch.device("cpu"))
    positions = torch.tensor([0, 5, 63])
    rotary(positions, q, k)
    reference = RotaryEmbedding(HEAD // 2, 64, THETA, None, 64, Kernels(), torch.device("cpu"))
    ref_q, ref_k = before_q.clone(), before_k.clone()
    reference.forward_native(positions, ref_q, ref_k)
    torch.testing.assert_close(q, ref_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, ref_k, rtol=1e-5, atol=1e-5)
    assert torch.equal(q[..., HEAD // 2 :], before_q[..., HEAD // 2 :])  # the pass-through half
    assert torch.equal(q[0], before_q[0])  # position 0 turns by nothing


@pytest.mark.parametrize("kernels", KERNELS, ids=lambda k: "cpu" if k.cpu else "torch")
def test_gated_activations(kernels: Kernels) -> None:
    x = torch.randn(4, 2 * 48, generator=torch.Generator().manual_seed(2))
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(activation("silu", kernels)(x), torch.nn.functional.silu(gate) * up)
    gelu = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(activation("gelu_pytorch_tanh", kernels)(x), gelu)
    assert isinstance(activation("silu", kernels), SiluAndMul)
    assert isinstance(activation("gelu_pytorch_tanh", kernels), GeluTanhAndMul)
    with pytest.raises(ValueError, match="unsupported activation 'relu'"):
        activation("relu", kernels)


def test_lm_head_scales_then_soft_caps() -> None:
    gen = torch.Generator().manual_seed(3)
    weight, hidden = torch.randn(96, 16, generator=gen) * 4, torch.randn(3, 16, generator=gen)
    plain = hidden @ weight.T
    head = LMHead(weight, Kernels(), SINGLE, 96, soft_cap=5.0, scaling=2.0)
    torch.testing.assert_close(head(hidden), 5.0 * torch.tanh(plain / 2.0 / 5.0))
    assert head(hidden).abs().max() < 5.0


def test_block_weights_are_dequantised_past_a_row_bound_the_host_decides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.layers import linear
    from engine.quant import random_quantized

    bound = linear.quant_kernel_max_rows.__wrapped__
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2", "avx512f"}))
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: True)
    assert (
        bound("cpu") == linear.QUANT_KERNEL_MAX_ROWS_WIDE_CPU
        and bound("cpu", torch.bfloat16) == linear.QUANT_KERNEL_MAX_ROWS_BF16_CPU
        and bound("cuda") == linear.QUANT_KERNEL_MAX_ROWS
    )
    monkeypatch.setattr(linear, "cpu_has_bf16_matmul", lambda: False)  # bf16 without bf16 units: as float32
    assert bound("cpu", torch.bfloat16) == linear.QUANT_KERNEL_MAX_ROWS_WIDE_CPU
    monkeypatch.setattr(linear, "cpu_flags", lambda: frozenset({"avx2"}))
    assert bound("cpu") == linear.QUANT_KERNEL_MAX_ROWS
    # Up to the bound the blocks are multiplied as stored; past it, the dequantised weight in float.
    rows = linear.quant_kernel_max_rows("cpu", torch.float32)  # the key matmul asks with
    w = random_quantized("Q8_0", 8, 64, torch.Generator().manual_seed(3))
    calls: list[str] = []
    monkeypatch.setattr(
        linear, "quant_linear", lambda x, w, b: calls.append("blocks") or x.new_zeros(len(x), 8)
    )
    monkeypatch.setattr(
        linear, "dequantize_for_step", lambda w, dtype: calls.append("dequantised") or w.dequantize()
    )
    for n in (1, rows, rows + 1):
        linear.matmul(torch.randn(n, 64), w, None, Kernels())
    assert calls == ["blocks", "blocks", "dequantised"]
