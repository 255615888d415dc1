"""Paged attention over the step's real tokens: store the step's K/V, then attend through the block
tables with this layer's scale, sliding window and logit soft cap (engine/attention: the backend is
the kernel choice, made once per engine)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.backend import AttentionBackend, AttentionMetadata


class Attention:
    def __init__(
        self,
        backend: AttentionBackend,
        num_heads: int,  # this rank's
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        sliding_window: int | None = None,  # attend to the last `sliding_window` positions only
        logits_soft_cap: float | None = None,  # scores -> cap * tanh(scores / cap)
        dense_inputs: bool = False,  # the backend wants contiguous q/k/v (the torch path)
    ) -> None:
        self.backend = backend
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scale = scale
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.dense_inputs = dense_inputs

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[T, q_size + 2 * kv_size] -> views q [T, Hq, D], k and v [T, Hkv, D]."""
        n = qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return (
            q.view(n, self.num_heads, self.head_dim),
            k.view(n, self.num_kv_heads, self.head_dim),
            v.view(n, self.num_kv_heads, self.head_dim),
        )

    def __call__(
        self,
        qkv: torch.Tensor,  # [rows, q_size + 2 * kv_size]; rows >= metadata.num_tokens
        kv_cache: torch.Tensor,  # this layer's cache, in the backend's layout
        metadata: AttentionMetadata,
        out: torch.Tensor | None = None,  # [rows, q_size]: written in rows < num_tokens only
    ) -> torch.Tensor:  # [rows, q_size]
        """Rows past the step's real tokens (padding: Kernels.row_padding, or a CUDA-graph bucket) are
        never stored, never attended, and come back zero, or as ``out`` held them."""
        rows, real = qkv.shape[0], metadata.num_tokens
        q, k, v = self.split(qkv[:real])
        if self.dense_inputs:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        # Store first: a request's own new tokens must be visible to its causal attention.
        self.backend.store_kv(k, v, kv_cache, metadata)
        attn = self.backend.forward(
            q,
            kv_cache,
            metadata,
            self.scale,
            sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap,
            new_kv=(k, v),
        ).reshape(real, self.q_size)
        if out is not None:
            out[:real].copy_(attn)
            return out
        if real < rows:
            attn = F.pad(attn, (0, 0, 0, rows - real))
        return attn
