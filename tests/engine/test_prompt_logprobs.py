"""Prompt logprobs (``SamplingParams.prompt_logprobs``) equal HF transformers' log-softmax of one full
forward at every prompt position, whatever the scheduler did: prefill in chunks under a small budget,
a prompt whose prefix is in the cache, async scheduling, n > 1."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.outputs import PromptLogprobList
from engine.runner import prompt_scoring
from tests.engine.hf_reference import hf_prompt_logprobs

K = 3


def check_against_hf(path: Path, prompt: list[int], got: PromptLogprobList | None) -> None:
    assert got is not None and len(got) == len(prompt) and got[0] is None
    ref = hf_prompt_logprobs(path, prompt)  # [P - 1, V]
    for i, entry in enumerate(got[1:]):
        assert entry is not None
        row, token = ref[i], prompt[i + 1]
        top_vals, top_ids = row.topk(K)
        # The prompt token itself, then the top K (the token may be among them: one entry).
        assert set(entry) == {token, *top_ids.tolist()}
        assert entry[token].rank == int((row > row[token]).sum()) + 1
        assert entry[token].logprob == pytest.approx(float(row[token]), abs=2e-4)
        for j, (v, t) in enumerate(zip(top_vals.tolist(), top_ids.tolist(), strict=True)):
            assert entry[t].logprob == pytest.approx(v, abs=2e-4)
            if t != token:
                assert entry[t].rank == j + 1
        assert all(e.decoded_token is not None for e in entry.values())


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_chunked_and_prefix_cached_prompts_match_hf(
    tiny_llama_path: Path, async_scheduling: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(prompt_scoring, "SCORE_ROWS", 5)  # a chunk's logits come in several blocks
    rng = random.Random(5)
    prefix = [rng.randrange(5, 1000) for _ in range(40)]
    first = prefix + [rng.randrange(5, 1000) for _ in range(5)]
    second = prefix + [rng.randrange(5, 1000) for _ in range(9)]
    # A budget of 16 tokens: each prompt is prefilled in three or four chunks.
    llm = LLM(
        str(tiny_llama_path),
        max_num_batched_tokens=16,
        block_size=8,
        max_num_seqs=4,
        enable_prefix_caching=True,
        async_scheduling=async_scheduling,
    )
    greedy = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    warm = llm.generate([first], greedy)[0]  # the shared prefix's blocks are in the cache now
    assert warm.prompt_logprobs is None  # not asked for
    asks = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, prompt_logprobs=K, n=2)
    out = llm.generate([second], asks)[0]
    check_against_hf(tiny_llama_path, second, out.prompt_logprobs)
    # It skipped the cache (no logits there to score with); a request that does not ask still hits.
    assert out.metrics is not None and out.metrics.num_cached_tokens == 0
    again = llm.generate([second], greedy)[0]
    assert again.metrics is not None and again.metrics.num_cached_tokens >= 40
    # The scores do not change what is generated.
    assert [c.token_ids for c in out.outputs] == [again.outputs[0].token_ids] * 2
    llm.engine.kv.check_integrity()


def test_one_token_prompt_and_k_zero(tiny_llama_path: Path) -> None:
    llm = LLM(str(tiny_llama_path), max_model_len=64, num_blocks=16, block_size=8)
    one, three = llm.generate(
        [[7], [7, 8, 9]], SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    )
    assert one.prompt_logprobs == [None]
    assert three.prompt_logprobs is not None and three.prompt_logprobs[0] is None
    # k = 0: the prompt token alone, with its rank.
    assert [list(e) for e in three.prompt_logprobs[1:] if e is not None] == [[8], [9]]
    assert all(
        e is not None and e[t].logprob <= 0.0 for e, t in zip(three.prompt_logprobs[1:], [8, 9], strict=True)
    )


def test_bound_like_logprobs() -> None:
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)
    with pytest.raises(ValueError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=-1)


def test_preempted_requests_keep_one_entry_per_token(tiny_llama_path: Path) -> None:
    # A pool too small for all five: some are preempted and prefill their prompt again, which adds no
    # second copy of the entries they already have.
    rng = random.Random(6)
    batch = [[rng.randrange(5, 1000) for _ in range(rng.randint(20, 30))] for _ in range(5)]
    llm = LLM(str(tiny_llama_path), num_blocks=18, block_size=4, max_num_seqs=5, max_model_len=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(batch, params)
    assert llm.engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    for prompt, out in zip(batch, outs, strict=True):
        check_against_hf(tiny_llama_path, prompt, out.prompt_logprobs)
    llm.engine.kv.check_integrity()
