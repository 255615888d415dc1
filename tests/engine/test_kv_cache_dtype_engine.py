"""An engine keeping its KV cache in 8 bits (``kv_cache_dtype`` int8 / fp8_e4m3): the tiny model decodes
the same greedy tokens as with the float cache through the C++ CPU kernels and the torch backend, the
cache holds the smaller rows, and what cannot keep such a cache is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kernels import cpu as cpu_kernels
from engine.quant.resolve import resolve_kv_cache_dtype

PROMPTS = [[5, 17, 42, 9, 3, 88, 61, 7, 150, 23, 11], [200, 4, 4, 90]]
# Six tokens: the random-weight model's next-token logits are nearly flat, and by the eighth token of
# the second prompt fp8's 3-bit mantissa flips a near tie (the float cache's 413 becomes 378); the
# shipped model's agreement over a real text is measured by `python -m bench kv-dtype`.
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
ENGINE = {"dtype": "float32", "max_model_len": 64, "num_blocks": 16, "block_size": 8, "max_num_seqs": 2}


def _generate(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def float_tokens(tiny_llama_path: Path) -> list[list[int]]:
    return _generate(LLM(str(tiny_llama_path), attention_backend="torch", **ENGINE))


@pytest.mark.parametrize(
    ("kv_cache_dtype", "backend", "storage"),
    [
        pytest.param(
            "int8",
            "cpu",
            torch.int8,
            marks=pytest.mark.skipif(not cpu_kernels.load_kv_quant(), reason="no C++ 8-bit cache kernels"),
        ),
        pytest.param(
            "fp8_e4m3",
            "cpu",
            torch.float8_e4m3fn,
            marks=pytest.mark.skipif(not cpu_kernels.load_kv_quant(), reason="no C++ 8-bit cache kernels"),
        ),
        ("int8", "torch", torch.int8),
    ],
)
def test_8bit_cache_decodes_the_float_caches_tokens(
    tiny_llama_path: Path,
    float_tokens: list[list[int]],
    kv_cache_dtype: str,
    backend: str,
    storage: torch.dtype,
) -> None:
    llm = LLM(str(tiny_llama_path), attention_backend=backend, kv_cache_dtype=kv_cache_dtype, **ENGINE)
    runner = llm.engine.runner
    cache = runner.kv_caches[0]
    head_dim = llm.engine.config.model.head_dim  # 32
    # Rows of D codes and a 4-byte scale: 36 bytes a (token, kv head) against float32's 128.
    assert cache.dtype == storage and cache.shape[-1] == head_dim + 4
    assert runner.bytes_per_block() == cache[:, 0].numel() * len(runner.kv_caches)
    assert _generate(llm) == float_tokens


def test_what_cannot_keep_an_8bit_cache_is_refused(
    tiny_llama_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="unsupported kv_cache_dtype 'fp16'"):
        LLM(str(tiny_llama_path), kv_cache_dtype="fp16")
    with pytest.raises(ValueError, match="multiple of 4, not 6"):
        resolve_kv_cache_dtype("int8", torch.float32, 6, "torch", torch.device("cpu"))
    # No GPU here: the capability query is faked to be an A100's (8.0), whose Triton has no fp8 cast.
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"compute capability 8\.9\+.*this one is 8\.0.*'int8'"):
        resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16, 128, "triton", torch.device("cuda"))
    cuda = torch.device("cuda")
    assert resolve_kv_cache_dtype("int8", torch.bfloat16, 128, "triton", cuda) == torch.int8
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, 128, "triton", cuda) == torch.bfloat16
