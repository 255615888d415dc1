"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens."""

from engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from engine.kv_cache.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheBlock", "KVCacheManager"]
