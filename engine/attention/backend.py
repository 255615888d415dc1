"""The attention backend interface and the metadata of one packed step.

A step packs every scheduled token of every request flat. Worked example, block_size 4, two requests:

    request   computed  scheduled   query tokens        seq_len  block table
    A         5         1 (decode)  [A5]                6        [7, 2]
    B         0         3 (prefill) [B0 B1 B2]          3        [4]

    flat tokens       A5   B0   B1   B2
    positions          5    0    1    2
    slot_mapping      2*4+1=9   4*4+0=16   17   18          (block_table[pos // 4] * 4 + pos % 4)
    query_start_loc   [0, 1, 4]
    seq_lens          [6, 3]
    block_tables      [[7, 2], [4, 0]]                    (padded with 0; never read past seq_len)

Query token i of request r sits at position seq_lens[r] - query_len[r] + i and attends causally to
every cached position <= its own; with a sliding window W, only to the last W of them (its own
included: HF's ``kv_idx > q_idx - W``). Worked example, W 3, block_size 4, a decode at position 9:

    positions   0 1 2 3 | 4 5 6 7 | 8 9
    attended                  . 7 | 8 9      keys 7, 8, 9 (> 9 - 3)
    block 0 and keys 4..6 are never read: block 0 may already be freed (engine/kv_cache/manager.py),
    its table entry stale.

A logit soft cap c (Gemma 2) maps each scaled score s to ``c * tanh(s / c)`` before the softmax.

Slot s is position s % block_size of block s // block_size whatever the layout; the layout (chosen
by the backend, ``KVLayout``) only says how a block's K (or V) is laid out in memory.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

import torch


class KVLayout(enum.Enum):
    """How one layer's paged cache is laid out; index 0 of the first dimension is K, 1 is V.

    TOKEN_MAJOR ``[2, num_blocks, block_size, Hkv, D]``: a token's kv heads side by side, so a store
    writes one run per token; a reader of one kv head strides Hkv * D between keys.
    HEAD_MAJOR ``[2, num_blocks, Hkv, block_size, D]``: each (block, kv head) page is one contiguous
    run of block_size * D elements, which a reader of one kv head streams.
    HEAD_MAJOR_KT: sized as HEAD_MAJOR, V pages as there, but each K page holds
    ``[D / P, block_size, P]`` with P = 4 bytes / element size (float32 1, bf16 2): a dim (or a pair
    of dims) of consecutive keys side by side, so a reader scores many keys at once lane by lane
    instead of summing each key's D products. Its K pages are not a view of ``[block_size, D]``:
    ``to_token_major`` / ``fill_from_token_major`` convert.
    """

    TOKEN_MAJOR = "token-major"
    HEAD_MAJOR = "head-major"
    HEAD_MAJOR_KT = "head-major-kt"

    def shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        if self is KVLayout.TOKEN_MAJOR:
            return (2, num_blocks, block_size, num_kv_heads, head_size)
        return (2, num_blocks, num_kv_heads, block_size, head_size)

    def token_major_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache`` seen as ``[2, num_blocks, block_size, Hkv, D]`` (a view: no copy, writes land);
        TOKEN_MAJOR and HEAD_MAJOR only."""
        if self is KVLayout.HEAD_MAJOR_KT:
            raise ValueError("head-major-kt K pages are not a view of [block_size, D]; use to_token_major")
        return kv_cache.transpose(2, 3) if self is KVLayout.HEAD_MAJOR else kv_cache

    def to_token_major(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """The cache's contents as ``[2, num_blocks, block_size, Hkv, D]`` (a new tensor)."""
        if self is not KVLayout.HEAD_MAJOR_KT:
            return self.token_major_view(kv_cache).clone()
        return torch.stack((key_pages(kv_cache[0]).transpose(1, 2), kv_cache[1].transpose(1, 2)))

    def fill_from_token_major(self, kv_cache: torch.Tensor, token_major: torch.Tensor) -> None:
        """Writes ``token_major`` (``[2, num_blocks, block_size, Hkv, D]``) into ``kv_cache``."""
        if self is not KVLayout.HEAD_MAJOR_KT:
            self.token_major_view(kv_cache).copy_(token_major)
            return
        lanes = _key_lanes(kv_cache[0])  # [num_blocks, Hkv, D / P, block_size, P]
        keys = token_major[0].unflatten(
            -1, (lanes.shape[2], lanes.shape[4])
        )  # [.., block_size, Hkv, D / P, P]
        lanes.copy_(keys.permute(0, 2, 3, 1, 4))
        kv_cache[1].transpose(1, 2).copy_(token_major[1])


def _key_lanes(k_half: torch.Tensor) -> torch.Tensor:
    """The K half of a HEAD_MAJOR_KT cache as what it holds, ``[num_blocks, Hkv, D / P, block_size, P]``
    (a view)."""
    num_blocks, num_kv_heads, block_size, head_size = k_half.shape
    pack = 4 // k_half.element_size()
    return k_half.view(num_blocks, num_kv_heads, head_size // pack, block_size, pack)


def key_pages(k_half: torch.Tensor) -> torch.Tensor:
    """The K half of a HEAD_MAJOR_KT cache (``[num_blocks, Hkv, block_size, D]`` in size) as
    ``[num_blocks, Hkv, block_size, D]`` pages of keys (a new tensor)."""
    return _key_lanes(k_half).permute(0, 1, 3, 2, 4).flatten(3, 4)


@dataclass
class AttentionMetadata:
    num_tokens: int  # scheduled tokens in the step (T); padded steps count the padding
    num_seqs: int  # requests in the step (S)
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [S + 1] int32, cumulative query lengths
    seq_lens: torch.Tensor  # [S] int32, context length after this step (computed + scheduled)
    block_tables: torch.Tensor  # [S, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, flat cache slot of each token; -1: padding, not stored
    # Host-side copies for backends that loop per request on the CPU (no device sync needed).
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]
    decode_only: bool  # every request schedules exactly one token (CUDA graph eligible)


class AttentionBackend(Protocol):
    """Stores the step's K/V into the paged cache and attends through block tables.

    kv_cache for one layer is allocated in the layout ``kv_layout`` returns for the model's dtype,
    head size and device, and handed back to ``store_kv`` and ``forward`` as it is.
    """

    name: str

    def kv_layout(self, dtype: torch.dtype, head_size: int, device: torch.device) -> KVLayout: ...

    def prepare(self, num_heads: int, num_kv_heads: int, head_size: int, dtype: torch.dtype) -> None:
        """Called once at start-up with the model's attention shape (per tensor-parallel rank): any
        choice a backend makes by measuring the host is made here, not in a served step."""
        ...

    def store_kv(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_size]
        value: torch.Tensor,  # [T, num_kv_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> None: ...

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_size]
        kv_cache: torch.Tensor,
        metadata: AttentionMetadata,
        scale: float,
        *,
        sliding_window: int | None = None,  # None: full causal context; W: the last W positions
        logits_soft_cap: float | None = None,  # None: off; c: scores -> c * tanh(scores / c)
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # the K/V store_kv just stored
    ) -> torch.Tensor:  # [T, num_heads, head_size]
        """Attention of the step's queries over their cached context. Keys before a query's window are
        never read, so their blocks may hold anything (another request's K/V, or NaN). ``new_kv``, the
        step's own keys and values ([T, num_kv_heads, head_size] each, in the cache's dtype), lets a
        backend attend a request whose whole context is this step's from them instead of the cache."""
        ...


def get_attention_backend(name: str) -> AttentionBackend:
    """The backend ``name``. Each attention layer passes its own window and soft cap
    (engine/layers/attention.py), so a KV cache that frees blocks outside a model-wide window is only
    ever read within it."""
    return _backend(name)


def _backend(name: str) -> AttentionBackend:
    if name == "torch":
        from engine.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "cpu":
        from engine.attention.cpu_backend import CpuAttentionBackend

        return CpuAttentionBackend()
    if name == "triton":
        from engine.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}")
