"""A caller's request inside the engine: its n sibling sequences, their detokenizers, their deltas."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.metrics import RequestRecord
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampling.detokenizer import IncrementalDetokenizer

# Per sequence id: (new text, new token or None, its logprobs or None).
Deltas = dict[str, tuple[str, int | None, dict[int, float] | None]]


@dataclass
class RequestGroup:
    """A caller's request: its n sibling sequences sharing one prompt (or the subset still to run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: dict[int, IncrementalDetokenizer]  # by completion index
    reported_finished: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reported_finished = {child.index: False for child in self.children}

    @property
    def all_reported(self) -> bool:
        """Every sequence's end has gone out: the group can be forgotten."""
        return all(self.reported_finished.values())

    def delta_output(self, deltas: Deltas) -> RequestOutput:
        """The delta of the sequences that got a token, plus each newly finished one, once."""
        completions = []
        for child in self.children:
            text, token, lp = deltas.get(child.request_id, ("", None, None))
            if token is None and not (child.finished and not self.reported_finished[child.index]):
                continue
            if child.finished:
                self.reported_finished[child.index] = True
            completions.append(
                CompletionOutput(
                    index=child.index,
                    text=text,
                    token_ids=[] if token is None else [token],
                    finish_reason=child.status.finish_reason,
                    stop_reason=child.stop_reason,
                    logprobs=None if lp is None else [lp],
                    num_output_tokens=child.num_output_tokens,
                )
            )
        finished = self.all_reported
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=completions,
            finished=finished,
            metrics=RequestRecord.from_request(self.children[0]) if finished else None,
            error=next((c.error for c in self.children if c.error), None),
            error_param=next((c.error_param for c in self.children if c.error_param), None),
        )
