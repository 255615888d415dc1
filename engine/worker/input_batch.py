"""Persistent host-side rows of the running requests: their token ids and block tables.

A request keeps its row from admission until it finishes or is preempted, and each step only
appends what changed (new tokens, new blocks), so building a step's inputs is a handful of numpy
gathers instead of rebuilding Python lists.
"""

from __future__ import annotations

import numpy as np

from engine.request import Request


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # tokens written into each row
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.row_of

    def add(self, request: Request) -> int:
        if request.request_id in self.row_of:
            self.remove(request.request_id)
        if not self._free_rows:
            raise RuntimeError("more running requests than max_num_seqs rows")
        row = self._free_rows.pop()
        self.row_of[request.request_id] = row
        n = request.num_tokens
        self.token_ids[row, :n] = request.all_token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        return row

    def remove(self, request_id: str) -> None:
        row = self.row_of.pop(request_id, None)
        if row is not None:
            self._free_rows.append(row)

    def sync(self, request: Request, block_ids: list[int]) -> int:
        """Bring a row up to date with its request: tokens sampled since, blocks allocated since."""
        row = self.row_of[request.request_id]
        have = int(self.num_tokens[row])
        if request.num_tokens > have:
            self.token_ids[row, have : request.num_tokens] = request.all_token_ids[have:]
            self.num_tokens[row] = request.num_tokens
        nb = int(self.num_blocks[row])
        if len(block_ids) > nb:
            self.block_table[row, nb : len(block_ids)] = block_ids[nb:]
            self.num_blocks[row] = len(block_ids)
        return row
