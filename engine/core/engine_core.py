"""The engine core's step loop: schedule -> execute -> update, one bounded step at a time.

Control returns here after every step, so finished requests leave and new ones join at each step
boundary (iteration-level scheduling). The core deals in token ids only: it returns, per sequence,
the new token ids, the finish reasons it knows itself (a stop token, length, abort, error) and logprob
ids (``SeqOutput``). Text, stop strings and the grouping of a request's n sequences run beside the
client (``engine.core.output_processor``), in the caller's process: this loop's time is the model's.
Nothing here imports a tokenizer (tests/engine/test_core_boundary.py).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from engine.config import EngineArgs, EngineConfig
from engine.core.messages import SeqOutput
from engine.cost_model import StepCostModel
from engine.inputs import EngineRequest, PromptLimits, check_context_length, prepare_prompt
from engine.kv_cache.manager import KVCacheManager
from engine.metrics import EngineMetrics, RequestRecord, SchedulerStats, StepRecord
from engine.platform.cpu import release_freed_heap
from engine.prompt_logprobs import PromptLogprobs
from engine.request import Request, RequestStatus
from engine.runner.model_runner import ModelRunner
from engine.runner.step_io import RunnerOutput
from engine.runner.step_overlap import StepHandle
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from engine.structured.background import BackgroundCompiles

logger = logging.getLogger(__name__)

# How long an engine with nothing to run but compiling grammars waits for one before it steps again.
_GRAMMAR_WAIT_S = 0.02


@dataclass
class _Submitted:
    """A scheduled step on its way through the runner (async scheduling: still running)."""

    out: SchedulerOutput
    handle: StepHandle | None  # async scheduling: what to collect its tokens from
    start: float  # time.monotonic() when its scheduling began
    scheduled_at: float


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # The model's own eos ids; a front end adds its tokenizer's with each request.
        eos = set(config.model.eos_token_ids)
        self.eos_token_ids = eos
        self.runner = ModelRunner(config)
        if config.device.type == "cpu":
            release_freed_heap()
        self.kv = KVCacheManager(
            self.runner.num_blocks,
            config.block_size,
            config.enable_prefix_caching,
            free_window=config.model.kv_free_window,
        )
        cost = StepCostModel.load(config.slo_cost_model) if config.slo_cost_model else None
        scheduler_cls = AsyncScheduler if config.async_scheduling else Scheduler
        self.scheduler = scheduler_cls(config, self.kv, eos, cost=cost)
        logger.info(
            "engine: %s on %s, dtype %s, attention %s, linear layers %s, %d torch threads, %d KV blocks of "
            "%d tokens (%s), async scheduling %s (%s)",
            config.model.architecture,
            config.device,
            str(config.dtype).removeprefix("torch."),
            config.attention_backend,
            self.runner.model.kernels.label,
            torch.get_num_threads(),
            self.runner.num_blocks,
            config.block_size,
            str(config.kv_cache_dtype).removeprefix("torch."),
            "on" if config.async_scheduling else "off",
            config.async_scheduling_reason,
        )
        self.metrics = EngineMetrics()
        # Structured outputs' grammars compile on a helper thread; their requests wait meanwhile.
        self._grammars = BackgroundCompiles(config)
        # Per caller's request id, its sequences not yet reported finished, by completion index.
        self._groups: dict[str, dict[int, Request]] = {}
        self._pending: list[SeqOutput] = []  # outputs produced between steps, sent with the next
        self._inflight: _Submitted | None = None  # async scheduling: the step still running
        self._rng = random.Random(config.seed)
        self._step = 0
        # The engine's load as of its last change (a step, an arrival, an abort): an immutable snapshot
        # replaced whole, so other threads (the worker's event loop, a metrics scrape) read it instead
        # of the live scheduler and KV cache.
        self.load: SchedulerStats = self.scheduler.stats()

    @classmethod
    def from_engine_args(cls, model: str, **kwargs: Any) -> EngineCore:
        return cls(EngineConfig.resolve(EngineArgs.from_kwargs(model, **kwargs)))

    # ---- intake ----------------------------------------------------------------------------
    @property
    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(self.config.max_model_len, self.config.model.vocab_size)

    def add_request(self, request: EngineRequest) -> list[int]:
        """Add a request whose prompt is token ids (a front end tokenizes text); with ``params.n`` > 1
        it fans out here into sequences seeded seed + i. Returns the prompt's token ids."""
        params = request.params
        request_id = request.request_id
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in flight")
        ids = prepare_prompt(request.prompt, self.prompt_limits, None)
        indexes = list(range(params.n)) if request.indexes is None else sorted(set(request.indexes))
        if not indexes or not all(0 <= i < params.n for i in indexes):
            raise ValueError(f"indexes must be a non-empty subset of range({params.n}), got {indexes}")
        by_index, every = request.resume_by_index, request.resume_token_ids
        resumed = {i: list(by_index.get(i, ()) if by_index is not None else every or ()) for i in indexes}
        for i in indexes:
            if resumed[i]:  # the tokens already streamed are prefilled again with the prompt
                check_context_length(len(ids) + len(resumed[i]), self.config.max_model_len)
            if params.max_tokens is not None and len(resumed[i]) >= params.max_tokens:
                raise ValueError("resumed stream already reached max_tokens")
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        eos: int | None = None
        if request.eos_token_ids:
            eos = request.eos_token_ids[0]
            # A model has one tokenizer: its ids join the stop set once, as if known at start-up.
            self.eos_token_ids.update(request.eos_token_ids)
        elif self.config.model.eos_token_ids:
            eos = self.config.model.eos_token_ids[0]
        slo_ttft_s = self.config.slo_ttft_s if request.slo_ttft_s is None else request.slo_ttft_s
        slo_tpot_s = self.config.slo_tpot_s if request.slo_tpot_s is None else request.slo_tpot_s
        children = [
            Request(
                request_id if params.n == 1 else f"{request_id}#{i}",
                ids,
                params,
                eos,
                arrival_time=request.arrival_time,
                priority=request.priority,
                parent_id=request_id,
                index=i,
                resumed_output_token_ids=resumed[i],
                seed=seed + i,
                slo_ttft_s=slo_ttft_s,
                slo_tpot_s=slo_tpot_s,
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
        self._groups[request_id] = {child.index: child for child in children}
        if params.structured is not None:
            # Off the step loop: the children wait until their grammar is compiled (or fail with it).
            self._grammars.submit(request_id, params.structured, children)
        self.load = self.scheduler.stats()
        return ids

    def abort_request(self, request_id: str) -> list[SeqOutput]:
        """Abort a caller's request (all n sequences); returns its sequences' last outputs (a caller
        that steps another thread's core passes them on with ``defer``). Unknown or finished ids are a
        no-op. The id is free again at once: its outputs are returned now, not with a later step, so
        they never reach a new request under the same id."""
        group = self._groups.get(request_id)
        if group is None:
            return []
        self._grammars.drop(request_id)
        ended = []
        for child in list(group.values()):
            if self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_ABORTED):
                self.metrics.on_finished(child)
            if child.finished:
                ended.append(self._ended(child))
        self.load = self.scheduler.stats()
        return ended

    def stop_sequence(self, request_id: str, index: int, stop: str) -> SeqOutput | None:
        """The client found stop string ``stop`` in one sequence's text: finish it as stopped. Returns
        its last output (None if it had already ended: its own end is reported instead)."""
        child = self._groups.get(request_id, {}).get(index)
        if child is None or child.finished:
            return None
        child.stop_reason = stop
        self.scheduler.finish_request(child.request_id, RequestStatus.FINISHED_STOPPED)
        self.metrics.on_finished(child)
        self.load = self.scheduler.stats()
        return self._ended(child)

    def defer(self, output: SeqOutput) -> None:
        """Send ``output`` with the next step's."""
        self._pending.append(output)

    # ---- the loop --------------------------------------------------------------------------
    def has_unfinished_requests(self) -> bool:
        return bool(self._groups or self._pending or self._inflight)

    def step(self) -> list[SeqOutput]:
        """One step's outputs. With async scheduling these are the previous step's tokens: this call
        schedules and starts the next step before it waits for them."""
        start = time.monotonic()
        if self._grammars.num_pending:
            self._take_compiled()
        out = self.scheduler.schedule()
        if out.is_empty and self._inflight is None and self._grammars.num_pending:
            # Nothing runs but grammars compile: wait for one (briefly, so commands are still taken)
            # instead of spinning through empty steps.
            self._grammars.wait(_GRAMMAR_WAIT_S)
        scheduled_at = time.monotonic()
        outputs, self._pending = self._pending, []
        if self.scheduler.rejected:  # the policy finished these early, with an error (slo: lost TTFT)
            outputs.extend(self._report_rejected())
        if self.config.async_scheduling:
            return outputs + self._step_overlapped(_Submitted(out, None, start, scheduled_at))
        if out.is_empty:
            self.runner.update_rows(out)  # still drop the rows of requests finished since last step
            self.load = self.scheduler.stats()  # the policy may have rejected requests
            return outputs
        try:
            result = self.runner.execute(out)
        except Exception as exc:  # the step failed: fail its requests, keep the engine serving
            return outputs + self._fail_step(out, exc)
        return outputs + self._process(_Submitted(out, None, start, scheduled_at), result)

    def _step_overlapped(self, step: _Submitted) -> list[SeqOutput]:
        """Start ``step`` behind the one in flight, then take the in-flight one's tokens."""
        prev, self._inflight = self._inflight, None
        outputs: list[SeqOutput] = []
        failed: Exception | None = None
        if step.out.is_empty:
            self.runner.update_rows(step.out)
        else:
            try:
                step.handle = self.runner.submit(step.out, prev.handle if prev else None)
                self._inflight = step
            except Exception as exc:  # failed after its predecessor reports (steps report in order)
                failed = exc
        if prev is not None:
            outputs += self._finish_overlapped(prev)
        if failed is not None:
            outputs += self._fail_step(step.out, failed)
        if self._inflight is not None and not self.scheduler.has_unfinished():
            # Everything finished on the tokens just seen: the running step is wasted work. Wait for
            # it now, so has_unfinished_requests() turns false with the last outputs.
            last, self._inflight = self._inflight, None
            outputs += self._finish_overlapped(last)
        if prev is None:  # no step reported: arrivals, aborts or rejections may still have changed it
            self.load = self.scheduler.stats()
        return outputs

    def _finish_overlapped(self, step: _Submitted) -> list[SeqOutput]:
        assert step.handle is not None
        try:
            result = self.runner.collect(step.handle)
        except Exception as exc:
            return self._fail_step(step.out, exc)
        return self._process(step, result)

    def _fail_step(self, out: SchedulerOutput, exc: Exception) -> list[SeqOutput]:
        """The step failed: fail its requests, keep the engine serving."""
        logger.exception("model step failed", exc_info=exc)
        if isinstance(self.scheduler, AsyncScheduler):
            self.scheduler.discard(out)
        failed = [
            self.scheduler.requests[i] for i in out.num_scheduled_tokens if i in self.scheduler.requests
        ]
        outputs = self._fail(failed, f"{type(exc).__name__}: {exc}")
        self.load = self.scheduler.stats()
        return outputs

    def _process(self, step: _Submitted, result: RunnerOutput) -> list[SeqOutput]:
        """A step's tokens: into the requests, out as each sequence's new token and finish."""
        executed_at = time.monotonic()
        self._gather_prompt_logprobs(result)
        got_token = self.scheduler.update_from_output(step.out, result.sampled)
        outputs: list[SeqOutput] = []
        for request in got_token:
            token = request.output_token_ids[-1]
            lp = result.logprobs.get(request.request_id)
            if lp is not None:
                request.logprobs.append(lp)
            logprobs = None if lp is None else [lp]
            prompt_logprobs = self._take_prompt_logprobs(request)
            if request.finished:
                self.metrics.on_finished(request)
                outputs.append(self._ended(request, [token], logprobs, prompt_logprobs))
            else:
                outputs.append(
                    SeqOutput(
                        request.parent_id,
                        request.index,
                        [token],
                        None,
                        None,
                        logprobs,
                        request.num_output_tokens,
                        prompt_logprobs=prompt_logprobs,
                    )
                )
        if not self.config.async_scheduling:
            # The whole step, as calibration timed it (schedule to outputs). An overlapped step's
            # span holds its predecessor's tail, so async scheduling keeps the calibrated level.
            self.scheduler.observe_step_time(step.out.modelled_s, time.monotonic() - step.start)
        self._step += 1
        self.load = self.scheduler.stats(step.out)
        self.metrics.on_step(
            StepRecord(
                step=self._step,
                start=step.start,
                schedule_time=step.scheduled_at - step.start,
                execute_time=result.execute_time or executed_at - step.scheduled_at,
                stats=self.load,
                batch=list(step.out.batch()),
                prepare_time=result.prepare_time,
            )
        )
        return outputs

    def _gather_prompt_logprobs(self, result: RunnerOutput) -> None:
        """Each prefill chunk's prompt scores, appended to its request's (a recomputed chunk, after
        preemption, adds nothing it already has)."""
        for req_id, chunk in result.prompt_logprobs.items():
            request = self.scheduler.requests.get(req_id)
            if request is None or request.prompt_logprobs_sent:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = PromptLogprobs(1)
            request.prompt_logprobs.extend(chunk)

    @staticmethod
    def _take_prompt_logprobs(request: Request) -> PromptLogprobs | None:
        """The prompt logprobs to send with this token: once, with the first, when asked for."""
        if request.sampling_params.prompt_logprobs is None or request.prompt_logprobs_sent:
            return None
        request.prompt_logprobs_sent = True
        # A one-token prompt has no entry to score: an empty set (the client's list is [None]).
        return request.prompt_logprobs or PromptLogprobs(1)

    def _ended(
        self,
        request: Request,
        token_ids: list[int] | None = None,
        logprobs: list[dict[int, float]] | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> SeqOutput:
        """A finished sequence's last output (its record with it); the core forgets it here."""
        group = self._groups.get(request.parent_id)
        if group is not None:
            group.pop(request.index, None)
            if not group:
                del self._groups[request.parent_id]
        return SeqOutput(
            request.parent_id,
            request.index,
            token_ids or [],
            request.status.finish_reason,
            request.stop_reason,
            logprobs,
            request.num_output_tokens,
            RequestRecord.from_request(request),
            request.error,
            request.error_param,
            prompt_logprobs,
        )

    def _report_rejected(self) -> list[SeqOutput]:
        rejected, self.scheduler.rejected = self.scheduler.rejected, []
        outputs = []
        for request in rejected:
            self.metrics.on_finished(request)
            if request.index in self._groups.get(request.parent_id, {}):
                outputs.append(self._ended(request))
        return outputs

    def _take_compiled(self) -> None:
        """Requests whose grammar compile ended: compiled ones may be scheduled now (the scheduler sees
        their flag drop); a refused grammar fails its requests, naming the field (they hold no block)."""
        for requests, error in self._grammars.ready():
            live = [r for r in requests if not r.finished]
            if error is None or not live:
                continue
            for request in live:
                request.error_param = error.param
            self._pending.extend(self._fail(live, str(error)))
        self.load = self.scheduler.stats()

    def _fail(self, requests: list[Request], message: str) -> list[SeqOutput]:
        outputs = []
        for request in requests:
            if self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR):
                request.error = message
                self.metrics.on_finished(request)
            if request.index in self._groups.get(request.parent_id, {}):
                outputs.append(self._ended(request))
        return outputs
