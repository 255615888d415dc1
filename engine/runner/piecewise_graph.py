"""Steps that are not decode-only, replayed from CUDA graphs in pieces split at attention.

A mixed step (chunked prefills next to decodes) changes its token count T and its per-request
metadata every step, so one graph cannot hold it. Everything but attention is token-wise, though:
T is padded to a captured size Tb >= T, the token-wise parts replay from graphs captured at Tb rows,
and attention, whose launch follows the step's requests, runs eagerly between them on the real T
rows. L layers make L + 1 graphs per size (the segments of DecoderModel.forward):

    graph 0     embed, pre_attention(0)                       -> qkv, residual
    eager       attention(0): KV store + paged attention      -> attn            rows < T only
    graph i     post_attention(i - 1), pre_attention(i)       -> qkv, residual   1 <= i < L
    eager       attention(i)                                  -> attn
    graph L     post_attention(L - 1), final_norm             -> out

Example, T = 13 with sizes 8, 16, ...: Tb = 16.

    row          0 .. 12 (real)          13 .. 15 (padding)
    input id     the step's token        PAD_TOKEN_ID
    position     its position            PAD_POSITION
    KV store     its slot                never: attention() slices to metadata.num_tokens
    attn         attention's output      zero (cleared once a step; attention writes rows < T)
    out          returned                dropped

Every graph reads and writes persistent buffers sized for the largest Tb (a size's graphs use the
first Tb rows), so nothing a graph allocates outlives its replay: all graphs, the decode graphs'
included, share one memory pool, and the largest size, captured first, reserves it.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from engine.attention.backend import AttentionMetadata
from engine.models.decoder import PAD_POSITION, PAD_TOKEN_ID, DecoderModel


def piecewise_buckets(max_tokens: int, fine_step: int = 8, fine_limit: int = 256) -> list[int]:
    """Token counts to capture: steps of ``fine_step`` up to ``fine_limit``, then of an eighth of
    the size (a power of two), so padding stays under 12.5%; ending at ``max_tokens``.

    max_tokens 2048: 8, 16, ..., 256, 288, ..., 512, 576, ..., 1024, 1152, ..., 2048 (56 sizes)."""
    sizes: list[int] = []
    b = fine_step
    while b < max_tokens:
        sizes.append(b)
        b += fine_step if b < fine_limit else 1 << ((b // 8).bit_length() - 1)
    sizes.append(max_tokens)
    return sizes


def _store(dst: torch.Tensor, src: torch.Tensor) -> None:
    # The C++ CPU ops update the residual in place, so it may already be the buffer.
    if src.data_ptr() != dst.data_ptr():
        dst.copy_(src)


@contextmanager
def _gc_frozen() -> Iterator[None]:
    """Older torch runs gc.collect() on entering every capture (~10-50 ms with the engine loaded;
    L + 1 graphs a size, dozens of sizes): frozen objects are not scanned, so each is cheap."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class PiecewiseGraphs:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        buckets: Sequence[int],
        capture: bool = True,
        pool: Any = None,  # a CUDA graph pool handle to share (torch.cuda.graph_pool_handle())
    ) -> None:
        """capture=False runs the same padded buffers and segments eagerly: the CPU tests use it to
        check everything of this class that does not need a GPU."""
        self.model = model
        self.kv_caches = kv_caches
        self.buckets = sorted(set(buckets))
        self.num_layers = len(model.layers)
        self.use_graphs = capture
        device, dtype = model.device, model.dtype
        n, hidden = self.buckets[-1], model.config.hidden_size
        self.input_ids = torch.full((n,), PAD_TOKEN_ID, dtype=torch.int64, device=device)
        self.positions = torch.full((n,), PAD_POSITION, dtype=torch.int64, device=device)
        self.qkv = torch.zeros((n, model.q_size + 2 * model.kv_size), dtype=dtype, device=device)
        self.residual = torch.zeros((n, hidden), dtype=dtype, device=device)
        self.attn = torch.zeros((n, model.q_size), dtype=dtype, device=device)
        self.out = torch.zeros((n, hidden), dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.pool = pool
        if capture:
            self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.buckets[-1]

    def bucket_for(self, num_tokens: int) -> int | None:
        """The smallest captured size >= num_tokens; None above the largest (the step runs eager)."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def _segment(self, i: int, b: int) -> None:
        """Graph i's work over the first b rows of the buffers (the table in the module docstring)."""
        model = self.model
        residual: torch.Tensor | None
        if i == 0:
            hidden, residual = model.embed(self.input_ids[:b]), None
        else:
            hidden, residual = model.post_attention(i - 1, self.attn[:b], self.residual[:b])
        if i == self.num_layers:
            assert residual is not None
            _store(self.out[:b], model.final_norm(hidden, residual))
            return
        qkv, residual = model.pre_attention(i, hidden, residual, self.positions[:b])
        _store(self.qkv[:b], qkv)
        _store(self.residual[:b], residual)

    @torch.inference_mode()
    @_gc_frozen()
    def _capture_all(self) -> None:
        # Largest first, so the smaller sizes fit in the pool the largest one reserved.
        for b in reversed(self.buckets):
            for i in range(self.num_layers + 1):
                self._segment(i, b)  # warm-up: Triton compiles, cuBLAS sets up, outside capture
            torch.cuda.synchronize()
            graphs = []
            for i in range(self.num_layers + 1):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self._segment(i, b)
                if self.pool is None:
                    self.pool = graph.pool()
                graphs.append(graph)
            self.graphs[b] = graphs
        torch.cuda.synchronize()

    @torch.inference_mode()
    def run(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        metadata: AttentionMetadata,  # the step's real (unpadded) metadata
    ) -> torch.Tensor:  # [T, hidden]: a view of a persistent buffer, valid until the next run
        num_tokens = metadata.num_tokens
        b = self.bucket_for(num_tokens)
        assert b is not None, f"{num_tokens} tokens exceed the largest captured size {self.max_tokens}"
        self.input_ids[:num_tokens].copy_(input_ids, non_blocking=True)
        self.positions[:num_tokens].copy_(positions, non_blocking=True)
        if b > num_tokens:
            self.input_ids[num_tokens:b].fill_(PAD_TOKEN_ID)
            self.positions[num_tokens:b].fill_(PAD_POSITION)
            self.attn[num_tokens:b].zero_()  # the earlier steps' attention rows
        for i, kv_cache in enumerate(self.kv_caches):
            self._run_segment(i, b)
            self.model.attention(i, self.qkv[:b], kv_cache, metadata, out=self.attn[:b])
        self._run_segment(self.num_layers, b)
        return self.out[:num_tokens]

    def _run_segment(self, i: int, b: int) -> None:
        if self.use_graphs:
            self.graphs[b][i].replay()
        else:
            self._segment(i, b)
