"""Blocks outside a sliding window are freed: exact tables, pool state and prefix-cache behaviour."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import ModelConfig
from engine.kv_cache.manager import NULL_BLOCK, KVCacheManager
from engine.request import Request
from engine.sched.scheduler import Scheduler
from tests.engine.sched_utils import EOS, make_request, make_scheduler, step

BS = 4  # block size
W = 6  # window: a query at q reads keys q - 5 .. q


def _advance(kv: KVCacheManager, request: Request, num_tokens: int, sampled: int | None = None) -> list[int]:
    """One step of the request as the scheduler runs it: room, then progress (and a sampled token)."""
    added = kv.allocate_slots(request, num_tokens)
    assert added is not None
    request.num_computed_tokens += num_tokens
    if sampled is not None:
        request.append_output_token(sampled)
    kv.check_integrity()
    return [b.block_id for b in added]


def _table(kv: KVCacheManager, request: Request) -> list[int | None]:
    return [None if b is NULL_BLOCK else b.block_id for b in kv.req_blocks[request.request_id]]


def test_blocks_leave_at_the_step_whose_first_key_passes_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, free_window=W)
    a = make_request("a", prompt_len=10)
    assert _advance(kv, a, 10, sampled=50) == [0, 1, 2]  # positions 0..9
    # Decode at 10: the first key read is 10 - 6 + 1 = 5, in block entry 1: entry 0 leaves.
    assert _advance(kv, a, 1, sampled=50) == []
    assert _table(kv, a) == [None, 1, 2]
    assert kv.num_free_blocks == 6 and kv.num_held_blocks("a") == 2 and kv.num_freed_blocks("a") == 1
    # Decode at 11 (first key 6: still entry 1), then at 12 a new block (first key 7: entry 1).
    _advance(kv, a, 1, sampled=50)
    assert _table(kv, a) == [None, 1, 2]
    assert _advance(kv, a, 1, sampled=50) == [3]  # the free queue's head: 0 went to its tail
    assert _table(kv, a) == [None, 1, 2, 3]
    # Decode at 13: first key 8, entry 2: entry 1 leaves.
    _advance(kv, a, 1, sampled=50)
    assert _table(kv, a) == [None, None, 2, 3]
    assert kv.block_ids("a") == [0, 0, 2, 3]  # freed entries go out as the tables' padding
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 0, 1]
    # Finishing frees only what is still held; a second free is a no-op.
    kv.free(a)
    kv.free(a)
    kv.check_integrity()
    assert kv.num_free_blocks == 8
    assert list(kv.pool.free_queue) == [4, 5, 6, 7, 0, 1, 3, 2]


def test_a_chunk_keeps_the_window_of_its_first_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS, free_window=W)
    a = make_request("a", prompt_len=30)
    _advance(kv, a, 12)  # positions 0..11
    # The next chunk starts at 12: its first query reads from 12 - 5 = 7 (entry 1), so entry 0 leaves;
    # entries 1 and 2 stay although its later queries do not need them.
    _advance(kv, a, 12)
    assert _table(kv, a) == [None, 1, 2, 3, 4, 5]
    _advance(kv, a, 6, sampled=50)  # from 24: first key 19, entry 4
    assert _table(kv, a) == [None, None, None, None, 4, 5, 6, 7]
    kv.free(a)
    kv.check_integrity()


def test_no_window_frees_nothing() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    a = make_request("a", prompt_len=30)
    _advance(kv, a, 30, sampled=50)
    _advance(kv, a, 1, sampled=50)
    assert _table(kv, a) == list(range(8)) and kv.num_freed_blocks("a") == 0


def test_a_freed_block_stays_a_prefix_hit_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BS, free_window=W)
    a = make_request("a", prompt_len=10)
    _advance(kv, a, 10, sampled=50)
    _advance(kv, a, 1, sampled=50)  # entry 0 (block 0) freed, still hashed
    assert kv.pool.blocks[0].ref_cnt == 0 and kv.pool.blocks[0].block_hash is not None
    # A prompt with the same first 8 tokens hits block 0 (free) and block 1 (a's) and shares them.
    b = make_request("b", prompt_len=10)
    hits, num_cached = kv.get_computed_blocks(b)
    assert [h.block_id for h in hits] == [0, 1] and num_cached == 8
    assert kv.allocate_slots(b, 2, hits) is not None
    kv.check_integrity()
    assert kv.pool.blocks[0].ref_cnt == 1 and kv.pool.blocks[1].ref_cnt == 2
    kv.free(b)
    kv.free(a)
    # Evicted for new contents, block 0's hash leaves the index: the same prompt then finds no hit at
    # all (hits are the leading run), never block 1 alone in block 0's place.
    c = make_request("c", prompt_len=32, first_token=60)
    assert kv.allocate_slots(c, 32) is not None
    assert kv.pool.blocks[0].block_hash != a.block_hashes[0]
    d = make_request("d", prompt_len=10)
    kv.free(c)
    assert kv.get_computed_blocks(d) == ([], 0)
    kv.check_integrity()


def test_max_blocks_held_bounds_a_whole_run() -> None:
    kv = KVCacheManager(num_blocks=64, block_size=BS, free_window=W)
    assert kv.max_blocks_held(100, max_chunk=1) == -(-(W - 1 + 1) // BS) + 1 == 3
    assert kv.max_blocks_held(100, max_chunk=8) == -(-(W - 1 + 8) // BS) + 1 == 5
    assert kv.max_blocks_held(5, max_chunk=8) == 2  # never more than the request's own
    assert KVCacheManager(64, BS).max_blocks_held(100, max_chunk=8) == 25


def _windowed(sched: Scheduler, window: int) -> Scheduler:
    """The same scheduler over a KV manager that frees outside ``window``."""
    layers = sched.config.model.num_hidden_layers
    model = dataclasses.replace(sched.config.model, layer_windows=(window,) * layers)
    cfg = dataclasses.replace(sched.config, model=model)
    kv = KVCacheManager(sched.kv.num_total_blocks, sched.kv.block_size, True, free_window=window)
    return Scheduler(cfg, kv, {EOS})


def test_scheduler_runs_long_requests_in_a_pool_smaller_than_their_context() -> None:
    # 10 blocks of 4 = 40 slots; two requests of 60 + 40 tokens each: without the window they could not
    # even be admitted (25 blocks each).
    sched = _windowed(
        make_scheduler(num_blocks=10, block_size=BS, max_num_batched_tokens=8, max_model_len=128), W
    )
    for i in range(2):
        sched.add_request(make_request(f"r{i}", prompt_len=60, max_tokens=40, first_token=i * 7))
    chunk_bound = -(-(W - 1 + 8) // BS) + 1  # a step of up to 8 tokens: 5
    decode_bound = -(-(W - 1 + 1) // BS) + 1  # a decode: 3
    decodes = 0
    while sched.has_unfinished():
        out = step(sched)
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            if req_id in sched.kv.req_blocks:  # still running after the step
                held = sched.kv.num_held_blocks(req_id)
                assert held <= (decode_bound if num_scheduled == 1 else chunk_bound), (req_id, held)
                decodes += num_scheduled == 1
    assert sched.num_preemptions == 0
    assert decodes == 2 * 38  # 39 decodes each (the prefill samples the first token), the last finishes
    sched.kv.check_integrity()
    assert sched.kv.num_free_blocks == 10


def test_without_the_window_such_a_request_is_refused() -> None:
    sched = make_scheduler(num_blocks=10, block_size=BS, max_num_batched_tokens=8, max_model_len=128)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("r", prompt_len=60, max_tokens=40))


@pytest.mark.parametrize(
    ("raw", "window"),
    [
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 32}, 32),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": None}, None),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": False}, None),
        # Qwen2 slides layers i >= max_window_layers (HF's rule): all only from 0.
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 32,
                "use_sliding_window": True,
                "max_window_layers": 0,
            },
            32,
        ),
        (
            {
                "architectures": ["Qwen2ForCausalLM"],
                "sliding_window": 32,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            None,
        ),
        ({"architectures": ["Qwen2ForCausalLM"], "sliding_window": 32, "use_sliding_window": True}, None),
        (
            {
                "architectures": ["MistralForCausalLM"],
                "sliding_window": 32,
                "layer_types": ["sliding_attention", "full_attention"],
            },
            None,
        ),
    ],
)
def test_kv_free_window_only_when_every_layer_slides(raw: dict[str, object], window: int | None) -> None:
    base = {
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 4096,
    }
    assert ModelConfig.from_dict({**base, **raw}).kv_free_window == window
