"""What one scheduling decision hands to the model runner: plain data, no live ``Request`` objects.

The runner keeps its own copy of every request it runs (tokens, block table, sampling settings). A
request reaches it once in full (``NewRequestData``: when first scheduled after admission or
re-admission) and afterwards as a per-step diff (``CachedRequestData``: the blocks allocated since, the
computed-token count). The runner appends the tokens it samples itself, so they never travel back.
Nothing here points into the scheduler or the KV cache manager: the runner can be tested alone, from
hand-built outputs, and could live in another process or rank.

Example, block_size 4: A (prompt of 6) is admitted in step 1 and prefills 6 tokens, then decodes:
    step 1  new    A  token_ids=[6 prompt ids]  block_ids=[7, 3]  num_computed_tokens=0  scheduled 6
    step 2  cached A  new_block_ids=[]          num_computed_tokens=6                   scheduled 1
    step 3  cached A  new_block_ids=[]          num_computed_tokens=7                   scheduled 1
    step 4  cached A  new_block_ids=[9]         num_computed_tokens=8   (position 8 needs a third block)
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner does not hold yet: everything it needs, sent once."""

    req_id: str
    prompt_token_ids: list[int]
    # Outputs the request already has: a resumed stream's tokens, or those generated before a preemption.
    output_token_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # sampling draws depend on (seed, output position) only
    eos_token_id: int | None
    block_ids: list[int]  # its whole block table so far (prefix-cache hits first)
    num_computed_tokens: int  # tokens whose K/V is already in the cache (prefix hits)


@dataclass(frozen=True)
class CachedRequestData:
    """A request the runner holds: what changed since the previous step that scheduled it."""

    req_id: str
    new_block_ids: list[int]  # appended to its block table
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    # Requests the runner must (re)build a row for; their tokens are scheduled this step.
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    # Requests the runner already holds that are scheduled this step.
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    # request id -> tokens to compute this step (a prefill chunk, or 1 for a decode), in batch order:
    # the runner packs the requests' tokens in this order.
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    # Admitted this step from WAITING or PREEMPTED. (A static batch may admit a request it schedules
    # only in a later step: that step sends it to the runner as new.)
    new_req_ids: list[str] = field(default_factory=list)
    # Prompt tokens of admitted requests served by the prefix cache instead of computed.
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    # Pushed back to waiting this step; their blocks are already freed (the runner drops their rows).
    preempted_req_ids: list[str] = field(default_factory=list)
    # Finished since the previous step (the runner drops their rows).
    finished_req_ids: set[str] = field(default_factory=set)
    # slo policy: the calibrated cost model's time for this step, which the engine compares with the
    # step's measured time (Scheduler.observe_step_time); 0 when nothing measures the host's speed.
    modelled_s: float = 0.0

    @property
    def num_seqs(self) -> int:
        return len(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0

    def is_decode_only(self) -> bool:
        return all(n == 1 for n in self.num_scheduled_tokens.values()) and not self.is_empty

    def batch(self) -> Iterator[tuple[str, int, int]]:
        """(request id, tokens scheduled, tokens computed before this step) in batch order."""
        computed = {r.req_id: r.num_computed_tokens for r in self.scheduled_new_reqs}
        computed.update((r.req_id, r.num_computed_tokens) for r in self.scheduled_cached_reqs)
        for req_id, num_tokens in self.num_scheduled_tokens.items():
            yield req_id, num_tokens, computed[req_id]
