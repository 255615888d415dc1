"""Per-request block tables over the block pool: allocate for a step, find cached prefixes, free.

The scheduler asks "room for n more tokens of this request?" and gets the blocks added to the request's
table (possibly none) or None (nothing changed, so it can preempt someone and ask again).
"""

from __future__ import annotations

from engine.kv_cache.block_pool import ROOT_HASH, BlockPool, KVCacheBlock, hash_block
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the prefix index.
        self._num_registered: dict[str, int] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def blocks_needed(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    # ---- prefix cache ----------------------------------------------------------------------
    def _update_block_hashes(self, request: Request, num_full_blocks: int) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, tokens[i * bs : (i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of this request's leading full blocks already in the cache.

        At least one token is always left to compute: the step that samples the next token needs
        the last position's logits.
        """
        if not self.enable_caching:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_block_hashes(request, request.num_tokens // self.block_size)
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_queried: int, num_hit: int) -> None:
        """Count a lookup once its request is admitted (a request that waits is looked up again)."""
        if self.enable_caching:
            self.pool.num_cache_queries += num_queried
            self.pool.num_cache_hits += num_hit

    # ---- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for ``num_new_tokens`` tokens after the request's computed ones.

        ``new_computed_blocks`` are prefix hits found by ``get_computed_blocks`` at admission; they
        are prepended to the (empty) block table. Returns the blocks appended to the request's table
        (the hits, then fresh ones; empty when the blocks it holds have room), or None, changing
        nothing, if the pool is short.
        """
        hits = new_computed_blocks or []
        held = self.req_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        total_blocks = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = max(0, total_blocks - len(held) - len(hits))
        # Hits sitting in the free queue count as free now but stop being free once touched.
        num_free_hits = sum(1 for b in hits if b.ref_cnt == 0)
        if num_new_blocks + num_free_hits > self.pool.num_free_blocks:
            if not held:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(hits)
        added = hits + self.pool.allocate(num_new_blocks) if num_new_blocks else list(hits)
        held.extend(added)
        self._register_full_blocks(request, held, (num_computed + num_new_tokens) // self.block_size)
        return added

    def _register_full_blocks(self, request: Request, held: list[KVCacheBlock], num_full: int) -> None:
        """Index blocks that this step fills. Their K/V is written before any later step reads it,
        and within a step every layer stores the step's K/V before attending, so a sibling admitted
        in the same step may already share them."""
        if not self.enable_caching:
            return
        start = self._num_registered.get(request.request_id, 0)
        num_full = min(num_full, len(held), request.num_tokens // self.block_size)
        if num_full <= start:
            return
        self._update_block_hashes(request, num_full)
        for i in range(start, num_full):
            self.pool.register(held[i], request.block_hashes[i])
        self._num_registered[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Release every block the request holds. Idempotent: a second call frees nothing."""
        blocks = self.req_blocks.pop(request.request_id, None)
        self._num_registered.pop(request.request_id, None)
        if blocks:
            self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed when no request holds blocks."""
        if self.req_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True

    def check_integrity(self) -> None:
        expected: dict[int, int] = {}
        for request_id, blocks in self.req_blocks.items():
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
            for block_id in ids:
                expected[block_id] = expected.get(block_id, 0) + 1
        self.pool.check_integrity(expected)
