"""A Mistral checkpoint with a 32-token sliding window, served past its window: greedy tokens equal HF's
under chunked prefill and prefix caching, and each request's KV blocks stay bounded by the window."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.kernels import cpu as cpu_kernels
from engine.models.tiny import write_tiny_checkpoint
from engine.sched.output import SchedulerOutput
from tests.engine.hf_reference import hf_greedy
from tests.engine.test_hf_parity import prompts

WINDOW = 32
BLOCK_SIZE = 8
BUDGET = 24  # tokens per step: prompts of 40-120 tokens prefill in several chunks
MAX_NEW = 10


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(
        tmp_path_factory.mktemp("mistral"), arch="mistral", seed=5, sliding_window=WINDOW
    )


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_windowed_mistral_matches_hf_with_blocks_bounded_by_the_window(mistral: Path, backend: str) -> None:
    if backend == "cpu" and not cpu_kernels.load():
        pytest.skip("the C++ CPU kernels could not be built")
    # 16 shared tokens then 24-104 of each prompt's own: 40-120 tokens, all longer than the window, and
    # prefix hits on the shared blocks for every prompt after the first.
    batch = prompts(6, seed=7, lo=24, hi=104, shared_prefix=16)
    assert all(40 <= len(p) <= 120 for p in batch)
    llm = LLM(
        str(mistral),
        attention_backend=backend,
        dtype="float32",
        max_num_batched_tokens=BUDGET,
        block_size=BLOCK_SIZE,
        max_num_seqs=3,
        enable_prefix_caching=True,
    )
    engine = llm.engine
    assert engine.config.max_model_len == 2048  # the positions, not the window
    assert engine.kv.free_window == WINDOW

    # Every step: each request still running holds at most the blocks its step spanned, from its first
    # query's window start (engine/kv_cache/manager.py): cdiv(W - 1 + n, block_size) + 1.
    kv, sched = engine.kv, engine.scheduler
    schedule = sched.schedule
    steps: list[SchedulerOutput] = []

    def spy() -> SchedulerOutput:
        out = schedule()
        steps.append(out)
        return out

    sched.schedule = spy  # type: ignore[method-assign]
    freed_seen = 0
    for i, prompt in enumerate(batch):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
        )
    got: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.outputs[0].token_ids if out.outputs else [])
        kv.check_integrity()
        for req_id, num_scheduled in steps[-1].num_scheduled_tokens.items():
            if req_id in kv.req_blocks:
                bound = -(-(WINDOW - 1 + num_scheduled) // BLOCK_SIZE) + 1
                assert kv.num_held_blocks(req_id) <= bound, (req_id, num_scheduled)
                freed_seen = max(freed_seen, kv.num_freed_blocks(req_id))
    for i, prompt in enumerate(batch):
        assert got[f"r{i}"] == hf_greedy(mistral, prompt, MAX_NEW), (
            f"diverged on prompt of {len(prompt)} tokens"
        )
    assert freed_seen >= (120 - WINDOW) // BLOCK_SIZE - 1  # the longest prompt left most of itself behind
    assert kv.pool.num_cache_hits >= 5 * 16  # each later prompt found the shared 16 tokens
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_total_blocks
