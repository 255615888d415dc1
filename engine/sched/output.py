"""What one scheduling decision hands to the model runner."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.request import Request


@dataclass
class SchedulerOutput:
    # Requests of this step in batch order; the runner packs their tokens in this order.
    scheduled: list[Request] = field(default_factory=list)
    # request id -> tokens to compute this step (a prefill chunk, or 1 for a decode).
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Admitted this step from WAITING or PREEMPTED (the runner (re)builds their rows).
    new_req_ids: list[str] = field(default_factory=list)
    # Prompt tokens of new requests served by the prefix cache instead of computed.
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # Pushed back to waiting this step; their blocks are already freed.
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the previous step (the runner drops their rows).
    finished_req_ids: set[str] = field(default_factory=set)

    @property
    def num_seqs(self) -> int:
        return len(self.scheduled)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_scheduled_tokens.values()) and not self.is_empty
