"""Prefix-cache block hashes: sha256 chained over token ids, never Python's builtin hash()."""

from __future__ import annotations

import hashlib
from array import array

from engine.kv_cache.block_pool import ROOT_HASH, hash_block
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request
from engine.sampling_params import SamplingParams


def test_hash_is_sha256_of_parent_and_token_bytes() -> None:
    tokens = [1, 2, 3, 40_000]
    digest = hash_block(ROOT_HASH, tokens)
    assert digest == hashlib.sha256(ROOT_HASH + array("q", tokens).tobytes()).digest()
    assert len(digest) == 32
    # Chained: the same block after a different prefix hashes differently.
    assert hash_block(hash_block(ROOT_HASH, [9]), tokens) != hash_block(hash_block(ROOT_HASH, [8]), tokens)


def test_builtin_hash_collisions_do_not_collide() -> None:
    # CPython hashes ints modulo 2**61 - 1 (and hash(-1) == hash(-2)): tuples of these collide under
    # hash(), which let crafted prompts alias another prefix's cached blocks.
    assert hash((0,)) == hash((2**61 - 1,))
    assert hash_block(ROOT_HASH, [0]) != hash_block(ROOT_HASH, [2**61 - 1])
    assert hash_block(ROOT_HASH, [5, -1]) != hash_block(ROOT_HASH, [5, -2])


def test_prefix_hits_still_found() -> None:
    manager = KVCacheManager(num_blocks=16, block_size=4)
    first = Request("a", list(range(10)), SamplingParams(max_tokens=1), None)
    assert manager.allocate_slots(first, 10) is not None
    second = Request("b", [*range(8), 99, 98], SamplingParams(max_tokens=1), None)
    hits, num_hit_tokens = manager.get_computed_blocks(second)
    assert num_hit_tokens == 8 and len(hits) == 2
    third = Request("c", [0, 1, 2, 3, 4, 5, 6, 70, 99], SamplingParams(max_tokens=1), None)
    assert manager.get_computed_blocks(third)[1] == 4
    manager.check_integrity()


def test_ids_past_32_bits_and_block_boundaries_hash_apart() -> None:
    # int64 packing: an id past 2**32 is not folded onto its low bits; the parent's fixed-length
    # digest first, so [1] then [2] is not [1, 2]. (Hashing speed is the engine benchmarks' to show.)
    assert hash_block(ROOT_HASH, [0, 1, 2**40]) != hash_block(ROOT_HASH, [0, 1, 2**40 % 2**32])
    assert hash_block(hash_block(ROOT_HASH, [1]), [2]) != hash_block(ROOT_HASH, [1, 2])
