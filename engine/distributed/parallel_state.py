"""The tensor-parallel group a model shard runs in, passed explicitly (no global state).

At ``size == 1`` every collective is a no-op that returns its input, so the single-rank path pays
one attribute read per call and no copy.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch


class RankFailure(BaseException):
    """A rank died, hung past the collective timeout, or failed a step.

    A ``BaseException`` on purpose: the engine fails one step's requests on an ``Exception`` and keeps
    serving, but the ranks are then out of step for good (a collective half done), so this must
    stop the engine like a dead core does (the core reports it as ``CoreDied``).
    """


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # the all-reduce group (NCCL on CUDA, gloo on CPU); None at size 1
    cpu_group: Any = None  # a gloo group for host-side agreement (KV block counts)
    # Seconds spent inside all-reduces and the logits gather since the last reset (CPU only: on CUDA
    # the host just queues them, so a host clock would measure nothing).
    collective_s: float = field(default=0.0)
    timed: bool = False

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in place (the row-parallel layers' partial products)."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        start = time.perf_counter() if self.timed else 0.0
        try:
            dist.all_reduce(x, group=self.device_group)
        except RuntimeError as exc:  # gloo: a peer closed or the timeout passed
            raise RankFailure(f"tensor-parallel all-reduce failed on rank {self.rank}: {exc}") from exc
        if self.timed:
            self.collective_s += time.perf_counter() - start
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """[N, V / size] logits of this rank's vocabulary shard -> [N, V] on rank 0, None elsewhere."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        start = time.perf_counter() if self.timed else 0.0
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        try:
            dist.gather(local, parts, dst=0, group=self.device_group)
        except RuntimeError as exc:
            raise RankFailure(f"tensor-parallel logits gather failed on rank {self.rank}: {exc}") from exc
        if self.timed:
            self.collective_s += time.perf_counter() - start
        if parts is None:
            return None
        return torch.cat(parts, dim=-1)[:, :vocab_size]

    def agree_min(self, value: int) -> int:
        """The smallest of every rank's ``value`` (each rank sizes its KV cache from its own memory; the
        one scheduler needs one block count that fits them all)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        try:
            dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        except RuntimeError as exc:
            raise RankFailure(f"tensor-parallel start-up failed on rank {self.rank}: {exc}") from exc
        return int(t.item())


SINGLE = TensorParallel()
