"""Output processing beside the client: token ids in, streamed text out (vLLM v1's OutputProcessor).

The core (``engine.core.engine_core``) returns token ids, the finish reasons it knows itself and
logprob ids. Everything that needs the tokenizer runs here, in the client's process (the worker, or
the in-process ``LLMEngine``), so none of it takes time from the model's process:

* ``prepare``: the prompt's token ids (text is encoded, chat templates rendered by the caller) and the
  tokenizer's eos ids, which the core stops at;
* ``process``: each sequence's detokenizer (held-back bytes, stop strings: only the new text and the
  longest stop's length are scanned), the grouping of n sequences into one ``RequestOutput``, and the
  final flush. A stop string found here finishes the sequence's text at once; the core is told through
  ``stop`` and its confirmation (the sequence's record) ends the sequence for the caller. A stop that
  answers at once (the in-process core) ends it within the same output.

One lock guards the state: a process client adds requests from its event loop and processes steps on
its reader thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import msgspec

from engine.core.messages import SeqOutput
from engine.core.request_group import RequestGroup, SeqState
from engine.inputs import EngineRequest, PromptLimits, prepare_prompt
from engine.outputs import CompletionOutput, Logprob, PromptLogprobList, RequestOutput
from engine.prompt_logprobs import PromptLogprobs
from engine.sampling.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

# Tell the core that a sequence's text hit stop string ``stop``: (request id, index, stop) -> the core's
# last output for it when it answers at once (in process), else None (it comes with a later step).
StopSequence = Callable[[str, int, str], SeqOutput | None]


class OutputProcessor:
    def __init__(
        self, tokenizer: Tokenizer | None, limits: PromptLimits, stop_sequence: StopSequence
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self._stop_sequence = stop_sequence
        self._groups: dict[str, RequestGroup] = {}
        self._lock = threading.Lock()

    @property
    def num_unfinished(self) -> int:
        return len(self._groups)

    def prepare(self, request: EngineRequest) -> EngineRequest:
        """The request as the core takes it: its prompt as token ids, with the tokenizer's eos ids."""
        ids = prepare_prompt(request.prompt, self.limits, self.tokenizer)
        eos = list(self.tokenizer.eos_token_ids) if self.tokenizer is not None else None
        return msgspec.structs.replace(request, prompt=ids, eos_token_ids=eos or request.eos_token_ids)

    def add(self, request: EngineRequest, prompt: str | None) -> None:
        """Track ``request`` (as ``prepare`` returned it, taken by the core); ``prompt``: its text."""
        params = request.params
        assert isinstance(request.prompt, list)
        ids = request.prompt
        indexes = list(range(params.n)) if request.indexes is None else sorted(set(request.indexes))
        by_index, every = request.resume_by_index, request.resume_token_ids
        seqs = {}
        for i in indexes:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            resumed = list(by_index.get(i, ()) if by_index is not None else every or ())
            if resumed:
                # Replay the tokens another engine already streamed, discarding their text, so the
                # detokenizer (held-back bytes, stop-string prefixes) continues exactly where it left off.
                detok.replay(resumed)
            seqs[i] = SeqState(i, detok)
        with self._lock:
            self._groups[request.request_id] = RequestGroup(request.request_id, prompt, ids, seqs)

    def forget(self, request_id: str) -> None:
        """The core refused the request (or the client gave it up): no output will come for it."""
        with self._lock:
            self._groups.pop(request_id, None)

    def process(self, outputs: Iterable[SeqOutput]) -> list[RequestOutput]:
        """A step's sequence outputs as one delta ``RequestOutput`` per request that moved."""
        with self._lock:
            touched: dict[str, RequestGroup] = {}
            for out in outputs:
                group = self._groups.get(out.request_id)
                if group is None:
                    continue  # refused, or forgotten: nobody reads it
                seq = group.seqs.get(out.index)
                if seq is None or seq.reported_finished:
                    continue  # tokens sampled after the client stopped it: not the caller's
                touched[group.request_id] = group
                self._apply(group, seq, out)
            results = [group.delta_output() for group in touched.values()]
            for group in touched.values():
                if group.all_reported:
                    del self._groups[group.request_id]
            return results

    def _decode_prompt_logprobs(self, scores: PromptLogprobs) -> PromptLogprobList:
        """The core's prompt logprob ids as vLLM shapes them, each token decoded on its own."""
        entries = scores.entries()
        ids = sorted({tok for e in entries if e is not None for tok in e})
        tok = self.tokenizer
        text = {i: tok.decode([i], skip_special_tokens=False) for i in ids} if tok is not None else {}
        return [
            None if e is None else {i: Logprob(lp, rank, text.get(i)) for i, (lp, rank) in e.items()}
            for e in entries
        ]

    def _apply(self, group: RequestGroup, seq: SeqState, out: SeqOutput) -> None:
        if out.prompt_logprobs is not None and group.prompt_logprobs is None:
            group.prompt_logprobs = self._decode_prompt_logprobs(out.prompt_logprobs)
        finish, stop_reason, last = out.finish_reason, out.stop_reason, out
        if seq.stop is not None:
            # Already ended by a stop string: only the core's confirmation (or its own end) is left.
            text, tokens, logprobs = "", [], None
            if finish is not None:
                finish, stop_reason = "stop", seq.stop
        else:
            tokens, logprobs = out.token_ids, out.logprobs
            # A "stop" from the core is its stop token (stop strings end in the detokenizer, above).
            delta = seq.detok.update(tokens, stop_terminated=finish == "stop")
            text = delta.text
            if delta.stop_str is not None and finish is None:
                seq.stop = delta.stop_str
                ended = self._stop_sequence(group.request_id, seq.index, delta.stop_str)
                if ended is not None:
                    finish, stop_reason, last = "stop", delta.stop_str, ended
            elif finish is not None and tokens:
                text += seq.detok.flush()
        if finish is not None:
            seq.reported_finished = True
            seq.record = last.metrics
            group.error = group.error or last.error
            group.error_param = group.error_param or last.error_param
        prev = group.completions.get(seq.index)
        if prev is not None:  # a second output of the same sequence in one step: one delta
            tokens = prev.token_ids + tokens
            text = prev.text + text
            if prev.logprobs or logprobs:
                logprobs = (prev.logprobs or []) + (logprobs or [])
        group.completions[seq.index] = CompletionOutput(
            index=seq.index,
            text=text,
            token_ids=list(tokens),
            finish_reason=finish,
            stop_reason=stop_reason,
            logprobs=logprobs,
            num_output_tokens=last.num_output_tokens if finish is not None else out.num_output_tokens,
        )
