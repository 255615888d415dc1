"""The vocabulary-parallel embedding and LM head.

Tensor parallel, each rank holds rows [vocab_start, vocab_start + vocab_shard) of the table (the last
shard zero-padded): the embedding looks up its own ids and zeros the rest, the all-reduce leaves each
row with one rank's contribution; the LM head's logits are gathered where the sampler runs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.distributed.parallel_state import TensorParallel
from engine.layers.kernels import Kernels
from engine.layers.linear import SingleWeight, matmul
from engine.quant.channel import ChannelWeight
from engine.quant.gguf_weights import embedding_rows
from engine.quant.weight import QuantizedWeight


class VocabEmbedding:
    def __init__(
        self,
        table: SingleWeight,  # [vocab_shard, hidden]: float, or a block format (rows dequantised as read)
        tp: TensorParallel,
        vocab_shard: int,
        dtype: torch.dtype,
        scale: float | None = None,
    ) -> None:
        self.table = table
        self.dtype = dtype
        self.tp = tp
        self.vocab_start = tp.rank * vocab_shard
        self.vocab_shard = vocab_shard
        # Gemma multiplies by sqrt(hidden) rounded to the model's dtype first (HF's normalizer);
        # Granite by its embedding_multiplier.
        self.scale = None if scale is None else torch.tensor(scale, dtype=dtype, device=table.device)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        if isinstance(self.table, QuantizedWeight):  # tensor parallel refuses block formats
            hidden = embedding_rows(self.table, input_ids).to(self.dtype)
        elif isinstance(self.table, ChannelWeight):  # and per-channel 8-bit weights
            rows = input_ids.long()
            hidden = (self.table.qweight[rows].float() * self.table.scale[rows, None]).to(self.dtype)
        elif not self.tp.enabled:
            hidden = F.embedding(input_ids, self.table)
        else:
            local = input_ids - self.vocab_start
            outside = (local < 0) | (local >= self.vocab_shard)
            hidden = F.embedding(local.masked_fill(outside, 0), self.table)
            hidden.masked_fill_(outside.unsqueeze(-1), 0.0)
            hidden = self.tp.all_reduce(hidden)
        return hidden if self.scale is None else hidden * self.scale


class LMHead:
    """[N, hidden] -> [N, vocab] float32 logits, divided by ``logits_scaling`` (Granite) and
    soft-capped (Gemma 2: ``cap * tanh(logits / cap)``)."""

    def __init__(
        self,
        weight: SingleWeight,  # [vocab_shard, hidden]; the embedding's table when tied
        kernels: Kernels,
        tp: TensorParallel,
        vocab_size: int,
        *,
        soft_cap: float | None = None,
        scaling: float = 1.0,
    ) -> None:
        self.weight = weight if isinstance(weight, QuantizedWeight | ChannelWeight) else kernels.pack(weight)
        self.kernels = kernels
        self.tp = tp
        self.vocab_size = vocab_size
        self.soft_cap = soft_cap
        self.scaling = scaling
        self._float_logits: torch.Tensor | None = None  # float32 logits kept from step to step on CPU

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        n = hidden.shape[0]
        padded = self.kernels.padded_rows(n)
        if padded > n:
            hidden = F.pad(hidden, (0, 0, 0, padded - n))
        logits = matmul(hidden, self.weight, None, self.kernels)[:n]
        if self.tp.enabled:
            gathered = self.tp.gather_vocab(logits, self.vocab_size)
            logits = logits if gathered is None else gathered
        logits = self._to_float(logits)
        if self.scaling != 1.0:
            logits.div_(self.scaling)
        if self.soft_cap is not None:
            logits.div_(self.soft_cap).tanh_().mul_(self.soft_cap)
        return logits

    def _to_float(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dtype == torch.float32 or logits.device.type != "cpu":
            return logits.float()
        # On CPU, into memory kept from step to step: a fresh [rows, vocab] float32 tensor is mapped
        # and page-faulted in anew each time (glibc returns blocks this large to the OS when freed),
        # which cost 6-12 ms of an ~80 ms bf16 decode step at 64 rows (SmolLM2, one thread) against
        # 0.5 ms into pages already mapped. The sampler reads the logits within the step and keeps
        # only tensors of its own, so the next step may overwrite them.
        n, vocab = logits.shape
        buf = self._float_logits
        if buf is None or buf.shape[0] < n or buf.shape[1] != vocab:
            buf = self._float_logits = torch.empty(max(n, self.kernels.prepack_rows), vocab)
        return buf[:n].copy_(logits)
