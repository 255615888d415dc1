"""Decode steps replayed from CUDA graphs captured for a fixed set of batch sizes.

A decode-only step of n requests is padded to the smallest captured bucket b >= n. The padding
rows are harmless by construction:

    row         0 .. n-1 (real)          n .. b-1 (padding)
    input id    the request's token      0
    slot        its cache slot           -1: the store kernel skips it, nothing is written
    seq_len     its context length       1: attends to one stale slot; the output row is dropped

Kernel launch parameters must not change between replays, so the captured metadata fixes
max_seq_len at max_model_len and every input lives in a persistent buffer that each step overwrites
in place. max_seq_len only caps the split-K count: each request sizes its partitions from its own
length inside the kernel, so a short context at a large max_model_len runs no empty split.
"""

from __future__ import annotations

from typing import Any

import torch

from engine.attention.backend import AttentionMetadata
from engine.models.decoder import DecoderModel


def graph_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond, ending at max_num_seqs."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    b = 16
    while b < max_num_seqs:
        sizes.append(b)
        b += 8 if b < 64 else 16
    sizes.append(max_num_seqs)
    return sizes


class GraphedDecode:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_blocks_per_req: int,
        max_model_len: int,
        device: torch.device,
        capture: bool = True,
        pool: Any = None,  # a CUDA graph pool handle to share (the piecewise graphs')
    ) -> None:
        """capture=False runs the same padded buffers eagerly: the CPU tests use it to check the
        padding logic, which is all of this class that does not need a GPU."""
        self.model = model
        self.kv_caches = kv_caches
        self.max_model_len = max_model_len
        self.buckets = graph_buckets(max_num_seqs)
        self.use_graphs = capture
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks_per_req), dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = pool
        if capture:
            self._capture_all()

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_seqs: int) -> int:
        return next(b for b in self.buckets if b >= num_seqs)

    def _metadata(self, b: int, seq_lens_cpu: list[int] | None = None) -> AttentionMetadata:
        return AttentionMetadata(
            num_tokens=b,
            num_seqs=b,
            max_query_len=1,
            max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc[: b + 1],
            seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b],
            slot_mapping=self.slot_mapping[:b],
            query_start_loc_cpu=list(range(b + 1)),
            seq_lens_cpu=seq_lens_cpu if seq_lens_cpu is not None else [1] * b,
            decode_only=True,
        )

    def _forward(self, b: int, metadata: AttentionMetadata) -> torch.Tensor:
        return self.model.forward(self.input_ids[:b], self.positions[:b], self.kv_caches, metadata)

    def _capture_all(self) -> None:
        # Largest first, so smaller graphs fit in the memory pool the largest one reserved.
        for b in reversed(self.buckets):
            metadata = self._metadata(b)
            self._forward(b, metadata)  # warm-up: triton compiles and autotunes outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[b] = self._forward(b, metadata)
            self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def run(
        self,
        input_ids: torch.Tensor,  # [n]
        positions: torch.Tensor,  # [n]
        metadata: AttentionMetadata,  # the step's real (unpadded) decode-only metadata
    ) -> torch.Tensor:  # [n, hidden]
        n = metadata.num_seqs
        b = self.bucket_for(n)
        nb = metadata.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(metadata.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(metadata.seq_lens, non_blocking=True)
        self.block_tables[:n, :nb].copy_(metadata.block_tables, non_blocking=True)
        if b > n:
            self.input_ids[n:b].zero_()
            self.positions[n:b].zero_()
            self.slot_mapping[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        if self.use_graphs:
            self.graphs[b].replay()
            return self.outputs[b][:n]
        seq_lens_cpu = metadata.seq_lens_cpu + [1] * (b - n)
        return self._forward(b, self._metadata(b, seq_lens_cpu))[:n]
