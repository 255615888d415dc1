"""A step's sampled tokens: on the device until the host asks for them (async scheduling waits late)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Per row, when params.logprobs is set: top-k token id -> logprob of the raw logits, plus the
    # sampled token's entry. None for rows that did not ask.
    logprobs: list[dict[int, float] | None]


@dataclass
class SampledTensors:
    """A step's sampling result still on the logits' device: nothing has waited for it yet.

    ``to_host`` is the one synchronisation point. Async scheduling first calls ``copy_to_host_async``
    (on CUDA: non-blocking copies into pinned memory, then an event), so the host goes on planning the
    next step and waits only when it needs the tokens; ``tokens`` stays on the device for the next
    step's inputs.
    """

    tokens: torch.Tensor  # [n] int64
    # Logprobs of the rows that asked (row indexes ``logprob_rows``, each wanting ``logprob_nums``
    # top entries): top-k values and ids [w, k], and the sampled token's logprob [w].
    logprob_rows: list[int]
    logprob_nums: list[int]
    top_vals: torch.Tensor | None = None
    top_ids: torch.Tensor | None = None
    sampled_logprobs: torch.Tensor | None = None
    _host: list[torch.Tensor] | None = None  # pinned copies of the four tensors above
    _copied: torch.cuda.Event | None = None

    def _tensors(self) -> list[torch.Tensor]:
        extra = [self.top_vals, self.top_ids, self.sampled_logprobs]
        return [self.tokens] + [t for t in extra if t is not None]

    def copy_to_host_async(self) -> None:
        if not self.tokens.is_cuda:
            return
        self._host = [_to_pinned(t) for t in self._tensors()]
        self._copied = torch.cuda.Event()
        self._copied.record(torch.cuda.current_stream(self.tokens.device))

    def to_host(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        # One device-to-host copy per tensor rather than one per element.
        lists = [t.tolist() for t in (self._host or self._tensors())]
        token_ids: list[int] = lists[0]
        logprobs: list[dict[int, float] | None] = [None] * len(token_ids)
        if len(lists) == 4:
            top_vals, top_ids, sampled = lists[1], lists[2], lists[3]
            for j, (i, num) in enumerate(zip(self.logprob_rows, self.logprob_nums, strict=True)):
                entry = dict(zip(top_ids[j][:num], top_vals[j][:num], strict=True))
                entry[token_ids[i]] = sampled[j]
                logprobs[i] = entry
        return SamplerOutput(token_ids, logprobs)


def index_on(rows: list[int], device: torch.device) -> torch.Tensor:
    """Row indexes on ``device``. On CUDA through pinned memory: indexing with a Python list copies
    it synchronously, which would make the host wait for the step (async scheduling)."""
    host = torch.tensor(rows, dtype=torch.int64)
    return host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host


def _to_pinned(t: torch.Tensor) -> torch.Tensor:
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)
