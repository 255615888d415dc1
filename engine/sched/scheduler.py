"""The iteration-level scheduler: pure bookkeeping over requests and KV blocks, no tensors.

Every step spends one token budget. Running requests go first (a decode costs one token, an
unfinished prefill takes what the budget has left: chunked prefill); then waiting requests are
admitted while sequences, budget and blocks last. When blocks run out a running request is
preempted (its blocks freed, recomputed later) and the allocation retried. Every choice of order,
chunk size, admission and victim is the policy's (engine/sched/policy.py), asked the same way
whichever policy it is.

The step's decision leaves as plain data (``SchedulerOutput``): a request the runner does not hold yet
goes out in full, one it holds as the blocks allocated since and its computed-token count.
Async scheduling (the next step planned before this one's tokens are known) is a subclass:
engine/sched/async_scheduler.py.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from engine.config import EngineConfig
from engine.cost_model import StepCostModel
from engine.kv_cache.block_pool import KVCacheBlock
from engine.kv_cache.manager import KVCacheManager
from engine.metrics import SchedulerStats
from engine.request import Request, RequestStatus
from engine.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from engine.sched.policy import SchedulingPolicy, WaitingQueue, make_policy
from engine.sched.tokens import add_token, check_stop


class EngineQueueFull(RuntimeError):
    """The waiting queue is at its bound (``max_waiting``): shed load instead of growing."""


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        kv: KVCacheManager,
        eos_token_ids: set[int],
        *,
        cost: StepCostModel | None = None,
        clock: Callable[[], float] = time.monotonic,
        policy: SchedulingPolicy | None = None,
    ) -> None:
        self.config = config
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.static = config.batching == "static"
        # The clock is injectable so that a simulation can run the same scheduler on simulated time.
        # The policy is the one ``scheduling_policy`` names unless one is given; ``cost``, the
        # step-cost model, is for a policy that plans with one (slo).
        self.clock = clock
        self.policy = policy if policy is not None else make_policy(config, cost)
        self.waiting: WaitingQueue = self.policy.waiting
        # Waiting requests the policy rejected (finished with an error before they ran); the engine
        # takes them after each schedule() and reports them.
        self.rejected: list[Request] = []
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # live (not finished) requests by id
        self._finished_since_last_step: set[str] = set()
        # This step's batch, in order, and the blocks each request got this step.
        self._scheduled: list[Request] = []
        self._new_blocks: dict[str, list[KVCacheBlock]] = {}
        # Requests the runner holds a copy of (sent as new, not since finished or preempted).
        self._in_runner: set[str] = set()
        self.num_preemptions = 0
        self._step_preemptions = 0
        self.num_allocation_failures = 0

    # ---- intake ----------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        # A request whose whole life cannot fit in the pool would be preempted forever: refuse it.
        max_len = self.config.max_model_len
        if request.max_tokens is not None:
            max_len = min(max_len, request.num_prompt_tokens + request.max_tokens)
        # With a sliding window the blocks held stay bounded by it (engine/kv_cache/manager.py).
        need = self.kv.max_blocks_held(max(max_len, request.num_tokens), self.config.max_num_batched_tokens)
        if need > self.kv.num_total_blocks:
            raise ValueError(
                f"request needs up to {need} KV blocks but the cache has {self.kv.num_total_blocks}; "
                "lower max_tokens or the prompt length"
            )
        if self.config.max_waiting is not None and len(self.waiting) >= self.config.max_waiting:
            raise EngineQueueFull(f"waiting queue is full ({self.config.max_waiting})")
        self.requests[request.request_id] = request
        self.waiting.add(request)
        request.record("queued", self.clock(), prompt_tokens=request.num_prompt_tokens)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """Move a live request to a terminal status and free its blocks; unknown ids are a no-op."""
        assert status.finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._finish(request, status)
        return request

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.timeline.finished = now = self.clock()
        request.record(
            "finished", now, reason=status.finish_reason or "", output_tokens=request.num_output_tokens
        )
        self.kv.free(request)
        self._finished_since_last_step.add(request.request_id)
        self._in_runner.discard(request.request_id)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        self._step_preemptions = 0
        self._scheduled, self._new_blocks = [], {}
        rejected = self.policy.begin_step(self.running, self.clock(), self._tokens_left)
        for request, message in rejected:
            self.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
            request.error = message
            self.rejected.append(request)
        admit = not self.static or not self.running  # a static batch admits only when it is empty
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if admit and not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        self._describe_for_runner(out)
        self.policy.end_step(out, self._scheduled)
        return out

    def observe_step_time(self, modelled_s: float, measured_s: float) -> None:
        """A step (or a run of steps, summed) took ``measured_s`` where the plan said ``modelled_s``
        (its ``SchedulerOutput.modelled_s``): the policy may plan the next ones differently."""
        self.policy.observe_step_time(modelled_s, measured_s)

    def _describe_for_runner(self, out: SchedulerOutput) -> None:
        """The batch as plain data: in full for requests the runner does not hold, else the diff."""
        for request in self._scheduled:
            req_id = request.request_id
            if req_id in self._in_runner:
                new_block_ids = [b.block_id for b in self._new_blocks.get(req_id, ())]
                out.scheduled_cached_reqs.append(
                    CachedRequestData(req_id, new_block_ids, request.num_computed_tokens)
                )
                continue
            out.scheduled_new_reqs.append(
                NewRequestData(
                    req_id=req_id,
                    prompt_token_ids=list(request.prompt_token_ids),
                    output_token_ids=list(request.output_token_ids),
                    sampling_params=request.sampling_params,
                    seed=request.seed,
                    eos_token_id=request.eos_token_id,
                    block_ids=self.kv.block_ids(req_id),
                    num_computed_tokens=request.num_computed_tokens,
                )
            )
            self._in_runner.add(req_id)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(self._tokens_left(request), budget)
            num_new = self.policy.cap_chunk(request, num_new, out, self._scheduled)
            if num_new <= 0:
                i += 1
                continue
            preempted_self = False
            while (blocks := self.kv.allocate_slots(request, num_new)) is None:
                self.num_allocation_failures += 1
                victim = self.policy.victim(self.running)
                victim_index = self.running.index(victim)
                budget += self._preempt(victim, out)
                if victim is request:
                    preempted_self = True
                    break
                if victim_index < i:  # an already scheduled request (priority: a less urgent one)
                    i -= 1
            if preempted_self:
                continue  # the next running request slid into slot i
            assert blocks is not None  # the loop ends on a successful allocation or preempted_self
            self._new_blocks[request.request_id] = blocks
            self._add_to_batch(out, request, num_new)
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        # Requests whose grammar still compiles (engine/structured/background.py) are passed over: taken
        # out while the others are admitted, put back in their order after, so they hold up no one.
        compiling: list[Request] = []
        try:
            self._admit_waiting(out, budget, compiling)
        finally:
            for request in reversed(compiling):
                self.waiting.add_front(request)

    def _admit_waiting(self, out: SchedulerOutput, budget: int, compiling: list[Request]) -> None:
        cfg = self.config
        reserved = 0  # static batching: worst-case blocks promised to this batch so far
        free_at_start = self.kv.num_free_blocks
        # A static batch forms whole even past the budget: its members prefill over the next steps.
        while len(self.waiting) and (budget > 0 or self.static):
            request = self.waiting.peek()
            if request.waiting_for_grammar:
                compiling.append(self.waiting.pop())
                continue
            if request.num_output_placeholders:
                break  # async: preempted while its last token was in flight; back next step
            if len(self.running) >= cfg.max_num_seqs:
                if not self._preempt_for(request, out):
                    break
                budget = self._budget_left(out)
                continue
            if not self.policy.admits(request, self.running):
                break
            hits, num_cached = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            capped = self.policy.cap_chunk(request, num_new, out, self._scheduled)
            if capped <= 0 < num_new:
                break  # the policy allows it nothing this step
            num_new = capped
            if self.static:
                # The baseline reserves every request's worst case up front, as fixed-batch servers do,
                # so nothing in the batch can ever be preempted.
                worst = self.kv.max_blocks_held(self._max_len(request), cfg.max_num_batched_tokens)
                if reserved + worst > free_at_start:
                    break
                reserved += worst
            if self.kv.allocate_slots(request, num_new, hits) is None:
                self.num_allocation_failures += 1
                if self._preempt_for(request, out):
                    budget = self._budget_left(out)
                    continue
                break
            self.waiting.pop()
            now = self.clock()
            resumed = request.status == RequestStatus.PREEMPTED
            request.record("resumed" if resumed else "admitted", now, cached_tokens=num_cached)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_cached
            request.num_cached_tokens = num_cached
            self.kv.record_lookup(request.num_tokens, num_cached)
            if request.timeline.first_scheduled is None:
                request.timeline.first_scheduled = now
            self.running.append(request)
            out.new_req_ids.append(request.request_id)
            out.num_cached_tokens[request.request_id] = num_cached
            if num_new > 0:
                self._add_to_batch(out, request, num_new)
                budget -= num_new

    def _max_len(self, request: Request) -> int:
        limit = self.config.max_model_len
        if request.max_tokens is not None:
            limit = min(limit, request.num_prompt_tokens + request.max_tokens)
        return max(limit, request.num_tokens)

    def _target_tokens(self, request: Request) -> int:
        """The token count a running request's progress catches up with (async: with placeholders)."""
        return request.num_tokens

    def _tokens_left(self, request: Request) -> int:
        return self._target_tokens(request) - request.num_computed_tokens

    def _budget_left(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def _add_to_batch(self, out: SchedulerOutput, request: Request, num_tokens: int) -> None:
        self._scheduled.append(request)
        out.num_scheduled_tokens[request.request_id] = num_tokens
        out.total_num_scheduled_tokens += num_tokens

    # ---- preemption ------------------------------------------------------------------------
    def _preempt_for(self, request: Request, out: SchedulerOutput) -> bool:
        """Preempt the running request the policy would displace for ``request``, if any."""
        victim = None if self.static else self.policy.displaces(request, self.running)
        if victim is None:
            return False
        self._preempt(victim, out)
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> int:
        """Push a running request back to waiting, freeing its blocks. Returns budget given back."""
        self.running.remove(victim)
        self.kv.free(victim)
        self._in_runner.discard(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.timeline.num_preemptions += 1
        victim.record("preempted", self.clock(), computed_tokens=victim.num_computed_tokens)
        victim.num_computed_tokens = 0
        self.waiting.add_front(victim)
        self.num_preemptions += 1
        self._step_preemptions += 1
        out.preempted_req_ids.append(victim.request_id)
        given_back = out.num_scheduled_tokens.pop(victim.request_id, 0)
        if given_back:
            self._scheduled.remove(victim)
            out.total_num_scheduled_tokens -= given_back
            if victim.request_id in out.new_req_ids:
                out.new_req_ids.remove(victim.request_id)
                out.num_cached_tokens.pop(victim.request_id, None)
        return given_back

    # ---- after the model ran ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress, append sampled tokens, finish requests that hit a stop condition.

        Returns the requests that received a token this step (finished ones included).
        """
        now = self.clock()
        got_token = []
        for req_id, num_scheduled in out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            prefilling = request.num_computed_tokens < request.num_prompt_tokens + request.num_resumed_tokens
            request.num_computed_tokens += num_scheduled
            if prefilling:
                request.record(
                    "prefill_chunk", now, tokens=num_scheduled, computed=request.num_computed_tokens
                )
            if request.timeline.prefill_done is None and request.num_computed_tokens >= request.num_tokens:
                request.timeline.prefill_done = now
            token = sampled.get(request.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            add_token(request, token, now)
            got_token.append(request)
            status = check_stop(request, token, self.eos_token_ids, self.config.max_model_len)
            if status is not None:
                self.requests.pop(request.request_id, None)
                self.running.remove(request)
                self._finish(request, status)
        return got_token

    def stats(self, out: SchedulerOutput | None = None) -> SchedulerStats:
        """The scheduler's state now; ``out``: the step just run (None between steps)."""
        out = out or SchedulerOutput()
        pool = self.kv.pool
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_tokens=out.total_num_scheduled_tokens,
            num_scheduled_seqs=out.num_seqs,
            kv_usage=self.kv.usage,
            num_free_blocks=self.kv.num_free_blocks,
            prefix_cache_queries=pool.num_cache_queries,
            prefix_cache_hits=pool.num_cache_hits,
            num_preemptions=self.num_preemptions,
            step_preemptions=self._step_preemptions,
            num_allocation_failures=self.num_allocation_failures,
            num_total_blocks=self.kv.num_total_blocks,
        )
