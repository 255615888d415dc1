"""Whether the engine overlaps step N+1's host work with step N's model execution (async scheduling).

With it on, the scheduler plans step N+1 while step N runs, assuming every request that samples in
step N gets exactly one token (a placeholder); the tokens arrive one step late. See
engine/sched/async_scheduler.py (the bookkeeping) and engine/runner/step_overlap.py (the execution).

The automatic rule (``async_scheduling=None``):
  * CUDA: on. The host only launches kernels; the GPU runs them while the host plans the next step.
  * CPU: off. There the "device" is the CPU itself: the forward and sampling run on a second thread
    while the engine thread schedules and packs the next step, which could only pay with a core free
    for the engine thread. Measured on a 2-core AVX-512 host with one torch thread (bench peers
    --async-scheduling both, the bench preset): float32 0.96x / 0.85x, bfloat16 1.06x / 1.15x tok/s
    at 64 / 16 sequences, with the process's load at 0.9-1.0 either way: the model's Python between
    ops holds the GIL, so the two threads take turns rather than overlap. ``async_scheduling=True``
    still runs it (the outputs are the same as the synchronous path's).
"""

from __future__ import annotations

import logging

import torch

from engine.platform.threads import physical_cores

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
    if threads >= num_cores:
        return False, f"auto: off on CPU ({threads} torch threads take all {num_cores} cores)"
    # A free core is not enough: the forward thread's Python holds the GIL (see the module's note).
    return False, "auto: off on CPU (measured no steady gain; async_scheduling=True turns it on)"
