"""Async scheduling on the runner's side: step N+1 starts behind step N without the host waiting.

The engine thread does all host work (rows, packing, bookkeeping); only the device work runs "behind":

    engine thread   schedule N+1 | submit N+1 (pack, queue) | collect N (wait, tokens) | detokenize N | ...
    device          ...... step N (forward, sample) ......... | ..... step N+1 ..........
    (CPU: a worker thread; torch ops release the GIL.  CUDA: the stream; the host only launches.)

Step N+1's inputs for a request whose previous token is step N's, still unknown to the host, are
filled on the device: ``input_ids[fill_dst] = tokens_N[fill_src]``, queued after step N. The host rows
get a placeholder meanwhile (``InputBatch.append_placeholder``) and the real token when N is collected.

Example: A decodes (its token 6 sampled by step N), B prefills 3 tokens and samples; step N+1:
    flat tokens    [A@6, B@0, B@1, B@2]       sampling rows of step N:  [A, C]
    fill_dst [0]   fill_src [0]               (A's input at flat index 0 is row 0 of tokens_N)

Sampling rows are snapshots taken on the engine thread (the worker never reads the live rows). Only
a row with penalties reads its output tokens' values; if its last token is step N's, the worker patches
it from tokens_N (on CUDA that waits for step N: a cost paid only by steps with such rows).
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.runner.input_batch import CachedRequestState
from engine.runner.prompt_scoring import PromptScores
from engine.runner.step_io import PreparedInputs, RunnerOutput
from engine.sampling.sampled import SampledTensors
from engine.sampling.sampler import SamplingRow
from engine.sched.output import SchedulerOutput

if TYPE_CHECKING:
    from engine.runner.model_runner import ModelRunner


@dataclass(frozen=True)
class _Pending:
    """A token a submitted step samples, not yet written into the host rows."""

    state: CachedRequestState  # the row it belongs to (compared by identity: ids may be reused)
    position: int  # its index in the row's tokens
    sample_index: int  # its row in the step's sampled tokens


@dataclass
class _DeviceStep:
    """Everything the device side of one step reads: built on the engine thread, owned by the step."""

    inputs: PreparedInputs
    rows: list[SamplingRow]  # snapshots
    fill_dst: torch.Tensor | None  # [F] int64 flat token indexes whose input is the previous step's token
    fill_src: torch.Tensor | None  # [F] int64 rows of the previous step's sampled tokens
    patches: list[tuple[int, int]]  # (sampling row, previous step's sample row): penalty rows' last token


@dataclass
class _DeviceResult:
    sampled: SampledTensors | None  # None: nothing sampled (prefill chunks only)
    seconds: float  # CPU: the worker's time on the step
    # CUDA: events around the step's kernels (the host only queued them, its own time says nothing)
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None = None
    prompt: PromptScores | None = None  # prompt logprobs the step scored (requests that ask)

    def device_time(self) -> float:
        if self.events is None:
            return self.seconds
        start, end = self.events
        end.synchronize()
        return start.elapsed_time(end) / 1e3


@dataclass
class StepHandle:
    pending: list[_Pending]  # in sampling order
    future: Future[_DeviceResult]
    prepare_time: float


class StepOverlap:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        # CPU: one worker thread, so steps run in submission order, each after the previous one (the
        # order that makes the device-side fill and the reuse of freed KV blocks safe). CUDA: launches
        # from the engine thread; the stream gives the same order.
        on_cpu = runner.device.type != "cuda"
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="inflight-step") if on_cpu else None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    # ---- engine thread ---------------------------------------------------------------------
    @torch.inference_mode()
    def submit(self, out: SchedulerOutput, prev: StepHandle | None) -> StepHandle:
        start = time.perf_counter()
        runner = self.runner
        if self._pool is not None and runner.staging is not None and prev is not None:
            # The persistent input buffers on a CPU (tests only; production stages on CUDA, where the
            # stream orders their reuse): the running step may still read them.
            wait([prev.future])
        runner.update_rows(out)
        inputs = runner.prepare(out)
        step, pending = self._plan(out, inputs, prev)
        prepare_time = time.perf_counter() - start
        prev_future = prev.future if prev is not None else None
        future: Future[_DeviceResult]
        if self._pool is not None:
            future = self._pool.submit(self._run, step, prev_future)
        else:
            future = Future()
            try:
                future.set_result(self._run(step, prev_future))
            except Exception as exc:  # reported when collected, like the worker thread's errors
                future.set_exception(exc)
        return StepHandle(pending, future, prepare_time)

    def _plan(
        self, out: SchedulerOutput, inputs: PreparedInputs, prev: StepHandle | None
    ) -> tuple[_DeviceStep, list[_Pending]]:
        batch = self.runner.input_batch
        prev_pending = {p.state.req_id: p for p in prev.pending} if prev is not None else {}
        start_loc = inputs.metadata.query_start_loc_cpu
        dst: list[int] = []
        src: list[int] = []
        if prev_pending:
            for i, (req_id, num_scheduled) in enumerate(out.num_scheduled_tokens.items()):
                p = prev_pending.get(req_id)
                state = batch.requests[req_id]
                if p is None or p.state is not state:
                    continue
                offset = p.position - state.num_computed_tokens
                if 0 <= offset < num_scheduled:
                    dst.append(start_loc[i] + offset)
                    src.append(p.sample_index)
        rows: list[SamplingRow] = []
        patches: list[tuple[int, int]] = []
        pending: list[_Pending] = []
        for j, state in enumerate(inputs.sampling_requests):
            row = SamplingRow(
                params=state.sampling_params,
                prompt_token_ids=state.prompt_token_ids,
                output_token_ids=[],
                seed=state.seed,
                eos_token_id=state.eos_token_id,
                num_output_tokens=len(state.output_token_ids),
                # Advanced by the device side after each draw, in step order (one worker thread; on CUDA
                # the engine thread), so step N+1's mask already follows step N's token.
                grammar=state.grammar,
            )
            if row.has_penalties:
                row.output_token_ids = list(state.output_token_ids)
                p = prev_pending.get(state.req_id)
                last = len(state.prompt_token_ids) + len(state.output_token_ids) - 1
                if p is not None and p.state is state and p.position == last:
                    patches.append((j, p.sample_index))
            rows.append(row)
            # After the snapshot: this step's own token is not among its row's outputs yet.
            pending.append(_Pending(state, batch.append_placeholder(state), j))
        fill_dst = fill_src = None
        if dst:
            fill_dst, fill_src = self._index(dst), self._index(src)
        return _DeviceStep(inputs, rows, fill_dst, fill_src, patches), pending

    def _index(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int64)
        if self.runner.device.type != "cuda":
            return host
        return host.pin_memory().to(self.runner.device, non_blocking=True)

    def collect(self, handle: StepHandle) -> RunnerOutput:
        done = handle.future.result()
        prompt_logprobs = done.prompt.to_host() if done.prompt is not None else {}
        if done.sampled is None:
            execute_time = handle.prepare_time + done.device_time()
            return RunnerOutput({}, {}, handle.prepare_time, execute_time, prompt_logprobs)
        result = done.sampled.to_host()
        batch = self.runner.input_batch
        sampled: dict[str, int] = {}
        logprobs: dict[str, dict[int, float]] = {}
        for p, token, lp in zip(handle.pending, result.token_ids, result.logprobs, strict=True):
            req_id = p.state.req_id
            sampled[req_id] = token
            if lp is not None:
                logprobs[req_id] = lp
            if batch.requests.get(req_id) is p.state:  # else finished or preempted: its row is gone
                batch.set_token(p.state, p.position, token)
        execute_time = handle.prepare_time + done.device_time()
        return RunnerOutput(sampled, logprobs, handle.prepare_time, execute_time, prompt_logprobs)

    # ---- device side (the worker thread on CPU) ----------------------------------------------
    @torch.inference_mode()
    def _run(self, step: _DeviceStep, prev: Future[_DeviceResult] | None) -> _DeviceResult:
        start = time.perf_counter()
        events = None
        if self.runner.device.type == "cuda":
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record(torch.cuda.current_stream(self.runner.device))
        sampled, prompt = self._device_step(step, prev)
        if events is not None:
            events[1].record(torch.cuda.current_stream(self.runner.device))
        return _DeviceResult(sampled, time.perf_counter() - start, events, prompt)

    def _device_step(
        self, step: _DeviceStep, prev: Future[_DeviceResult] | None
    ) -> tuple[SampledTensors | None, PromptScores | None]:
        runner = self.runner
        inputs = step.inputs
        prev_tokens = None
        if prev is not None and (step.fill_dst is not None or step.patches):
            # Already done on CPU (one worker, in order); on CUDA a handle to queued work, no wait.
            try:
                prev_result = prev.result()
            except Exception:
                prev_result = None  # its requests are failed by the engine: the rows needing it are dropped
            if prev_result is not None and prev_result.sampled is not None:
                prev_tokens = prev_result.sampled.tokens
        if prev_tokens is not None and step.fill_dst is not None:
            assert step.fill_src is not None
            inputs.input_ids.index_copy_(0, step.fill_dst, prev_tokens.index_select(0, step.fill_src))
        if step.patches:
            # Without the previous step (it failed) these rows' requests are failed too: any valid id.
            values = prev_tokens.tolist() if prev_tokens is not None else None
            for row, sample in step.patches:
                step.rows[row].output_token_ids[-1] = values[sample] if values is not None else 0
        # In step order, after the previous step's tokens advanced the grammars: fills during the forward.
        masks = runner.sampler.begin_masks(step.rows, runner.config.model.vocab_size)
        hidden = runner.forward(inputs)
        prompt = runner.score_prompts(hidden, inputs)
        if not step.rows:
            return None, prompt
        logits = runner.model.compute_logits(hidden.index_select(0, inputs.logits_indices))
        sampled = runner.sampler.sample(logits, step.rows, masks)
        sampled.copy_to_host_async()
        return sampled, prompt
