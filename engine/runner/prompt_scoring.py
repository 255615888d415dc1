"""Prompt logprobs in the runner: which positions of a step score the next prompt token, and their
top-k, for the requests that ask (``SamplingParams.prompt_logprobs``).

Only those requests' prefill positions get logits: the rest of the step computes logits for its
sampling positions alone, as before. See engine/prompt_logprobs.py for the index arithmetic.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import torch

from engine.prompt_logprobs import PromptLogprobs
from engine.runner.input_batch import CachedRequestState

# Logits rows per block: a long prompt chunk is scored in blocks, so its [rows, V] logits stay bounded
# (512 rows of a 152k vocabulary in float32: about 300 MB) whatever the step's token budget.
SCORE_ROWS = 512


@dataclass
class PromptSlice:
    req_id: str
    first: int  # the prompt index of the first token this slice scores (>= 1)
    count: int  # tokens scored
    num_top: int  # the request's k


@dataclass
class PromptPlan:
    slices: list[PromptSlice]
    indices: np.ndarray  # [M] int64: flat step positions whose logits score a prompt token
    targets: np.ndarray  # [M] int64: the prompt token each scores

    @property
    def num_top(self) -> int:
        return max(s.num_top for s in self.slices)


def plan_prompt_scoring(
    states: list[CachedRequestState], computed: np.ndarray, num_sched: np.ndarray, starts: np.ndarray
) -> PromptPlan | None:
    """The step's prompt-scoring positions. ``computed``, ``num_sched``, ``starts``: per request (in
    ``states`` order) its computed tokens, tokens this step and first flat index. None: nobody asks."""
    slices: list[PromptSlice] = []
    indices: list[np.ndarray] = []
    targets: list[np.ndarray] = []
    for i, state in enumerate(states):
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        prompt = state.prompt_token_ids
        c = int(computed[i])
        end = min(c + int(num_sched[i]), len(prompt) - 1)  # positions [c, end) score tokens c+1..end
        if end <= c:
            continue
        slices.append(PromptSlice(state.req_id, c + 1, end - c, k))
        indices.append(int(starts[i]) + np.arange(end - c, dtype=np.int64))
        targets.append(np.asarray(prompt[c + 1 : end + 1], dtype=np.int64))
    if not slices:
        return None
    return PromptPlan(slices, np.concatenate(indices), np.concatenate(targets))


@dataclass
class PromptScores:
    """A step's prompt scores, still on the device until ``to_host`` (after the step is done)."""

    plan: PromptPlan
    top_vals: torch.Tensor  # [M, k]
    top_ids: torch.Tensor  # [M, k]
    target_logprobs: torch.Tensor  # [M]
    target_ranks: torch.Tensor  # [M]
    copied: torch.cuda.Event | None = None  # CUDA: the host copies above are done when it is

    def to_host(self) -> dict[str, PromptLogprobs]:
        if self.copied is not None:
            self.copied.synchronize()
        vals, ids = self.top_vals.tolist(), self.top_ids.tolist()
        tlp, ranks = self.target_logprobs.tolist(), self.target_ranks.tolist()
        targets = self.plan.targets.tolist()
        out: dict[str, PromptLogprobs] = {}
        row = 0
        for s in self.plan.slices:
            chunk = PromptLogprobs(s.first)
            for r in range(row, row + s.count):
                chunk.token_ids.append([targets[r], *ids[r][: s.num_top]])
                chunk.logprobs.append([tlp[r], *vals[r][: s.num_top]])
                chunk.ranks.append(int(ranks[r]))
            out[s.req_id] = chunk
            row += s.count
        return out


def blocks(indices: np.ndarray, device: torch.device) -> Iterator[torch.Tensor]:
    """``indices`` in blocks of SCORE_ROWS, on ``device``: every tensor-parallel rank gathers its
    logits in these same blocks."""
    for start in range(0, len(indices), SCORE_ROWS):
        yield torch.from_numpy(indices[start : start + SCORE_ROWS]).to(device)


def score_prompt(
    hidden: torch.Tensor, plan: PromptPlan, compute_logits: Callable[[torch.Tensor], torch.Tensor]
) -> PromptScores:
    """Log-softmax of the raw logits at ``plan.indices`` (before any sampling knob): the actual
    token's logprob and rank, and the top-k. ``hidden``: the step's [T, hidden] states."""
    parts: list[list[torch.Tensor]] = [[], [], [], []]
    targets = torch.from_numpy(plan.targets).to(hidden.device)
    start = 0
    for index in blocks(plan.indices, hidden.device):
        logits = compute_logits(hidden.index_select(0, index))  # [m, V]
        logprobs = torch.log_softmax(logits.float(), dim=-1)
        target = logprobs.gather(1, targets[start : start + len(index), None])  # [m, 1]
        ranks = (logprobs > target).sum(dim=-1) + 1  # [m]: 1 + tokens strictly more likely
        top_vals, top_ids = logprobs.topk(plan.num_top, dim=-1)  # k == 0 gives [m, 0]
        for part, t in zip(parts, (top_vals, top_ids, target.squeeze(1), ranks), strict=True):
            part.append(t)
        start += len(index)
    tensors = [torch.cat(part) for part in parts]
    copied = None
    if hidden.device.type == "cuda":
        # Queued behind the step, read when the step is collected: no wait on the engine thread.
        tensors = [t.to("cpu", non_blocking=True) for t in tensors]
        copied = torch.cuda.Event()
        copied.record()
    top_vals, top_ids, target_logprobs, target_ranks = tensors
    return PromptScores(plan, top_vals, top_ids, target_logprobs, target_ranks, copied)
