"""Whether the engine overlaps step N+1's host work with step N's model execution (async scheduling).

With it on, the scheduler plans step N+1 while step N runs, assuming every request that samples in
step N gets exactly one token (a placeholder); the tokens arrive one step late. See
engine/sched/async_scheduler.py (the bookkeeping) and engine/worker/overlap.py (the execution).

The automatic rule (``async_scheduling=None``):
  * CUDA: on. The host only launches kernels; the GPU runs them while the host plans the next step.
  * CPU: the "device" is the CPU itself, so the model's forward and sampling run on a second thread
    (torch's ops release the GIL) while the engine thread schedules and packs the next step. That
    only pays when there is a core for the engine thread: on when torch's intra-op threads leave at
    least one of this process's cores free, off when they take every core (the two threads would
    then fight over the same cores and each step would get slower, not hidden).
"""

from __future__ import annotations

import logging

import torch

from engine.platform import physical_cores

log = logging.getLogger(__name__)


def decide_async_scheduling(
    requested: bool | None,
    device: torch.device,
    *,
    torch_threads: int | None = None,
    cores: int | None = None,
) -> tuple[bool, str]:
    """(on, why). ``torch_threads`` / ``cores`` default to this process's; tests pass their own."""
    if requested is not None:
        return requested, "set explicitly"
    if device.type == "cuda":
        return True, "auto: on for CUDA (the host plans while the GPU runs)"
    threads = torch.get_num_threads() if torch_threads is None else torch_threads
    num_cores = physical_cores() if cores is None else cores
    if threads < num_cores:
        return True, f"auto: {threads} torch threads leave {num_cores - threads} of {num_cores} cores free"
    return False, f"auto: {threads} torch threads take all {num_cores} cores, none left for the host work"
