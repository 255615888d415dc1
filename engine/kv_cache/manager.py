"""Per-request block tables over the block pool: allocate for a step, find cached prefixes, free.

The scheduler asks "room for n more tokens of this request?" and gets the blocks added to the request's
table (possibly none) or None (nothing changed, so it can preempt someone and ask again).

Sliding window (``free_window`` W, set when every layer attends only its last W positions): a running
request's blocks wholly before its window are freed when it is next given room, so its KV use stays
bounded by the window, not the context. Rule: before a step that computes positions from c on (c =
num_computed_tokens), the earliest key any of its queries reads is c - W + 1 (HF: kv > q - W), so
table entries j < (c - W + 1) // block_size are freed and replaced by ``NULL_BLOCK``. Worked example,
W 32, block_size 16:

    step computes from   first key read   blocks freed (table entries)    held after the step
    c = 40 (a chunk)     9                none (9 // 16 = 0)              0, 1, 2, ...
    c = 47 (a decode)    16               0                               NULL, 1, 2
    c = 64               33               0, 1                            NULL, NULL, 2, 3, 4 (64 stored)

A decode therefore holds at most cdiv(W - 1, block_size) + 1 blocks (3 here); a chunk of n tokens
cdiv(W - 1 + n, block_size) + 1.

The table keeps its length (NULL entries in front), so every index stays a position's block: the
runner's copy of the table is never told (its stale ids sit before the window, which no attention
backend reads, and its steps run in order, so a freed block reused by a later step is written only
after the earlier steps' reads). Prefix caching stays exact:
  - a freed block was full and registered when its step was scheduled (registration happens at
    allocation, before any block can leave a window), so its hash still names its contents; it joins
    the free queue with that hash, and a later prompt with the same prefix may take it back (a hit)
    until the pool evicts it, as any free block;
  - NULL_BLOCK is never registered, never in the pool, and never counted by ``check_integrity``;
  - a request whose leading blocks were freed and then evicted finds no hit for them when it comes
    back after a preemption (hits are the longest run from the first block), so it recomputes: a freed
    block's hash can never stand in for contents that are gone.
"""

from __future__ import annotations

from engine.kv_cache.block_pool import ROOT_HASH, BlockPool, KVCacheBlock, hash_block
from engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# The table entry of a block freed for leaving the window: outside the pool, never hashed, never read.
NULL_BLOCK = KVCacheBlock(-1)


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        free_window: int | None = None,  # every layer's sliding window: free blocks that leave it
    ) -> None:
        if free_window is not None and free_window < 1:
            raise ValueError(f"free_window must be >= 1 or None, got {free_window}")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free_window = free_window
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of a request's leading blocks are already registered in the prefix index.
        self._num_registered: dict[str, int] = {}
        # How many of a request's leading table entries are NULL_BLOCK (freed: outside the window).
        self._num_freed: dict[str, int] = {}

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

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens ever holds at once, given steps of at
        most ``max_chunk`` tokens: all of them, or with a window what its longest step spans (see the
        module docstring)."""
        if self.free_window is None:
            return self.blocks_needed(num_tokens)
        return min(
            self.blocks_needed(num_tokens), cdiv(self.free_window - 1 + max_chunk, self.block_size) + 1
        )

    def num_held_blocks(self, request_id: str) -> int:
        """Blocks the request holds now (its table's entries less the freed ones)."""
        return len(self.req_blocks.get(request_id, ())) - self.num_freed_blocks(request_id)

    def num_freed_blocks(self, request_id: str) -> int:
        """The request's leading table entries freed for leaving the window (the runner's copy of the
        table still names their old blocks there)."""
        return self._num_freed.get(request_id, 0)

    def block_ids(self, request_id: str) -> list[int]:
        # A freed entry goes out as 0, the tables' padding value: never read (it is before the window).
        return [max(b.block_id, 0) for b in self.req_blocks.get(request_id, ())]

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
        the last position's logits. A request asking for prompt logprobs gets no hit: the cached
        positions would have no logits to score its prompt with (vLLM does the same).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
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
        nothing, if the pool is short (apart from freeing the blocks that left the window, which
        happens either way).
        """
        hits = new_computed_blocks or []
        if self.free_window is not None and not hits:
            self._free_outside_window(request)
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

    def _free_outside_window(self, request: Request) -> None:
        """Free the request's blocks that no query from num_computed_tokens on reads (module docstring).

        Freeing is the same whether the allocation that follows succeeds or not: those blocks are
        dead either way."""
        assert self.free_window is not None
        held = self.req_blocks.get(request.request_id)
        if not held:
            return
        first_key = max(0, request.num_computed_tokens - self.free_window + 1)
        start = self._num_freed.get(request.request_id, 0)
        stop = min(first_key // self.block_size, len(held))
        if stop <= start:
            return
        dead = held[start:stop]
        held[start:stop] = [NULL_BLOCK] * (stop - start)
        self._num_freed[request.request_id] = stop
        self.pool.free(reversed(dead))

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
        num_freed = self._num_freed.pop(request.request_id, 0)
        if blocks:
            self.pool.free(reversed(blocks[num_freed:]))

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; only allowed when no request holds blocks."""
        if self.req_blocks:
            return False
        self.pool.reset_prefix_cache()
        return True

    def check_integrity(self) -> None:
        expected: dict[int, int] = {}
        for request_id, table in self.req_blocks.items():
            num_freed = self._num_freed.get(request_id, 0)
            assert all(b is NULL_BLOCK for b in table[:num_freed]), f"{request_id}: a freed entry is live"
            blocks = table[num_freed:]
            assert all(b is not NULL_BLOCK for b in blocks), (
                f"{request_id}: NULL_BLOCK past the freed entries"
            )
            ids = [b.block_id for b in blocks]
            assert len(ids) == len(set(ids)), f"{request_id} holds a block twice"
            for block_id in ids:
                expected[block_id] = expected.get(block_id, 0) + 1
        self.pool.check_integrity(expected)
