"""The runner's own copy of the requests it runs: persistent host-side rows of token ids and block tables.

A request gets a row when it arrives as ``NewRequestData`` and keeps it until it finishes or is
preempted. Each step only appends what changed (the blocks in ``CachedRequestData``, the token the
runner itself sampled), so building a step's inputs is a handful of numpy gathers, and the runner never
reads the scheduler's ``Request`` objects or the KV cache manager.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from engine.sampling_params import SamplingParams
from engine.sched.output import CachedRequestData, NewRequestData

if TYPE_CHECKING:
    from engine.structured.grammar import GrammarState

PLACEHOLDER = -1  # an output token not known yet (async scheduling); never a vocabulary id


@dataclass
class CachedRequestState:
    """What the runner knows of one request: enough to build its inputs and sample its next token."""

    req_id: str
    row: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # grows by the tokens this runner samples
    sampling_params: SamplingParams
    seed: int
    eos_token_id: int | None
    num_computed_tokens: int  # as of the step that last scheduled it
    # Structured outputs: the row's matcher, new with the row (a preempted request replays its tokens).
    grammar: GrammarState | None = None


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens written into each row
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.requests: dict[str, CachedRequestState] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    @property
    def row_of(self) -> dict[str, int]:
        return {req_id: state.row for req_id, state in self.requests.items()}

    def add(self, new: NewRequestData) -> CachedRequestState:
        if new.req_id in self.requests:
            self.remove(new.req_id)
        if not self._free_rows:
            raise RuntimeError("more running requests than max_num_seqs rows")
        row = self._free_rows.pop()
        state = CachedRequestState(
            req_id=new.req_id,
            row=row,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            seed=new.seed,
            eos_token_id=new.eos_token_id,
            num_computed_tokens=new.num_computed_tokens,
        )
        self.requests[new.req_id] = state
        tokens = state.prompt_token_ids + state.output_token_ids
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.block_table[row, : len(new.block_ids)] = new.block_ids
        self.num_blocks[row] = len(new.block_ids)
        return state

    def update(self, cached: CachedRequestData) -> None:
        state = self.requests[cached.req_id]
        state.num_computed_tokens = cached.num_computed_tokens
        if cached.new_block_ids:
            row, nb = state.row, int(self.num_blocks[state.row])
            self.block_table[row, nb : nb + len(cached.new_block_ids)] = cached.new_block_ids
            self.num_blocks[row] = nb + len(cached.new_block_ids)

    def append_token(self, state: CachedRequestState, token_id: int) -> None:
        """A token this runner sampled: the request's next input (the scheduler appends it too)."""
        n = int(self.num_tokens[state.row])
        self.token_ids[state.row, n] = token_id
        self.num_tokens[state.row] = n + 1
        state.output_token_ids.append(token_id)

    def append_placeholder(self, state: CachedRequestState) -> int:
        """Async scheduling: room for the token a step in flight will sample. Returns its position.

        The row holds 0 there (a valid id, never read as input: the device step that consumes it
        reads the sampled token on the device); the output list holds PLACEHOLDER until ``set_token``.
        """
        n = int(self.num_tokens[state.row])
        self.token_ids[state.row, n] = 0
        self.num_tokens[state.row] = n + 1
        state.output_token_ids.append(PLACEHOLDER)
        return n

    def set_token(self, state: CachedRequestState, position: int, token_id: int) -> None:
        """The real token for a placeholder, once its step has reported."""
        self.token_ids[state.row, position] = token_id
        state.output_token_ids[position - len(state.prompt_token_ids)] = token_id

    def remove(self, req_id: str) -> None:
        state = self.requests.pop(req_id, None)
        if state is not None:
            self._free_rows.append(state.row)
