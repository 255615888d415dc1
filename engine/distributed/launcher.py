"""Rank 0's side of tensor parallelism: start ranks 1..N-1, join the group, hand them each step.

Rank 0 lives in the engine's own process (the engine core) and runs the scheduler, the KV manager,
the sampler and its own shard; the other ranks are processes it starts (``python -m
engine.distributed.rank_main``), each running only its shard's forward. A plain subprocess rather
than multiprocessing: the engine core is itself a daemonic process, which multiprocessing forbids
to have children.

Failure: a rank that exits is seen before the next step is handed out, or by the collective it
leaves half done (gloo: the peer closed); a rank that hangs makes the collective time out
(``INFLIGHT_TP_TIMEOUT_S``). Either way rank 0 raises ``RankFailure``, which ends the engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import RankFailure, TensorParallel
from engine.distributed.pipe import write_message

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankInit:
    """The first message a rank reads: everything it needs to build its shard."""

    config: EngineConfig
    rank: int
    port: int
    torch_threads: int
    timeout_s: float


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def join_group(device: torch.device, rank: int, size: int, port: int, timeout_s: float) -> TensorParallel:
    """Join the tensor-parallel group (all ranks on this host): NCCL for the all-reduces on CUDA with a
    gloo group beside it for host-side agreement, gloo for both on a CPU."""
    import torch.distributed as dist

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    timeout = timedelta(seconds=timeout_s)
    init = f"tcp://127.0.0.1:{port}"
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", init_method=init, rank=rank, world_size=size, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return TensorParallel(rank, size, dist.group.WORLD, cpu_group)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=size, timeout=timeout)
    return TensorParallel(rank, size, dist.group.WORLD, dist.group.WORLD)


class RankSet:
    """Ranks 1..N-1, as rank 0 sees them."""

    def __init__(self, config: EngineConfig, timeout_s: float) -> None:
        size = config.tensor_parallel_size
        port = _free_port()
        threads = torch.get_num_threads()
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "engine.distributed.rank_main"], stdin=subprocess.PIPE
            )
            self.procs.append(proc)
            assert proc.stdin is not None
            write_message(proc.stdin, RankInit(config, rank, port, threads, timeout_s))
        try:
            self.tp = join_group(config.device, 0, size, port, timeout_s)
        except BaseException:
            self.close()
            raise
        log.info("tensor parallel: %d ranks (%s), rank pids %s", size, config.device.type, self.pids)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise RankFailure if a rank has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def broadcast(self, message: Any) -> None:
        """Hand every rank this step's input."""
        self.check()
        for rank, proc in enumerate(self.procs, start=1):
            assert proc.stdin is not None
            try:
                write_message(proc.stdin, message)
            except (BrokenPipeError, ConnectionResetError, OSError) as exc:
                raise RankFailure(f"tensor-parallel rank {rank} is gone: {exc}") from exc

    def close(self, wait_s: float = 10.0) -> None:
        """End the ranks: EOF on their pipes ends their loops; what is still running after
        ``wait_s`` (one stuck in a collective) is killed."""
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()
        for proc in self.procs:
            try:
                proc.wait(wait_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
