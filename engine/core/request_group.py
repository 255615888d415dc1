"""A caller's request on the client's side: its n sequences' detokenizers, gathered into one output.

The core reports each sequence apart (``SeqOutput``); a caller sees one ``RequestOutput`` per request
and step, holding the delta of every sequence that moved, and ``finished`` once every sequence's end
has gone out.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import RequestRecord
from engine.outputs import CompletionOutput, PromptLogprobList, RequestOutput
from engine.sampling.detokenizer import IncrementalDetokenizer


@dataclass
class SeqState:
    """One sequence as the client knows it."""

    index: int
    detok: IncrementalDetokenizer
    stop: str | None = None  # a stop string ended its text: waiting for the core to confirm the finish
    reported_finished: bool = False
    record: RequestRecord | None = None  # the core's record of it, once finished


@dataclass
class RequestGroup:
    """A caller's request: its n sibling sequences sharing one prompt (or the subset still to run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: dict[int, SeqState]  # by completion index, in index order
    error: str | None = None
    error_param: str | None = None
    completions: dict[int, CompletionOutput] = field(default_factory=dict)  # this step's, by index
    # The prompt's logprobs (when asked for): set from the first sequence that brings them, sent in
    # the next delta only.
    prompt_logprobs: PromptLogprobList | None = None
    prompt_logprobs_sent: bool = False

    @property
    def all_reported(self) -> bool:
        """Every sequence's end has gone out: the group can be forgotten."""
        return all(seq.reported_finished for seq in self.seqs.values())

    def delta_output(self) -> RequestOutput:
        """This step's deltas (in index order), then cleared for the next step."""
        completions = [self.completions[i] for i in sorted(self.completions)]
        self.completions.clear()
        finished = self.all_reported
        first = next(iter(self.seqs.values()))
        prompt_logprobs = None
        if self.prompt_logprobs is not None and not self.prompt_logprobs_sent:
            prompt_logprobs, self.prompt_logprobs_sent = self.prompt_logprobs, True
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=first.record if finished else None,
            error=self.error,
            error_param=self.error_param,
            prompt_logprobs=prompt_logprobs,
        )
