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
import gc
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch

from engine.config import EngineConfig
from engine.distributed.parallel_state import RankFailure, TensorParallel
from engine.distributed.pipe import write_message

log = logging.getLogger(__name__)

START_TIMEOUT_S = 300.0  # for every rank to start (a process, torch imported) and reach the group


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


def join_group(
    device: torch.device,
    rank: int,
    size: int,
    port: int,
    timeout_s: float,
    alive: Callable[[], None] | None = None,
) -> TensorParallel:
    """Join the tensor-parallel group (all ranks on this host): NCCL for the all-reduces on CUDA with a
    gloo group beside it for host-side agreement, gloo for both on a CPU.

    Rank 0 first waits, up to ``START_TIMEOUT_S`` and calling ``alive()`` (which raises for a rank
    that exited) meanwhile, for every rank to reach this point: starting a rank (importing torch)
    may take longer than a collective is allowed to.
    """
    import torch.distributed as dist
    from torch._C._distributed_c10d import TCPStore

    if dist.is_initialized():
        # The group of an engine that was dropped but not yet collected (a reference cycle): its
        # finaliser (ModelRunner) ends its ranks and leaves the group.
        gc.collect()
        if dist.is_initialized():
            raise RuntimeError(
                "another tensor-parallel engine is running in this process; close it (or delete it) first"
            )

    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # every rank is on this host
    store = TCPStore(
        "127.0.0.1",
        port,
        size,
        is_master=rank == 0,
        timeout=timedelta(seconds=START_TIMEOUT_S),
        wait_for_workers=False,  # rank 0 waits below, watching that the ranks are still alive
    )
    if rank == 0:
        keys = [f"rank{r}" for r in range(1, size)]
        deadline = time.monotonic() + START_TIMEOUT_S
        while not store.check(keys):
            if alive is not None:
                alive()
            if time.monotonic() > deadline:
                raise RankFailure(f"tensor-parallel ranks did not start within {START_TIMEOUT_S:.0f} s")
            time.sleep(0.05)
    else:
        store.set(f"rank{rank}", "up")
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        # Rank r on GPU r unless told otherwise ("cuda" alone names no GPU, and set_device needs one).
        torch.cuda.set_device(device if device.index is not None else torch.device("cuda", rank))
        dist.init_process_group("nccl", store=store, rank=rank, world_size=size, timeout=timeout)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
        return TensorParallel(rank, size, dist.group.WORLD, cpu_group)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    return TensorParallel(rank, size, dist.group.WORLD, dist.group.WORLD)


class RankSet:
    """Ranks 1..N-1, as rank 0 sees them."""

    def __init__(self, config: EngineConfig, timeout_s: float) -> None:
        size = config.tensor_parallel_size
        port = _free_port()
        threads = torch.get_num_threads()
        if config.device.type == "cpu":
            # The ranks share this host's cores: each takes its part of the threads this process had
            # (rank 0 included), rather than N ranks each spinning on all of them.
            threads = max(1, threads // size)
            torch.set_num_threads(threads)
        self.procs: list[subprocess.Popen[bytes]] = []
        self._closing = False
        try:
            for rank in range(1, size):
                proc = subprocess.Popen(
                    [sys.executable, "-m", "engine.distributed.rank_main"], stdin=subprocess.PIPE
                )
                self.procs.append(proc)
                assert proc.stdin is not None
                try:
                    write_message(proc.stdin, RankInit(config, rank, port, threads, timeout_s))
                except OSError as exc:  # it exited before reading its first message
                    code = proc.wait()
                    raise RankFailure(
                        f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
                    ) from exc
            self.tp = join_group(config.device, 0, size, port, timeout_s, alive=self.check)
        except BaseException:
            self.close()
            raise
        log.info(
            "tensor parallel: %d ranks (%s, %d torch threads each), rank pids %s",
            size,
            config.device.type,
            threads,
            self.pids,
        )

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self) -> None:
        """Raise RankFailure if a rank has exited."""
        for rank, proc in enumerate(self.procs, start=1):
            code = proc.poll()
            if code is not None:
                raise RankFailure(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}")

    def watch(self, on_death: Callable[[str], None], grace_s: float = 1.0) -> None:
        """Call ``on_death(reason)`` from a daemon thread when a rank exits while not closing. It waits
        ``grace_s`` first: a rank that dies inside a step is reported by that step's ``RankFailure``."""

        def wait_for(rank: int, proc: subprocess.Popen[bytes]) -> None:
            code = proc.wait()
            if self._closing:
                return
            reason = f"tensor-parallel rank {rank} (pid {proc.pid}) exited with code {code}"
            log.error("%s: the engine cannot continue", reason)
            time.sleep(grace_s)
            on_death(reason)

        for rank, proc in enumerate(self.procs, start=1):
            name = f"inflight-tp-watch-{rank}"
            threading.Thread(target=wait_for, args=(rank, proc), name=name, daemon=True).start()

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
        ``wait_s`` (one stuck in a collective) is killed. Once only: a later call (the finaliser of an
        engine closed before) must not leave the group another engine has joined since."""
        if self._closing:
            return
        self._closing = True
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
