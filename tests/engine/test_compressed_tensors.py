"""HF checkpoints in compressed-tensors' W8A16 and fp8 layouts (engine/quant/compressed_tensors.py), and a
float checkpoint quantized to fp8 at load (``quantization="fp8"``), served with their linears as
per-channel 8-bit codes (``ChannelWeight``, the C++ ``w8_linear`` kernel on CPU).

The checkpoints are made here the way llm-compressor stores them: a tiny Qwen2 (q/k/v biases, an
untied LM head left float as compressed-tensors' ``ignore: [lm_head]`` leaves it) written by HF
transformers, each linear quantized symmetric per output channel (scale = max |w| / 127), saved as
``pack-quantized`` (int32 words, bf16 scales) and ``int-quantized`` (int8 weights, float32 scales); in
fp8, ``float-quantized`` with per-channel scales and FP8_DYNAMIC's activation scheme, and per-tensor
scales with a static ``input_scale`` (FP8).
The reference for "tight" is HF transformers on the dequantized float checkpoint (the same values,
in float32): the engine's logprobs agree to float32 roundoff and greedy tokens match. Against the
original float model the int8 rounding shows ("loose").
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.quant.channel import ChannelWeight, quantize_per_channel
from tests.engine.hf_checkpoints import write_hf_checkpoint

_W8A16: dict[str, Any] = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "ignore": ["lm_head"],
    "kv_cache_scheme": None,
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": None,
            "output_activations": None,
            "weights": {
                "num_bits": 8,
                "type": "int",
                "symmetric": True,
                "strategy": "channel",
                "group_size": None,
                "dynamic": False,
                "observer": "minmax",
            },
        }
    },
}


def _pack(q: torch.Tensor) -> torch.Tensor:
    """int8 [out, in] -> int32 [out, ceil(in / 4)]: value 4j + i, plus 128, in bits 8i.. of word j."""
    u = (q.to(torch.int64) + 128).reshape(q.shape[0], -1)
    u = torch.nn.functional.pad(u, (0, -u.shape[1] % 4)).view(q.shape[0], -1, 4)
    words = (u << torch.arange(0, 32, 8)).sum(dim=-1)
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32)


_FP8_DYNAMIC: dict[str, Any] = {
    **_W8A16,
    "format": "float-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "input_activations": {
                "num_bits": 8,
                "type": "float",
                "symmetric": True,
                "strategy": "token",
                "dynamic": True,
            },
            "output_activations": None,
            "weights": {**_W8A16["config_groups"]["group_0"]["weights"], "type": "float"},
        }
    },
}
_FP8_STATIC_TENSOR = {
    **_FP8_DYNAMIC,
    "config_groups": {
        "group_0": {
            **_FP8_DYNAMIC["config_groups"]["group_0"],
            "input_activations": {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False},
            "weights": {**_FP8_DYNAMIC["config_groups"]["group_0"]["weights"], "strategy": "tensor"},
        }
    },
}


def _quantize(tensor: torch.Tensor, fmt: str) -> ChannelWeight:
    """llm-compressor's minmax weights: per channel, or (``tensor`` formats) one scale for the tensor."""
    if fmt == "fp8-tensor":
        scale = tensor.float().abs().amax() / 448.0
        q = (tensor.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
        return ChannelWeight(q, scale.expand(tensor.shape[0]).contiguous())
    return quantize_per_channel(tensor, torch.float8_e4m3fn if fmt.startswith("fp8") else torch.int8)


def _write_w8a16(source: Path, target: Path, fmt: str, scale_dtype: torch.dtype) -> Path:
    """``source`` (an HF float checkpoint) quantized into ``target`` in ``fmt`` (a compressed-tensors
    format, or fp8-channel / fp8-tensor: float-quantized); also writes ``target``-dequant: the float
    checkpoint of exactly the values the 8-bit weights hold."""
    from safetensors.torch import load_file, save_file

    float_weights = load_file(str(source / "model.safetensors"))
    stored: dict[str, torch.Tensor] = {}
    dequant: dict[str, torch.Tensor] = {}
    for name, tensor in float_weights.items():
        if not (name.endswith("_proj.weight") and name.startswith("model.layers.")):
            stored[name] = dequant[name] = tensor
            continue
        w = _quantize(tensor, fmt)
        scale = w.scale.to(scale_dtype)
        base = name[: -len(".weight")]
        if fmt == "fp8-tensor":
            stored[base + ".weight"] = w.qweight
            stored[base + ".weight_scale"] = scale[:1]
            stored[base + ".input_scale"] = torch.ones(1, dtype=scale_dtype)
            dequant[name] = ChannelWeight(w.qweight, scale.float()).dequantize()
            continue
        if fmt == "pack-quantized":
            stored[base + ".weight_packed"] = _pack(w.qweight)
            stored[base + ".weight_shape"] = torch.tensor(list(w.qweight.shape), dtype=torch.int32)
        else:
            stored[base + ".weight"] = w.qweight
        stored[base + ".weight_scale"] = scale[:, None]
        stored[base + ".weight_zero_point"] = torch.zeros(w.out_features, 1, dtype=torch.int8)
        dequant[name] = ChannelWeight(w.qweight, scale.float()).dequantize()
    config = json.loads((source / "config.json").read_text())
    quant_config = {"fp8-channel": _FP8_DYNAMIC, "fp8-tensor": _FP8_STATIC_TENSOR}.get(
        fmt, {**_W8A16, "format": fmt}
    )
    for directory, weights, quant in (
        (target, stored, quant_config),
        (_dequant(target), dequant, None),
    ):
        directory.mkdir(parents=True)
        save_file(weights, str(directory / "model.safetensors"))
        (directory / "config.json").write_text(
            json.dumps({**config, "quantization_config": quant} if quant else config)
        )
    return target


def _dequant(path: Path) -> Path:
    return path.with_name(path.name + "-dequant")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("w8a16")
    source = write_hf_checkpoint(root / "float", "qwen2", seed=3, tie_word_embeddings=False)
    return {
        "float": source,
        "pack-quantized": _write_w8a16(source, root / "packed", "pack-quantized", torch.bfloat16),
        "int-quantized": _write_w8a16(source, root / "int", "int-quantized", torch.float32),
        "fp8-channel": _write_w8a16(source, root / "fp8c", "fp8-channel", torch.bfloat16),
        "fp8-tensor": _write_w8a16(source, root / "fp8t", "fp8-tensor", torch.float32),
    }


def _hf_logprobs(path: Path, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """HF's float32 log-softmax at each generated position, teacher-forced on ``tokens``: [len, vocab]."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager")
    with torch.inference_mode():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :]
    return torch.log_softmax(logits.float(), dim=-1)


def _max_error(outputs: Any, prompts: list[list[int]], reference: Path) -> float:
    worst = 0.0
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        want = _hf_logprobs(reference, prompt, tokens)
        for step, top in enumerate(logprobs):
            for token, value in top.items():
                worst = max(worst, abs(value - float(want[step, token])))
    return worst


@pytest.mark.parametrize("fmt", ["pack-quantized", "int-quantized"])
def test_w8a16_serves_int8_and_matches_the_dequantized_model(fmt: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[fmt]
    rng = random.Random(5)
    # Short prompts (rows multiplied by the int8 kernel) and one past its 64-row bound (a prefill that
    # multiplies the dequantized weight).
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (4, 11, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    llm = LLM(str(path), dtype="float32", max_num_seqs=4)
    layer = llm.engine.runner.model.layers[0]
    assert isinstance(layer.qkv_proj.weight, ChannelWeight) and layer.qkv_proj.bias is not None
    assert isinstance(layer.mlp.gate_up_proj.weight, ChannelWeight)
    assert isinstance(llm.engine.runner.model.lm_head.weight, torch.Tensor), "the ignored LM head stays float"
    outputs = llm.generate(prompts, params)
    del llm
    from tests.engine.hf_reference import hf_greedy

    dequant = _dequant(path)
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(dequant, prompt, 8)
    # Tight: the same float32 values as HF's dequantized model, summed in another order.
    assert _max_error(outputs, prompts, dequant) < 2e-4
    # Loose: against the float model the int8 rounding (half a step of max|w| / 127 per weight, and
    # the bf16-rounded scales of the packed checkpoint) shows, through four layers whose logits have a
    # std of 6: measured 0.25 (int-quantized) and 0.28 (pack-quantized) at worst over the top 5.
    loose = _max_error(outputs, prompts, checkpoints["float"])
    assert 1e-3 < loose < 0.5, loose


def test_quantization_none_dequantizes(checkpoints: dict[str, Path]) -> None:
    llm = LLM(str(checkpoints["pack-quantized"]), dtype="float32", quantization="none", max_num_seqs=2)
    weight = llm.engine.runner.model.layers[0].mlp.down_proj.weight
    assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32


def _with_quantization(tmp_path: Path, source: Path, quant: dict[str, Any]) -> str:
    target = tmp_path / "variant"
    target.mkdir(exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quant}))
    return str(target)


def _group(**weights: Any) -> dict[str, Any]:
    base = _W8A16["config_groups"]["group_0"]
    return {**_W8A16, "config_groups": {"group_0": {**base, "weights": {**base["weights"], **weights}}}}


@pytest.mark.parametrize(
    ("quant", "message"),
    [
        (_group(num_bits=4, strategy="group", group_size=128), r"scheme W4A16 \(group strategy, group 128\)"),
        (
            {
                **_W8A16,
                "config_groups": {
                    "group_0": {
                        **_W8A16["config_groups"]["group_0"],
                        "input_activations": {"num_bits": 8, "type": "int", "dynamic": True},
                    }
                },
            },
            r"scheme W8A8 \(channel strategy, dynamic activations\)",
        ),
        (_group(type="float", strategy="group", group_size=128), r"scheme W8A16-FP8 \(group strategy"),
        (_group(symmetric=False), r"asymmetric"),
        ({**_W8A16, "format": "marlin-24"}, r"format 'marlin-24' is not served"),
        ({"quant_method": "gptq", "bits": 4}, r"quantization method 'gptq' is not served"),
    ],
)
def test_other_schemes_are_refused_by_name(
    quant: dict[str, Any], message: str, checkpoints: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(_with_quantization(tmp_path, checkpoints["float"], quant))


def test_quantization_argument_checks_the_checkpoint(checkpoints: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="needs a compressed-tensors checkpoint"):
        LLM(str(checkpoints["float"]), quantization="compressed-tensors")
    with pytest.raises(ValueError, match="do not split over tensor-parallel ranks"):
        LLM(str(checkpoints["int-quantized"]), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="do not split over tensor-parallel ranks"):
        LLM(str(checkpoints["float"]), quantization="fp8", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="already quantized to int8"):
        LLM(str(checkpoints["int-quantized"]), quantization="fp8")


@pytest.mark.parametrize("fmt", ["fp8-channel", "fp8-tensor"])
def test_fp8_checkpoints_serve_fp8_weights(
    fmt: str, checkpoints: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    """fp8 weights kept as e4m3 codes (a quarter of float32's bytes), their schemes' fp8 activations
    served in the model's dtype (said in the log); the same greedy tokens as HF on the dequantized model
    and logprobs within float32 roundoff of it, also with quantization="fp8" asked for by name."""
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (5, 70)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    with caplog.at_level("WARNING", logger="engine.models.loader"):
        llm = LLM(str(checkpoints[fmt]), dtype="float32", max_num_seqs=4, quantization="fp8")
    assert "fp8 activations are not applied" in caplog.text
    weight = llm.engine.runner.model.layers[0].mlp.down_proj.weight
    assert isinstance(weight, ChannelWeight) and weight.qweight.dtype == torch.float8_e4m3fn
    outputs = llm.generate(prompts, params)
    del llm
    from tests.engine.hf_reference import hf_greedy

    dequant = _dequant(checkpoints[fmt])
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(dequant, prompt, 8)
    assert _max_error(outputs, prompts, dequant) < 2e-4


def test_quantization_fp8_quantizes_a_float_checkpoint_at_load(checkpoints: dict[str, Path]) -> None:
    """quantization="fp8" on a float checkpoint: each decoder linear's rows quantized to e4m3 with their
    own scale (what llm-compressor's FP8 per-channel weights hold: the same values as the fp8-channel
    checkpoint's, before its bf16 scales), the LM head and embedding left float; greedy tokens those of
    HF on those values, and the logprobs near the float model's (e4m3 keeps 3 mantissa bits)."""
    from tests.engine.hf_reference import hf_greedy

    rng = random.Random(8)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (6, 13)]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=5)
    llm = LLM(str(checkpoints["float"]), dtype="float32", max_num_seqs=4, quantization="fp8")
    model = llm.engine.runner.model
    qkv = model.layers[1].qkv_proj.weight
    assert isinstance(qkv, ChannelWeight) and qkv.is_fp8 and qkv.nbytes < qkv.dequantize().nbytes / 3
    assert isinstance(model.lm_head.weight, torch.Tensor) and model.lm_head.weight.dtype == torch.float32
    outputs = llm.generate(prompts, params)
    del llm
    online = _write_online_fp8(checkpoints["float"])
    for prompt, out in zip(prompts, outputs, strict=True):
        assert out.outputs[0].token_ids == hf_greedy(online, prompt, 8)
    assert _max_error(outputs, prompts, online) < 2e-4
    # e4m3's 3 mantissa bits cost more than per-channel int8's 255 steps on normal-shaped rows (relative
    # weight error 2.5% against 0.6%): measured 1.22 at worst over the top 5, int8's checkpoints 0.25-0.28.
    loose = _max_error(outputs, prompts, checkpoints["float"])
    assert 1e-3 < loose < 2.5, loose


def _write_online_fp8(source: Path) -> Path:
    """The float checkpoint of the values quantization="fp8" makes of ``source`` (float32 scales)."""
    from safetensors.torch import load_file, save_file

    target = source.with_name("online-fp8")
    if target.exists():
        return target
    weights = load_file(str(source / "model.safetensors"))
    for name, tensor in weights.items():
        if name.endswith("_proj.weight") and name.startswith("model.layers."):
            weights[name] = quantize_per_channel(tensor, torch.float8_e4m3fn).dequantize()
    target.mkdir()
    save_file(weights, str(target / "model.safetensors"))
    (target / "config.json").write_text((source / "config.json").read_text())
    return target


def test_fused_checkpoint_tensors_split_by_rows(tmp_path: Path) -> None:
    """Phi-3 stores q/k/v and gate/up fused: each int8 tensor and its scales split by row ranges."""
    from tests.engine.hf_reference import hf_greedy

    source = write_hf_checkpoint(tmp_path / "float", "phi3", seed=2)
    path = _write_w8a16(source, tmp_path / "int", "int-quantized", torch.float32)
    llm = LLM(str(path), dtype="float32", max_num_seqs=2)
    assert isinstance(llm.engine.runner.model.layers[0].qkv_proj.weight, ChannelWeight)
    prompt = [7, 99, 250, 31, 480]
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(_dequant(path), prompt, 8)
