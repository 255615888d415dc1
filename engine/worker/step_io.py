"""What the runner hands around inside one step: its packed inputs, and what the engine gets back."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.backend import AttentionMetadata
from engine.worker.input_batch import CachedRequestState


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: the flat index of each sampling request's last token
    sampling_requests: list[CachedRequestState]  # the N requests that sample a token this step


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, dict[int, float]]  # request id -> top logprobs (when asked for)
    prepare_time: float = 0.0  # seconds spent updating rows and packing inputs (host side)
    # Seconds of packing, model and sampling, measured apart from the host's wait (async scheduling:
    # the step ran behind the engine thread); None: the caller's wall-clock around execute() is it.
    execute_time: float | None = None
