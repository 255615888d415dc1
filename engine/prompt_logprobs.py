"""Prompt logprobs as data: what the runner scores per prefill chunk and the core gathers per request.

Prompt token ``i`` (``i >= 1``) is scored by the logits at position ``i - 1``; token 0 has nothing
before it (its entry is None, as in vLLM). A chunk computing positions ``[c, c + n)`` of a prompt of
``P`` tokens therefore scores tokens ``c + 1 .. min(c + n, P - 1)``: the logits at ``P - 1`` are the
sampling position, which scores the first output token instead.

Example, P = 5, chunks of 3: chunk [0, 3) scores tokens 1, 2, 3; chunk [3, 5) scores token 4 (its
position 4 samples). The core appends each chunk's entries in order, so a recomputed chunk (after
preemption) adds nothing it already has.

Torch-free: the struct crosses the core's pipe inside ``SeqOutput``.
"""

from __future__ import annotations

import msgspec


class PromptLogprobs(msgspec.Struct, array_like=True):
    """Entries for prompt tokens ``first .. first + len(ranks) - 1``.

    Per entry: ``token_ids`` holds the actual prompt token, then the top-k ids; ``logprobs`` their
    log-probabilities (log_softmax of the raw logits, as for generated tokens); ``ranks`` the actual
    token's rank in the vocabulary (1: the most likely). Top entry ``j`` has rank ``j + 1``.
    """

    first: int
    token_ids: list[list[int]] = msgspec.field(default_factory=list)
    logprobs: list[list[float]] = msgspec.field(default_factory=list)
    ranks: list[int] = msgspec.field(default_factory=list)

    @property
    def end(self) -> int:
        """The prompt index after the last entry."""
        return self.first + len(self.ranks)

    def extend(self, chunk: PromptLogprobs) -> None:
        """Append a later chunk's entries, skipping those already held (a recomputed chunk)."""
        skip = self.end - chunk.first
        if skip < 0:
            raise ValueError(f"prompt logprobs chunk starts at {chunk.first}, expected {self.end}")
        self.token_ids.extend(chunk.token_ids[skip:])
        self.logprobs.extend(chunk.logprobs[skip:])
        self.ranks.extend(chunk.ranks[skip:])

    def entries(self) -> list[dict[int, tuple[float, int]] | None]:
        """One per prompt token from 0: None for token 0, else token id -> (logprob, rank)."""
        out: list[dict[int, tuple[float, int]] | None] = [None]
        for ids, lps, rank in zip(self.token_ids, self.logprobs, self.ranks, strict=True):
            entry = {tok: (lp, j) for j, (tok, lp) in enumerate(zip(ids[1:], lps[1:], strict=True), 1)}
            entry[ids[0]] = (lps[0], rank)  # the prompt token itself, with its true rank
            out.append(entry)
        return out
