"""Every served family, token for token against HF transformers: tiny random checkpoints written by
transformers' own classes (tests/engine/hf_checkpoints.py), greedy decoding on prompts of mixed
lengths (past the sliding window where the family has one), under chunked prefill and prefix caching,
on the C++ CPU kernels, and for a few families on the torch path as well."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.kernels import cpu as cpu_kernels
from tests.engine.hf_checkpoints import FAMILIES, WINDOW, write_hf_checkpoint
from tests.engine.hf_reference import hf_greedy

MAX_NEW = 10


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return {
        family: write_hf_checkpoint(tmp_path_factory.mktemp(family), family, seed=i)
        for i, family in enumerate(FAMILIES)
    }


def _prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(3, 500) for _ in range(20)]  # one full block and more: a prefix-cache hit
    lengths = (3, 17, WINDOW + 9, 2 * WINDOW + 13)
    return [shared + [rng.randrange(3, 500) for _ in range(n)] for n in lengths] + [
        [rng.randrange(3, 500) for _ in range(n)] for n in (5, WINDOW + 1)
    ]


# The torch path (the reference every backend falls back to) runs these families end to end too; the
# others' layers meet it step by step in tests/kernels/test_triton_model_path.py.
TORCH_TOO = ("gemma2", "qwen3_moe", "mistral")


def _backends(family: str) -> list[str]:
    if not cpu_kernels.load():
        return ["torch"]
    return ["cpu", "torch"] if family in TORCH_TOO else ["cpu"]


@pytest.mark.parametrize("family", FAMILIES)
def test_family_matches_hf(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    batch = _prompts(seed=FAMILIES.index(family))
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [hf_greedy(path, prompt, MAX_NEW) for prompt in batch]
    for backend in _backends(family):
        # A small budget chunks every long prompt; block size 8 makes the shared prefix two blocks.
        llm = LLM(
            str(path),
            attention_backend=backend,
            dtype="float32",
            max_num_batched_tokens=16,
            max_num_seqs=4,
            block_size=8,
            enable_prefix_caching=True,
        )
        outs = llm.generate(batch, greedy)
        got = [o.outputs[0].token_ids for o in outs]
        for prompt, tokens, want in zip(batch, got, expected, strict=True):
            assert tokens == want, f"{family} on {backend}: diverged on a prompt of {len(prompt)} tokens"
        assert llm.engine.kv.pool.num_cache_hits > 0, "the shared prefix was meant to hit the cache"
        llm.engine.kv.check_integrity()


def test_family_configs_read_their_fields(checkpoints: dict[str, Path]) -> None:
    import json

    def config(family: str) -> ModelConfig:
        return ModelConfig.from_dict(json.loads((checkpoints[family] / "config.json").read_text()))

    gemma2 = config("gemma2")
    assert gemma2.norm_placement == "sandwich" and gemma2.norm_offset == 1.0
    assert gemma2.attn_logit_softcap == 50.0 and gemma2.final_logit_softcap == 30.0
    assert gemma2.layer_windows == (WINDOW, None, WINDOW, None)
    gemma3 = config("gemma3")
    assert gemma3.qk_norm == "head" and gemma3.layer_rope[0] != gemma3.layer_rope[1]
    assert config("olmo2").qk_norm == "full" and config("olmo2").norm_placement == "post"
    assert config("smollm3").layer_rope[1] is None and config("smollm3").layer_rope[0] is not None
    assert config("mistral").kv_free_window == WINDOW
    assert config("qwen3_moe").moe_layers == (True,) * 4 and config("qwen3_moe").num_experts == 8
    # HF's Qwen3-MoE router rounds its chosen weights to the model dtype, Mixtral's does not.
    assert config("qwen3_moe").moe_weights_in_model_dtype and not config("mixtral").moe_weights_in_model_dtype
    assert config("phi3").rope_scaling is not None and config("phi3").partial_rotary_factor == 0.75


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["FalconForCausalLM"]}, "unsupported architecture"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "relu"}, "activation 'relu'"),
        ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope scaling 'mrope'"),
    ],
)
def test_unsupported_fields_are_refused(checkpoints: dict[str, Path], change: dict, message: str) -> None:
    import json

    raw = json.loads((checkpoints["llama3"] / "config.json").read_text())
    raw.update(change)
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict(raw)


@pytest.mark.parametrize("family", ["qwen3", "qwen3_moe"])
def test_two_ranks_match_one(family: str, checkpoints: dict[str, Path]) -> None:
    """Tensor parallel 2 against 1 on a dense family (q/k norms per head) and a mixture of experts
    (each expert split over the ranks): the same greedy tokens."""
    path = checkpoints[family]
    batch = _prompts(seed=7)[:4]
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    args: dict[str, object] = {"dtype": "float32", "max_num_batched_tokens": 32, "max_num_seqs": 4}
    args["block_size"] = 8
    one = [o.outputs[0].token_ids for o in LLM(str(path), **args).generate(batch, greedy)]
    two_llm = LLM(str(path), tensor_parallel_size=2, **args)
    try:
        two = [o.outputs[0].token_ids for o in two_llm.generate(batch, greedy)]
    finally:
        two_llm.engine.runner.close()
    assert two == one
