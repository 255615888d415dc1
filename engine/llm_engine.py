"""The engine loop: schedule -> execute -> update, one bounded step at a time.

Control returns here after every step, so finished requests leave and new ones join at each step
boundary (iteration-level scheduling).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from engine.config import EngineArgs, EngineConfig
from engine.cost_model import StepCostModel
from engine.inputs import check_context_length
from engine.kv_cache.manager import KVCacheManager
from engine.metrics import EngineMetrics, RequestRecord, SchedulerStats, StepRecord
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request, RequestStatus
from engine.sampling.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from engine.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from engine.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

Prompt = str | list[int]


@dataclass
class _Group:
    """A caller's request: its n sibling sequences sharing one prompt (or the subset still to run)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[Request]
    detoks: dict[int, IncrementalDetokenizer]  # by completion index
    reported_finished: dict[int, bool] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.reported_finished = {child.index: False for child in self.children}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.tokenizer: Tokenizer | None = _load_tokenizer(config.model_path)
        eos = set(config.model.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self.runner = ModelRunner(config)
        self.kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        cost = StepCostModel.load(config.slo_cost_model) if config.slo_cost_model else None
        self.scheduler = Scheduler(config, self.kv, eos, cost=cost)
        logger.info(
            "engine: %s on %s, dtype %s, attention %s, %d torch threads, %d KV blocks of %d tokens",
            config.model.architecture,
            config.device,
            str(config.dtype).removeprefix("torch."),
            config.attention_backend,
            torch.get_num_threads(),
            self.runner.num_blocks,
            config.block_size,
        )
        self.metrics = EngineMetrics()
        self._groups: dict[str, _Group] = {}
        self._pending: list[RequestOutput] = []  # outputs produced between steps (aborts)
        self._rng = random.Random(config.seed)
        self._step = 0
        # The engine's load as of its last change (a step, an arrival, an abort): an immutable snapshot
        # replaced whole, so other threads (the worker's event loop, a metrics scrape) read it instead
        # of the live scheduler and KV cache.
        self.load: SchedulerStats = self.scheduler.stats()

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> LLMEngine:
        return cls(EngineConfig.resolve(EngineArgs.from_kwargs(model, **kwargs)))

    # ---- intake ----------------------------------------------------------------------------
    def tokenize(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("the prompt is empty")
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: send the prompt as token ids")
            return prompt, self.tokenizer.encode(prompt)
        return None, [int(t) for t in prompt]

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        resume_token_ids: list[int] | None = None,
        resume_by_index: Mapping[int, Sequence[int]] | None = None,
        indexes: Sequence[int] | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
    ) -> None:
        """Add a request; with ``params.n`` > 1 it fans out here, into n sequences seeded seed + i.

        ``resume_token_ids``: tokens already streamed (every index); ``resume_by_index``: per index,
        for a stream whose completions stopped at different points; ``indexes``: run only these
        completions (the others finished before a resume). ``slo_ttft_s`` / ``slo_tpot_s`` override the
        engine's default deadlines (slo policy).
        """
        params = params or SamplingParams()
        for name, value in (("slo_ttft_s", slo_ttft_s), ("slo_tpot_s", slo_tpot_s)):
            if value is not None and not value > 0:
                raise ValueError(f"{name} must be > 0, got {value}")
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in flight")
        text, ids = self.tokenize(prompt)
        indexes = list(range(params.n)) if indexes is None else sorted(set(indexes))
        if not indexes or not all(0 <= i < params.n for i in indexes):
            raise ValueError(f"indexes must be a non-empty subset of range({params.n}), got {indexes}")
        if resume_token_ids is not None and resume_by_index is not None:
            raise ValueError("give resume_token_ids (every index) or resume_by_index, not both")
        resumed = {
            i: list(resume_by_index.get(i, ()) if resume_by_index is not None else resume_token_ids or ())
            for i in indexes
        }
        for i in indexes:
            self._validate(ids, resumed[i], params)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        if eos is None and self.config.model.eos_token_ids:
            eos = self.config.model.eos_token_ids[0]
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                params,
                eos,
                arrival_time=arrival_time,
                priority=priority,
                parent_id=request_id,
                index=i,
                resumed_output_token_ids=resumed[i],
                seed=seed + i,
                slo_ttft_s=self.config.slo_ttft_s if slo_ttft_s is None else slo_ttft_s,
                slo_tpot_s=self.config.slo_tpot_s if slo_tpot_s is None else slo_tpot_s,
            )
            for i in indexes
        ]
        added: list[Request] = []
        try:
            for child in children:
                self.scheduler.add_request(child)
                added.append(child)
        except Exception:
            for child in added:
                self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED)
            raise
        detoks = {
            i: IncrementalDetokenizer(
                self.tokenizer,
                ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            for i in indexes
        }
        for i, detok in detoks.items():
            if resumed[i]:
                # Replay the tokens another engine already streamed, discarding their text, so the
                # detokenizer (held-back bytes, stop-string prefixes) continues exactly where it left off.
                detok.replay(resumed[i])
        self._groups[request_id] = _Group(request_id, text, ids, children, detoks)
        self.load = self.scheduler.stats()

    def _validate(self, ids: list[int], resumed: list[int], params: SamplingParams) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        check_context_length(len(ids) + len(resumed), self.config.max_model_len)
        vocab = self.config.model.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if params.max_tokens is not None and len(resumed) >= params.max_tokens:
            raise ValueError("resumed stream already reached max_tokens")

    def abort_request(self, request_id: str) -> None:
        """Abort a caller's request (all n sequences). Unknown or finished ids are a no-op."""
        group = self._groups.get(request_id)
        if group is None:
            return
        for child in group.children:
            if self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED):
                self.metrics.on_finished(child)
        self._pending.extend(self._collect([group], {}))
        self.load = self.scheduler.stats()

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self._pending)

    def step(self) -> list[RequestOutput]:
        start = time.monotonic()
        out = self.scheduler.schedule()
        scheduled_at = time.monotonic()
        outputs, self._pending = self._pending, []
        if self.scheduler.rejected:  # slo policy: lost TTFT deadlines finished early, with an error
            outputs.extend(self._report_rejected())
        if out.is_empty:
            self.runner.update_rows(out)  # still drop the rows of requests finished since last step
            self.load = self.scheduler.stats()  # the slo policy may have finished requests
            return outputs
        batch = list(out.batch())
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # the step failed: fail its requests, keep the engine serving
            logger.exception("model step failed")
            failed = [
                self.scheduler.requests[i] for i in out.num_scheduled_tokens if i in self.scheduler.requests
            ]
            outputs += self._fail(failed, f"{type(exc).__name__}: {exc}")
            self.load = self.scheduler.stats()
            return outputs
        executed_at = time.monotonic()
        got_token = self.scheduler.update_from_output(out, result.sampled)
        touched: dict[str, _Group] = {}
        deltas: dict[str, tuple[str, int | None, dict[int, float] | None]] = {}
        for request in got_token:
            group = self._groups[request.parent_id]
            touched[group.request_id] = group
            token = request.output_token_ids[-1]
            lp = result.logprobs.get(request.request_id)
            if lp is not None:
                request.logprobs.append(lp)
            detok = group.detoks[request.index]
            delta = detok.update([token])
            text = delta.text
            if delta.stop_str is not None and not request.finished:
                request.stop_reason = delta.stop_str
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_STOPPED)
            elif request.finished:
                text += detok.flush()
            if request.finished:
                self.metrics.on_finished(request)
            deltas[request.request_id] = (text, token, lp)
        outputs.extend(self._collect(list(touched.values()), deltas))
        self._step += 1
        self.load = self.scheduler.stats(out)
        self.metrics.on_step(
            StepRecord(
                step=self._step,
                start=start,
                schedule_time=scheduled_at - start,
                execute_time=executed_at - scheduled_at,
                stats=self.load,
                batch=batch,
                prepare_time=result.prepare_time,
            )
        )
        return outputs

    def _report_rejected(self) -> list[RequestOutput]:
        rejected, self.scheduler.rejected = self.scheduler.rejected, []
        groups: dict[str, _Group] = {}
        for request in rejected:
            self.metrics.on_finished(request)
            groups[request.parent_id] = self._groups[request.parent_id]
        return self._collect(list(groups.values()), {})

    def _fail(self, requests: list[Request], message: str) -> list[RequestOutput]:
        groups: dict[str, _Group] = {}
        for request in requests:
            if self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR):
                request.error = message
                self.metrics.on_finished(request)
            groups[request.parent_id] = self._groups[request.parent_id]
        return self._collect(list(groups.values()), {})

    def _collect(
        self, groups: list[_Group], deltas: dict[str, tuple[str, int | None, dict[int, float] | None]]
    ) -> list[RequestOutput]:
        """Delta outputs for the touched groups; drops groups whose every child has been reported."""
        outputs = []
        for group in groups:
            completions = []
            for child in group.children:
                text, token, lp = deltas.get(child.request_id, ("", None, None))
                if token is None and not (child.finished and not group.reported_finished[child.index]):
                    continue
                if child.finished:
                    group.reported_finished[child.index] = True
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
            finished = all(group.reported_finished.values())
            error = next((c.error for c in group.children if c.error), None)
            outputs.append(
                RequestOutput(
                    request_id=group.request_id,
                    prompt=group.prompt,
                    prompt_token_ids=group.prompt_token_ids,
                    outputs=completions,
                    finished=finished,
                    metrics=RequestRecord.from_request(group.children[0]) if finished else None,
                    error=error,
                )
            )
            if finished:
                del self._groups[group.request_id]
        return outputs


def _load_tokenizer(path: str) -> Tokenizer | None:
    # Imported only when there is one: a GPU host benchmarking a random-weight checkpoint needs no
    # tokenizers package.
    from engine.models.gguf import local_checkpoint

    if not (local_checkpoint(path) / "tokenizer.json").is_file():
        return None
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(path)
