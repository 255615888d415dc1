"""Attention backends: the only place the model touches the paged KV cache."""

from engine.attention.backend import AttentionBackend, AttentionMetadata, get_attention_backend

__all__ = ["AttentionBackend", "AttentionMetadata", "get_attention_backend"]
