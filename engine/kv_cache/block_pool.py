"""A pool of fixed-size KV blocks with ref counts, an eviction-ordered free queue and a prefix index.

A block is in exactly one of two places:
  - held: ref_cnt > 0, owned by one or more requests (more than one when a prefix is shared);
  - free: ref_cnt == 0, in ``free_queue``. A free block may still carry a hash and stay findable in
    the prefix index: it is reused by a prefix hit (taken back out of the queue) until the allocator
    evicts it for new contents, oldest first.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# A block's hash says "these tokens, after that exact prefix": sha256 over the parent's digest and the
# block's token ids. Python's builtin hash() of ints is predictable and collides by construction
# (hash(0) == hash(2**61 - 1)), so one tenant could craft a prompt whose blocks are looked up as another
# tenant's cached prefix (the problem behind vLLM advisory GHSA-rm76-4mrf-v9r8). The chain starts from a
# per-process random root, so the digests are unpredictable to clients too; only the process that made
# them ever consults them.
BlockHash = bytes
ROOT_HASH: BlockHash = os.urandom(32)


def hash_block(parent_hash: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    """Chained block hash: equal hashes mean equal token prefixes (sha256: no collision is known).

    The token ids go in as one int64 array (packed in C, no per-token Python), after the parent digest
    (fixed length), so the byte string cannot be read two ways.
    """
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set once the block is full and registered in the prefix index

    def __repr__(self) -> str:
        digest = self.block_hash.hex()[:12] if self.block_hash else None
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, hash={digest})"


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order: the head is evicted first. OrderedDict gives O(1)
        # removal from the middle, which a prefix hit on a free block needs.
        self.free_queue: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}  # block hash -> block
        self.num_cache_queries = 0  # tokens looked up in the prefix index
        self.num_cache_hits = 0  # tokens found there

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def allocate(self, num: int) -> list[KVCacheBlock]:
        """Take ``num`` blocks from the head of the free queue, evicting their cached contents."""
        if num > len(self.free_queue):
            raise RuntimeError(f"asked for {num} blocks with {len(self.free_queue)} free")
        out = []
        for _ in range(num):
            _, block = self.free_queue.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on blocks found by a prefix hit (pulling free ones out of the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching zero join the tail of the free queue.

        Callers pass a request's blocks in reverse so that its last blocks, the least likely to be
        shared by another prompt, are evicted first.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def register(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Index a full block by its chained hash. A hash already indexed keeps its first block."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def reset_prefix_cache(self) -> None:
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise AssertionError if any invariant is broken.

        expected_refs: block_id -> references held by live requests (from the manager); when given,
        every block's ref_cnt must equal it exactly.
        """
        free_ids = set(self.free_queue)
        assert len(free_ids) == len(self.free_queue), "duplicate block in the free queue"
        for block in self.blocks:
            assert block.ref_cnt >= 0, f"negative ref count: {block}"
            in_free = block.block_id in free_ids
            assert in_free == (block.ref_cnt == 0), f"free queue disagrees with ref count: {block}"
            if expected_refs is not None:
                want = expected_refs.get(block.block_id, 0)
                assert block.ref_cnt == want, f"{block} has {block.ref_cnt} refs, requests hold {want}"
        held = sum(1 for b in self.blocks if b.ref_cnt > 0)
        assert held + len(self.free_queue) == self.num_blocks, "free + held != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, f"prefix index points at a re-used block: {block}"
        indexed = sum(1 for b in self.blocks if b.block_hash is not None)
        assert indexed == len(self.cached), "a hashed block is missing from the prefix index"
