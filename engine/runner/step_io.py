"""What the runner hands around inside one step: its packed inputs, and what the engine gets back."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engine.attention.backend import AttentionMetadata
from engine.prompt_logprobs import PromptLogprobs
from engine.runner.input_batch import CachedRequestState
from engine.runner.prompt_scoring import PromptPlan


@dataclass
class StepArrays:
    """A step's packed inputs as plain host data: what the runner turns into device tensors, and what
    rank 0 hands the other tensor-parallel ranks (which keep no request state of their own)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [S + 1] int64
    seq_lens: np.ndarray  # [S] int64
    block_tables: np.ndarray  # [S, max_blocks] int32
    slot_mapping: np.ndarray  # [T] int64
    logits_indices: np.ndarray  # [N] int64
    max_query_len: int
    decode_only: bool
    # [M] int64: positions whose logits score the next prompt token (prompt logprobs); None: none.
    prompt_logits_indices: np.ndarray | None = None


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    metadata: AttentionMetadata
    logits_indices: torch.Tensor  # [N] int64: the flat index of each sampling request's last token
    sampling_requests: list[CachedRequestState]  # the N requests that sample a token this step
    arrays: StepArrays | None = None  # kept by rank 0 of a tensor-parallel group only
    prompt_plan: PromptPlan | None = None  # the requests that score prompt tokens this step


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request id -> new token
    logprobs: dict[str, dict[int, float]]  # request id -> top logprobs (when asked for)
    prepare_time: float = 0.0  # seconds spent updating rows and packing inputs (host side)
    # Seconds of packing, model and sampling, measured apart from the host's wait (async scheduling:
    # the step ran behind the engine thread); None: the caller's wall-clock around execute() is it.
    execute_time: float | None = None
    # Request id -> the prompt logprobs this step's chunk scored (requests that ask only).
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)
