"""engine.models.tiny writes checkpoints that HF transformers loads, deterministically."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.config import ModelConfig
from engine.models.tiny import (
    build_config,
    default_model_path,
    init_weights,
    train_tokenizer,
    write_tiny_checkpoint,
)
from engine.tokenizer import load_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog. Once upon a time, 你好 🦀"
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def files_of(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def hf_logits(path: Path, ids: list[int]) -> torch.Tensor:
    loaded: Any = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model, info = loaded
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize(
    ("arch", "kwargs"),
    [
        ("llama", {}),
        ("qwen2", {}),
        ("mistral", {}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": LLAMA3_ROPE}),
    ],
)
def test_hf_loads_model_and_tokenizer(tmp_path: Path, arch: str, kwargs: dict) -> None:
    path = write_tiny_checkpoint(tmp_path, arch=arch, **kwargs)  # type: ignore[arg-type]
    config = json.loads((path / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(PROMPT)["input_ids"]
    assert tokenizer.decode(ids, skip_special_tokens=True) == PROMPT
    logits = hf_logits(path, ids)
    assert logits.shape == (len(ids), config["vocab_size"])
    assert bool(torch.isfinite(logits).all())
    tensors = load_file(str(path / "model.safetensors"))
    assert ("lm_head.weight" in tensors) != config["tie_word_embeddings"]
    assert ("model.layers.0.self_attn.q_proj.bias" in tensors) == (arch == "qwen2")
    assert "model.layers.0.self_attn.o_proj.bias" not in tensors
    # The engine's own config reader agrees with the file.
    parsed = ModelConfig.from_path(path)
    assert parsed.architecture == config["architectures"][0]
    assert parsed.attention_bias == (arch == "qwen2")
    assert parsed.eos_token_ids == (1,) and parsed.bos_token_id == 0
    assert (parsed.rope_scaling is not None) == ("rope_scaling" in kwargs)


def test_logits_have_clear_margins_and_depend_on_context(tiny_llama_path: Path) -> None:
    tok = load_tokenizer(tiny_llama_path)
    assert tok is not None
    body = tok.encode(PROMPT, add_special_tokens=False)
    ids = [0, *body, *body]
    logits = hf_logits(tiny_llama_path, ids)
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    # Far from the flat logits of a std-0.02 init (std ~0.2, gaps ~0.05).
    assert logits.std().item() > 4.0 and gaps.median().item() > 0.5
    # The second copy of the text sees more context: its predictions differ from the first's.
    n = len(body)
    assert (logits[1 : n + 1] - logits[n + 1 :]).abs().mean().item() > 1.0


def test_sharded_checkpoint_has_an_index_and_same_weights(tmp_path: Path) -> None:
    single = write_tiny_checkpoint(tmp_path / "single", arch="qwen2", seed=3)
    sharded = write_tiny_checkpoint(tmp_path / "sharded", arch="qwen2", seed=3, num_shards=3)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shard_names = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert shard_names == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert not (sharded / "model.safetensors").exists()
    merged: dict[str, torch.Tensor] = {}
    for name in shard_names:
        part = load_file(str(sharded / name))
        assert part and all(index["weight_map"][k] == name for k in part)
        merged.update(part)
    reference = load_file(str(single / "model.safetensors"))
    assert merged.keys() == reference.keys() == index["weight_map"].keys()
    assert all(torch.equal(merged[k], reference[k]) for k in reference)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in reference.values())
    ids = [0, 5, 17, 300, 42]
    assert torch.allclose(hf_logits(sharded, ids), hf_logits(single, ids), atol=1e-5)


def test_two_writes_are_byte_identical(tmp_path: Path) -> None:
    a = files_of(write_tiny_checkpoint(tmp_path / "a", arch="qwen2", seed=5, num_shards=2))
    b = files_of(write_tiny_checkpoint(tmp_path / "b", arch="qwen2", seed=5, num_shards=2))
    assert a == b
    assert set(a) >= {"config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    c = files_of(write_tiny_checkpoint(tmp_path / "c", arch="qwen2", seed=6, num_shards=2))
    assert c["model-00001-of-00002.safetensors"] != a["model-00001-of-00002.safetensors"]
    assert c["tokenizer.json"] == a["tokenizer.json"]  # the seed is for weights only


def test_write_is_identical_in_another_process(tmp_path: Path) -> None:
    # Hash randomisation and thread counts differ between processes; the files must not.
    here = files_of(write_tiny_checkpoint(tmp_path / "here"))
    target = str(tmp_path / "there")
    code = f"from engine.models.tiny import write_tiny_checkpoint; write_tiny_checkpoint({target!r})"
    root = Path(__file__).resolve().parents[2]
    env = {"PYTHONHASHSEED": "123", "RAYON_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    subprocess.run([sys.executable, "-c", code], cwd=root, env=env, check=True)
    assert files_of(tmp_path / "there") == here


def test_overrides_shape_config_and_weights(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(
        tmp_path, num_hidden_layers=2, hidden_size=96, num_attention_heads=3, num_key_value_heads=1
    )
    config = json.loads((path / "config.json").read_text())
    assert (config["num_hidden_layers"], config["head_dim"]) == (2, 32)
    tensors = load_file(str(path / "model.safetensors"))
    assert not any(k.startswith("model.layers.2.") for k in tensors)
    assert tensors["model.layers.1.self_attn.k_proj.weight"].shape == (32, 96)
    with pytest.raises(TypeError, match="num_layer"):
        write_tiny_checkpoint(tmp_path / "bad", num_layers=2)


def test_dtype_and_tokenizer_free(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, dtype="bfloat16", with_tokenizer=False)
    assert json.loads((path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = load_file(str(path / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not (path / "tokenizer.json").exists()


def test_bench_preset_size() -> None:
    config = build_config("llama", "bench")
    num_params = sum(t.numel() for t in init_weights(config, seed=0).values())
    assert 40e6 < num_params < 60e6
    assert config["vocab_size"] == 8192 and config["max_position_embeddings"] == 4096
    assert config["num_key_value_heads"] < config["num_attention_heads"]
    # The tokenizer fills the whole vocabulary: every id the model can emit decodes to something.
    assert train_tokenizer(config["vocab_size"]).get_vocab_size() == config["vocab_size"]


def test_default_model_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("INFLIGHT_HOME", str(tmp_path))
    path = default_model_path()
    assert path == tmp_path / "models" / "tiny-llama"
    assert ModelConfig.from_path(path).architecture == "LlamaForCausalLM"
    assert load_tokenizer(path) is not None
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert default_model_path() == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not rewritten
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama"]  # no temp dirs left
