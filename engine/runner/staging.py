"""Persistent host mirrors of the step's device inputs: one host copy and one async upload each.

Without them every input took numpy -> fresh tensor -> fresh pinned tensor -> fresh device tensor.
Here each input has a pinned host buffer and a device buffer, both allocated once at their maximum
size (flat, so any [rows, cols] prefix is contiguous):

    numpy array --(one cast-and-copy on the host)--> pinned[:n] --(async H2D)--> device[:n] (returned)

Reuse hazard: a step that samples nothing never waits for the GPU, so the next step could rewrite a
pinned buffer whose upload is still queued. An event recorded after the uploads is waited on before
the next write (it has normally long fired: the uploads run before the step's kernels).
Device buffers need no such care: the next upload is queued behind the kernels that read them.
"""

from __future__ import annotations

import numpy as np
import torch


class InputStaging:
    def __init__(self, sizes: dict[str, tuple[int, torch.dtype]], device: torch.device, pin: bool) -> None:
        """sizes: input name -> (most elements a step can need, dtype). pin=False (CPU tests) keeps
        the same buffers and logic in pageable memory."""
        self.device = device
        self.host = {name: torch.empty(n, dtype=dtype, pin_memory=pin) for name, (n, dtype) in sizes.items()}
        self.dev = {name: torch.empty(n, dtype=dtype, device=device) for name, (n, dtype) in sizes.items()}
        self._uploaded: torch.cuda.Event | None = None

    def fits(self, name: str, num_elements: int) -> bool:
        return num_elements <= self.host[name].numel()

    def begin(self) -> None:
        """Before the step's first stage(): the previous step's uploads have left the pinned buffers."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
            self._uploaded = None

    def stage(self, name: str, array: np.ndarray) -> torch.Tensor:
        """The device copy of ``array`` (same shape), through the persistent buffers."""
        n = array.size
        host = self.host[name][:n]
        host.numpy().reshape(array.shape)[...] = array  # casts to the buffer's dtype in the copy
        dev = self.dev[name][:n]
        dev.copy_(host, non_blocking=True)
        return dev.view(array.shape)

    def end(self) -> None:
        """After the step's last stage()."""
        if self.device.type == "cuda":
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()
