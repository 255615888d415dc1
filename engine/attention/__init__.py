"""Attention backends: the only place the model touches the paged KV cache."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, KVLayout, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "KVLayout", "get_attention_backend"]
