"""Offline API: ``LLM(model=path, **engine_args).generate(prompts, sampling_params)``."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine, Prompt
from engine.outputs import ChoiceAccumulator, CompletionOutput, PromptLogprobList, RequestOutput
from engine.platform.threads import limit_torch_threads
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str, **engine_args: Any) -> None:
        # At most one torch thread per core this process may use (engine/platform/threads.py); a lower count
        # set beforehand with torch.set_num_threads, or OMP_NUM_THREADS, stands.
        limit_torch_threads()
        self.engine = LLMEngine.from_engine_args(model, **engine_args)
        self._ids = itertools.count()

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; results in input order, with cumulative text and tokens."""
        batch = _as_prompt_list(prompts)
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params or SamplingParams()] * len(batch)
        else:
            params = list(sampling_params)
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} sampling params for {len(batch)} prompts")
        ids = [f"llm-{next(self._ids)}" for _ in batch]
        for i, (request_id, prompt, p) in enumerate(zip(ids, batch, params, strict=True)):
            try:
                request = EngineRequest(request_id, prompt, p, priority=priority[i] if priority else 0)
                self.engine.add_request(request)
            except Exception:
                for added in ids[:i]:
                    self.engine.abort_request(added)
                while self.engine.has_unfinished_requests():  # flush the aborts' final outputs
                    self.engine.step()
                raise
        results = {request_id: _Accumulator() for request_id in ids}
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                results[out.request_id].add(out)
        return [results[request_id].result() for request_id in ids]


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and all(isinstance(t, int) for t in prompts):
        return [list(prompts)]  # type: ignore[arg-type]
    return list(prompts)  # type: ignore[arg-type]


class _Accumulator:
    """Folds a request's delta outputs into one cumulative RequestOutput."""

    def __init__(self) -> None:
        self.last: RequestOutput | None = None
        self.choices: ChoiceAccumulator[dict[int, float]] = ChoiceAccumulator()
        self.num_output_tokens: dict[int, int] = {}
        self.prompt_logprobs: PromptLogprobList | None = None

    def add(self, out: RequestOutput) -> None:
        self.last = out
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        for d in out.outputs:
            self.choices.add(d.index, d.token_ids, d.text, d.finish_reason, d.stop_reason, d.logprobs)
            self.num_output_tokens[d.index] = d.num_output_tokens

    def result(self) -> RequestOutput:
        assert self.last is not None and self.last.finished
        out = self.last
        out.outputs = [
            CompletionOutput(
                index=i,
                text=c.text,
                token_ids=c.token_ids,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                logprobs=c.logprobs or None,
                num_output_tokens=self.num_output_tokens[i],
            )
            for i, c in sorted(self.choices.choices.items())
        ]
        out.prompt_logprobs = self.prompt_logprobs
        return out
