"""Deterministic tiny HF-format checkpoints: random weights plus a real byte-level BPE tokenizer.

Tests and benchmarks need a model that loads exactly like a hub checkpoint (config.json, safetensors
with HF tensor names, tokenizer.json, tokenizer_config.json, generation_config.json) but is small,
offline and reproducible: the same arguments always give byte-identical files.

The weight scales are chosen so the random model behaves usefully in tests rather than like a freshly
initialised one (std 0.02 everywhere gives nearly flat logits, so token-exact comparisons hit near-ties):
  * lm_head rows give logits with std ~LOGIT_STD, so the top two logits are usually well apart;
  * q/k are large enough that attention scores vary by a few units, so RoPE positions and which tokens
    are attended to change the output (a bug in positions or the KV cache changes tokens);
  * each sublayer adds a residual update comparable to the embedding, so context matters, not just
    the last token.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS, EOS, IM_START, IM_END = "<s>", "</s>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END]  # ids 0..3, in this order
LOGIT_STD = 6.0  # std of the output logits at init; see the module docstring

# ChatML, as Qwen-style checkpoints ship it. bos is part of the rendered text, so chat prompts are
# encoded with add_special_tokens=False (the HF convention).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Sizes per preset. tiny: ~1M parameters for fast CPU tests. bench: ~50M, big enough that a step's
# matmuls are not pure launch overhead on a GPU, small enough to load in a second.
_PRESETS: dict[str, dict[str, int]] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
        max_position_embeddings=2048,
    ),
    "bench": dict(
        hidden_size=512,
        intermediate_size=1536,
        num_hidden_layers=14,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=8192,
        max_position_embeddings=4096,
    ),
}

_ARCHS = {
    "llama": ("LlamaForCausalLM", 10000.0, 1e-5),
    "mistral": ("MistralForCausalLM", 10000.0, 1e-5),
    "qwen2": ("Qwen2ForCausalLM", 1000000.0, 1e-6),
}

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PARAGRAPHS = """\
The quick brown fox jumps over the lazy dog. A continuous batching server keeps the accelerator busy
by adding new requests to the running batch as soon as old ones finish, instead of waiting for the
slowest sequence. Each request owns a list of blocks in the key value cache, and the scheduler decides
every step which requests run, how many tokens each one gets, and which ones must wait.
Once upon a time, in a small village near the sea, there lived an old fisherman and his daughter.
Every morning they walked down to the harbour, mended their nets and watched the weather. When the
storm came in the autumn, the whole village gathered in the church and waited for the wind to calm.
Water boils at one hundred degrees Celsius at sea level. The Earth orbits the Sun once a year, and the
Moon orbits the Earth about once a month. Light from the Sun takes a little over eight minutes to reach us.
def fibonacci(n: int) -> int:
    if n < 2:
        return n
    return fibonacci(n - 1) + fibonacci(n - 2)
for (int i = 0; i < 10; i++) { printf("%d\\n", i); }
SELECT name, count(*) FROM users WHERE created_at > '2024-01-01' GROUP BY name ORDER BY 2 DESC;
{"id": 42, "name": "example", "tags": ["alpha", "beta"], "ok": true, "score": 3.14}
Q: What is the capital of France? A: Paris. Q: How many legs does a spider have? A: Eight.
你好，世界！今天天气很好，我们去公园散步吧。机器学习和自然语言处理很有意思。
こんにちは、世界。東京は日本の首都です。ありがとうございます。
Grüße aus München! Le café est très bon, n'est-ce pas ? El niño comió una manzana. Ça va très bien.
Emoji test: 😀 😂 🚀 🎉 ❤️ 👍 🌍 🔥 ✨ 🤖 and symbols like €, £, ¥, ©, ®, ™, °, ±, µ, §.
"""

_SUBJECTS = (
    "the cat|a young engineer|my neighbour|the old teacher|our team|the server|a small robot|the river"
)
_VERBS = "reads|writes|builds|watches|follows|breaks|finds|paints|carries|measures|answers|forgets"
_OBJECTS = "a long letter|the red door|three apples|every request|the morning news|a quiet song|the map"
_PLACES = "in the garden|at the station|near the bridge|on the roof|under the table|after dinner|today"
_SYLLABLES = "ba be bi bo ka ke ki ko ra re ri ro ta te ti to na ne ni no sa se si so la le li lo ma me mi mo"


def _corpus(num_pseudo_words: int) -> list[str]:
    """Deterministic training text: hand-written paragraphs plus generated sentences and words.

    Generated pseudo-words supply enough distinct merges for the bench preset's 8k vocabulary.
    """
    rng = random.Random(1234)
    lines = _PARAGRAPHS.splitlines()
    subjects, verbs = _SUBJECTS.split("|"), _VERBS.split("|")
    objects, places = _OBJECTS.split("|"), _PLACES.split("|")
    for i in range(400):
        sentence = f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)} {rng.choice(places)}"
        lines.append(f"{sentence.capitalize()}, {i * 7 % 1000} times on day {rng.randint(1, 31)}.")
    syllables = _SYLLABLES.split()
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(2, 5))) for _ in range(num_pseudo_words)
    ]
    lines.extend(" ".join(words[j : j + 12]) for j in range(0, len(words), 12))
    # Repeat the real text so its merges outrank the pseudo-words'.
    return _PARAGRAPHS.splitlines() * 20 + lines


def train_tokenizer(vocab_size: int) -> Tokenizer:
    """A byte-level BPE tokenizer (GPT-2 style) with the specials at ids 0..3 and a bos post-processor."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(num_pseudo_words=vocab_size * 3), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 0)]
    )
    return tokenizer


def build_config(
    arch: str = "llama",
    preset: str = "tiny",
    *,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    rope_scaling: dict[str, Any] | None = None,
    **overrides: Any,
) -> dict[str, Any]:
    """The config.json contents write_tiny_checkpoint would write (see there for the arguments)."""
    architecture, rope_theta, eps = _ARCHS[arch]
    sizes = _PRESETS[preset]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": arch,
        **sizes,
        "head_dim": sizes["hidden_size"] // sizes["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "initializer_range": 0.02,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": dtype,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "use_cache": True,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif arch == "mistral":
        config.update(sliding_window=None)
    else:
        config.update(use_sliding_window=False, sliding_window=None, max_window_layers=None)
    unknown = sorted(set(overrides) - set(config))
    if unknown:
        raise TypeError(f"unknown config field(s) for {arch}: {', '.join(unknown)}")
    config.update(overrides)
    # Fields derived from others follow their overrides unless overridden themselves.
    if "head_dim" not in overrides:
        config["head_dim"] = config["hidden_size"] // config["num_attention_heads"]
    if arch == "qwen2" and config["max_window_layers"] is None:
        config["max_window_layers"] = config["num_hidden_layers"]
    return dict(sorted(config.items()))


def _normal(name: str, shape: tuple[int, ...], std: float, seed: int, mean: float = 0.0) -> torch.Tensor:
    # One generator per tensor, keyed by its name: a tensor's values do not depend on which other
    # tensors exist (tying, sharding or a changed layer count leave the rest unchanged).
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.randn(shape, generator=gen) * std + mean


def init_weights(config: dict[str, Any], seed: int) -> dict[str, torch.Tensor]:
    """HF-named float32 tensors for ``config``; see the module docstring for the choice of scales."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    vocab, head_dim = config["vocab_size"], config["head_dim"]
    q_dim = config["num_attention_heads"] * head_dim
    kv_dim = config["num_key_value_heads"] * head_dim
    qkv_bias = config["model_type"] == "qwen2" or bool(config.get("attention_bias"))
    o_bias = bool(config.get("attention_bias"))  # Llama's attention_bias covers o_proj too; Qwen2's not
    mlp_bias = bool(config.get("mlp_bias"))
    lm_std = LOGIT_STD / math.sqrt(h)  # normed hidden states have RMS ~1
    # The residual stream scale: tied checkpoints share the embedding with lm_head.
    res_std = lm_std if config["tie_word_embeddings"] else 1.0
    # Size of each sublayer's residual update. Tied, the embedding of the current token would dominate
    # the final state and lm_head would predict that same token again and again; larger updates let
    # the context win.
    upd_std = res_std * (3.0 if config["tie_word_embeddings"] else 1.0)
    in_std = 1.0 / math.sqrt(h)  # projections from the normed stream give activations of std ~1
    qk_std = 1.4 / math.sqrt(h)  # attention scores q.k/sqrt(d) with std ~2
    tensors: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": _normal("embed", (vocab, h), res_std, seed),
        "model.norm.weight": _normal("norm", (h,), 0.05, seed, mean=1.0),
    }
    if not config["tie_word_embeddings"]:
        tensors["lm_head.weight"] = _normal("lm_head", (vocab, h), lm_std, seed)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes = {
            "self_attn.q_proj": ((q_dim, h), qk_std, qkv_bias),
            "self_attn.k_proj": ((kv_dim, h), qk_std, qkv_bias),
            "self_attn.v_proj": ((kv_dim, h), in_std, qkv_bias),
            "self_attn.o_proj": ((h, q_dim), upd_std / math.sqrt(q_dim), o_bias),
            "mlp.gate_proj": ((inter, h), in_std, mlp_bias),
            "mlp.up_proj": ((inter, h), in_std, mlp_bias),
            # silu(gate) * up has std ~0.6; scale so the MLP update is ~upd_std as well.
            "mlp.down_proj": ((h, inter), 1.5 * upd_std / math.sqrt(inter), mlp_bias),
        }
        for module, (shape, std, bias) in shapes.items():
            tensors[p + module + ".weight"] = _normal(p + module, shape, std, seed)
            if bias:
                # Biases big enough that forgetting them changes the output.
                bias_std = 0.3 * (std * math.sqrt(shape[1]))
                tensors[p + module + ".bias"] = _normal(p + module + ".b", shape[:1], bias_std, seed)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + norm + ".weight"] = _normal(p + norm, (h,), 0.05, seed, mean=1.0)
    return dict(sorted(tensors.items()))


def _save_weights(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    metadata = {"format": "pt"}
    if num_shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata=metadata)
        _readable(path)
        return
    names = list(tensors)
    # Contiguous groups of names with roughly equal byte counts, so every shard holds something.
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    done = 0
    for name in names:
        idx = min(num_shards - 1, done * num_shards // max(total, 1))
        shards[idx].append(name)
        done += tensors[name].numel() * tensors[name].element_size()
    shards = [s for s in shards if s]
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(path / fname), metadata=metadata)
        weight_map.update((n, fname) for n in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    _write_json(path / "model.safetensors.index.json", index)
    _readable(path)


def _readable(path: Path) -> None:
    # safetensors writes its files private (0600); a checkpoint is also read by other users, such as an
    # image's uid 10001 with the model cache mounted as its model volume.
    for file in path.glob("*.safetensors"):
        file.chmod(0o644)


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(path: Path, vocab_size: int, max_len: int) -> None:
    tokenizer = train_tokenizer(vocab_size)
    (path / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    added = {
        str(i): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, tok in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": [IM_START, IM_END],
        "bos_token": BOS,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": max_len,
        "pad_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    _write_json(path / "tokenizer_config.json", config)


def write_tiny_checkpoint(
    path: str | Path,
    *,
    arch: Literal["llama", "qwen2", "mistral"] = "llama",
    preset: Literal["tiny", "bench"] = "tiny",
    seed: int = 0,
    tie_word_embeddings: bool = False,
    dtype: str = "float32",
    num_shards: int = 1,
    with_tokenizer: bool = True,
    rope_scaling: dict[str, Any] | None = None,
    **overrides: Any,
) -> Path:
    """Write a checkpoint into ``path`` (created if missing) and return it.

    ``overrides`` replace config.json fields (e.g. ``num_hidden_layers=2``); the weights follow the
    overridden shapes. Unknown field names raise TypeError.
    """
    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {', '.join(_ARCHS)}")
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(_PRESETS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose from {', '.join(_DTYPES)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = build_config(
        arch,
        preset,
        tie_word_embeddings=tie_word_embeddings,
        dtype=dtype,
        rope_scaling=rope_scaling,
        **overrides,
    )
    if config["vocab_size"] < len(SPECIAL_TOKENS) + 256:
        raise ValueError("vocab_size must hold the 256 byte tokens and the special tokens")
    torch_dtype = _DTYPES[dtype]
    tensors = {n: t.to(torch_dtype).contiguous() for n, t in init_weights(config, seed).items()}
    _write_json(out / "config.json", config)
    _save_weights(out, tensors, num_shards)
    # Both eos and the ChatML end-of-turn end generation, as in Qwen-style checkpoints.
    generation = {"bos_token_id": 0, "eos_token_id": [1, 3]}
    _write_json(out / "generation_config.json", generation)
    if with_tokenizer:
        _write_tokenizer(out, config["vocab_size"], config["max_position_embeddings"])
    return out


def default_model_path() -> Path:
    """The stack's default model: ``tiny-llama`` in the model cache (``engine.paths.models_dir``).

    Written on first use into a temporary sibling directory and renamed into place, so a concurrent
    process sees either no checkpoint or a complete one.
    """
    from engine.paths import models_dir

    target = models_dir() / "tiny-llama"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=target.parent))
    try:
        write_tiny_checkpoint(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is meant to be shared
        os.rename(tmp, target)
    except OSError:
        # Another process renamed its copy first: use that one.
        if not (target / "config.json").is_file():
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
