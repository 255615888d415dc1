"""Discrete-event simulation of a fleet: the real scheduler and KV manager per worker, steps timed by
the step-cost model, no model compute.

The path a request takes, as the service runs it:

    arrival -> gateway admission (max_pending requests admitted and not yet taken by an engine; over
    it: 429) -> Kafka partition (hash of the key; partition p belongs to worker p % workers) -> the
    worker fetches, oldest first, while its engine's waiting queue is below max_waiting -> the
    engine's Scheduler admits, chunks and preempts -> each step takes cost.step_time(tokens, seqs,
    context) -> tokens "sampled" at the step's end (outputs are fixed-length: EOS ignored, as in the
    benchmark).

Workers share nothing but the gateway's bound, so the event loop is a heap of workers' next step
ends merged with the arrival stream. Fast path: while a worker's batch is all decodes and nothing can
join it (its waiting queue is empty or every seat is taken), its next k steps differ only in context,
so they are applied at once (closed-form time, one block allocation per request), up to the first
finish or the next arrival it could fetch. A saturated worker thus costs one event per finish, not one
per token.
"""

from __future__ import annotations

import heapq
import math
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.cost_model import StepCostModel
from engine.metrics import percentile
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams
from engine.sched.scheduler import Scheduler
from inflight.plan.fleet import FleetConfig, ServicePath, SimRequest, engine_config
from inflight.plan.noise import StepNoise, TracedSpeed

_TOKEN = 7  # every simulated sample: its value never matters (EOS is ignored)
# The inputs live in fleet.py; named here too, where callers have always imported them from.
__all__ = ["FleetConfig", "ServicePath", "SimRequest", "engine_config", "simulate"]


@dataclass
class _Worker:
    index: int
    sched: Scheduler
    queue: deque[tuple[int, Request]]  # fetched from Kafka in arrival order across its partitions
    next_arrival: deque[float]  # arrival times of requests routed here, for the fast path's horizon
    now: float = 0.0
    busy: bool = False
    steps: int = 0
    fast_steps: int = 0
    busy_s: float = 0.0  # time in steps (and the loop's overhead between them)
    seen: OrderedDict[int, None] | None = None  # token counts kept warm, least recent first (None: off)
    in_flight: Any = None  # the SchedulerOutput of the step now running (None: a fast-forward)
    noise: StepNoise | TracedSpeed = field(default_factory=lambda: StepNoise(0.0, 0.0, 0))


def _clock_of(worker: _Worker) -> Callable[[], float]:
    """The worker's simulated time, as its scheduler reads the clock."""
    return lambda: worker.now


def simulate(
    requests: Sequence[SimRequest],
    cost: StepCostModel,
    fleet: FleetConfig,
    slo: tuple[float | None, float | None] = (None, None),
) -> dict[str, Any]:
    """Run the fleet over ``requests`` (sorted by arrival) and summarise it.

    With ``sample_workers = k`` only workers 0..k-1 and the requests routed to their partitions are
    simulated, and the gateway bound is scaled to their share: workers never interact except through
    that bound, so their latencies are the fleet's, and a thousand-worker fleet costs what k workers
    cost. The summary's throughput is then scaled back up to the whole fleet. With ``slo`` (TTFT,
    TPOT seconds) it also reports goodput: completed requests meeting both, per second.
    """
    from engine.kv_cache.manager import KVCacheManager

    wall0 = time.perf_counter()
    cfg = engine_config(cost, fleet.engine)
    # A model whose every layer slides one window frees the blocks that leave it (the engine's
    # KVCacheManager does the same): its KV capacity is counted in windows, not whole contexts.
    free_window = {**cost.engine, **fleet.engine}.get("kv_free_window")
    n_part = fleet.num_partitions
    simulated = min(fleet.workers, fleet.sample_workers or fleet.workers)
    share = simulated / fleet.workers
    max_pending = None if fleet.max_pending is None else max(1, round(fleet.max_pending * share))
    workers: list[_Worker] = []
    for w in range(simulated):
        kv = KVCacheManager(cfg.num_blocks, cfg.block_size, enable_caching=False, free_window=free_window)
        worker = _Worker(w, None, deque(), deque())  # type: ignore[arg-type]
        worker.seen = OrderedDict.fromkeys(sorted(fleet.warm_shapes)) if fleet.cold_shapes else None
        worker.sched = Scheduler(cfg, kv, {-1}, cost=cost, clock=_clock_of(worker))
        if fleet.speed is not None:
            worker.noise = TracedSpeed(fleet.speed[w], _clock_of(worker))
        elif fleet.noise_seed is not None:
            worker.noise = StepNoise(
                cost.noise_sigma,
                cost.noise_phi,
                fleet.noise_seed * 100_003 + w,
                cost.noise_slow_share,
                cost.noise_slow_phi,
            )
        workers.append(worker)
    owner = [p % fleet.workers for p in range(n_part)]
    routed = [(i, r, owner[r.partition_key % n_part]) for i, r in enumerate(requests)]
    routed = [x for x in routed if x[2] < simulated]
    intake = fleet.service.intake_s
    for _, r, w in routed:
        workers[w].next_arrival.append(r.arrival + intake)

    pending = 0
    rejected = 0
    slo_rejected = 0
    ttft: list[float] = []
    tpot: list[float] = []
    out_tokens = 0
    last_end = 0.0
    num_good = 0
    heap: list[tuple[float, int]] = []  # (step end, worker)

    def record(req: Request) -> None:
        nonlocal out_tokens, last_end, slo_rejected, num_good
        t = req.timeline
        if req.status == RequestStatus.FINISHED_ERROR or t.first_token is None:
            slo_rejected += 1
            return
        ttft.append(t.first_token + fleet.service.delivery_s - t.arrival)
        n = req.num_output_tokens
        out_tokens += n
        per_token = None
        if n > 1 and t.last_token is not None:
            per_token = (t.last_token - t.first_token) / (n - 1)
            tpot.append(per_token)
        if (slo[0] is None or ttft[-1] <= slo[0]) and (
            slo[1] is None or per_token is None or per_token <= slo[1]
        ):
            num_good += 1
        last_end = max(last_end, (t.finished or t.first_token) + fleet.service.delivery_s)

    def fetch(wk: _Worker) -> None:
        nonlocal pending
        while wk.queue and (fleet.max_waiting is None or wk.sched.num_waiting < fleet.max_waiting):
            _, req = wk.queue.popleft()
            pending -= 1
            wk.sched.add_request(req)

    def start_step(wk: _Worker) -> None:
        sched = wk.sched
        end = (
            _fast_forward(wk, cost, fleet.max_waiting, record, fleet.service.step_overhead_s)
            if fleet.fast_path
            else None
        )
        if end is not None:
            wk.busy, wk.in_flight = True, None
            heapq.heappush(heap, (end, wk.index))
            return
        out = sched.schedule()
        for r in sched.rejected:
            record(r)
        sched.rejected.clear()
        if out.is_empty:
            wk.busy = False
            return
        context = 0
        for rid, n in out.num_scheduled_tokens.items():
            context += sched.requests[rid].num_computed_tokens + n
        dt = (
            cost.step_time(out.total_num_scheduled_tokens, out.num_seqs, context)
            + fleet.service.step_overhead_s
        ) * wk.noise.step()
        dt += _first_shape(wk, cost, cost.rows(out.total_num_scheduled_tokens), fleet.shape_cache)
        wk.busy = True
        wk.steps += 1
        wk.busy_s += dt
        heapq.heappush(heap, (wk.now + dt, wk.index))
        wk.in_flight = out

    def end_step(wk: _Worker, t: float) -> None:
        sched = wk.sched
        out, wk.in_flight = wk.in_flight, None
        if out is not None:  # the step ran from wk.now to t: the slo policy's view of the host's speed
            sched.observe_step_time(out.modelled_s, t - wk.now)
        wk.now = t
        if out is not None:
            sampled = {}
            for rid, n in out.num_scheduled_tokens.items():
                req = sched.requests.get(rid)
                if req is not None and req.num_computed_tokens + n >= req.num_tokens:
                    sampled[rid] = _TOKEN
            for req in sched.update_from_output(out, sampled):
                if req.finished:
                    record(req)
        fetch(wk)
        start_step(wk)

    i = 0
    while i < len(routed) or heap:
        # A request reaches its worker's queue intake_s after it arrives; a constant delay keeps the
        # arrival order (the gateway's pending count thus starts at that instant, a small undercount).
        if heap and (i >= len(routed) or heap[0][0] <= routed[i][1].arrival + intake):
            t, w = heapq.heappop(heap)
            end_step(workers[w], t)
            continue
        idx, r, w = routed[i]
        i += 1
        wk = workers[w]
        wk.next_arrival.popleft()
        if max_pending is not None and pending >= max_pending:
            rejected += 1
            continue
        pending += 1
        rid = f"r{idx}"
        params = SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True)
        req = Request(
            rid,
            [_TOKEN] * r.prompt_len,
            params,
            None,
            arrival_time=r.arrival,
            priority=r.priority,
            slo_ttft_s=cfg.slo_ttft_s,
            slo_tpot_s=cfg.slo_tpot_s,
        )
        wk.queue.append((idx, req))
        if not wk.busy:
            wk.now = max(wk.now, r.arrival + intake)
            fetch(wk)
            start_step(wk)

    num_steps = sum(wk.steps for wk in workers)
    span = max(last_end, requests[-1].arrival if requests else 0.0)
    return {
        "workers": fleet.workers,
        "simulated_workers": simulated,
        "partitions": n_part,
        "max_pending": fleet.max_pending,
        "num_requests": len(routed),
        "num_completed": len(ttft),
        "num_rejected_gateway": rejected,
        "num_rejected_slo": slo_rejected,
        "num_good": num_good,
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "tpot_p50_s": percentile(tpot, 50),
        "tpot_p99_s": percentile(tpot, 99),
        "output_tok_s": out_tokens / span / share if span > 0 else math.nan,
        "goodput_req_s": num_good / span / share if span > 0 else math.nan,
        "duration_s": span,
        "steps": num_steps,
        "fast_forwarded_steps": sum(wk.fast_steps for wk in workers),
        # Share of the simulated workers' time spent stepping: queueing delay grows as 1 / (1 - this),
        # so a step-time error of a few tens of percent moves TTFT near saturation by far more.
        "utilisation": sum(wk.busy_s for wk in workers) / (span * simulated) if span > 0 else math.nan,
        "sim_wall_s": time.perf_counter() - wall0,
    }


def _first_shape(wk: _Worker, cost: StepCostModel, num_tokens: int, cache: int | None) -> float:
    """What a step of ``num_tokens`` rows (cost.rows: padded) pays for its shape: cost.first_shape
    if the worker has not run that count or has run ``cache`` others since; 0 if shapes are not
    modelled."""
    seen = wk.seen
    if seen is None:
        return 0.0
    if num_tokens in seen:
        seen.move_to_end(num_tokens)
        return 0.0
    seen[num_tokens] = None
    if cache is not None and len(seen) > cache:
        seen.popitem(last=False)
    return cost.first_shape


def _fast_forward(
    wk: _Worker, cost: StepCostModel, max_waiting: int | None, record: Any, overhead: float = 0.0
) -> float | None:
    """Apply k > 1 decode-only steps at once when nothing could change the batch sooner; returns when
    they end (the worker's clock is already there: what finished has finished), None if not."""
    sched = wk.sched
    running = sched.running
    if not running or sched.config.scheduling_policy == "priority":
        return None
    seats_full = len(running) >= sched.config.max_num_seqs
    if sched.num_waiting and not seats_full:
        return None
    # All decodes: one token left each and a token already out (one token left and none out is the
    # last token of a prefill, whose step samples the first token).
    if any(r.num_tokens - r.num_computed_tokens != 1 or r.timeline.first_token is None for r in running):
        return None
    max_len = sched.config.max_model_len
    k = min(
        min(r.max_tokens or max_len, max_len - r.num_prompt_tokens) - r.num_output_tokens for r in running
    )
    num_seqs = len(running)
    if wk.seen is not None:
        shape = cost.rows(num_seqs)
        if shape not in wk.seen:
            return None  # its first step pays the new shape: stepped alone, the run follows
        wk.seen.move_to_end(shape)
    context = sum(r.num_tokens for r in running)
    room = max_waiting is None or sched.num_waiting < max_waiting
    factor = wk.noise.run(k)  # drawn for the longest run; the horizon below is in model time
    limit = wk.noise.until_change()  # a traced speed holds only until its next window
    if room and wk.next_arrival:
        limit = min(limit, wk.next_arrival[0] - wk.now)
    if limit < math.inf:
        # Steps 1..k-1 must end before the next arrival: one arriving during step m joins step m + 1.
        # Likewise before the host's traced speed changes.
        horizon = limit / factor
        lo, hi = 1, k
        while lo < hi:  # the largest m <= k with the first m - 1 steps ending before the horizon
            mid = (lo + hi + 1) // 2
            if cost.decode_run_time(num_seqs, context, mid - 1) + (mid - 1) * overhead < horizon:
                lo = mid
            else:
                hi = mid - 1
        k = lo
    if k < 2:
        return None
    kv = sched.kv
    need = sum(
        max(0, kv.blocks_needed(r.num_computed_tokens + k) - len(kv.req_blocks.get(r.request_id, ())))
        for r in running
    )
    if need > kv.num_free_blocks:
        return None
    modelled = cost.decode_run_time(num_seqs, context, k)
    run = (modelled + k * overhead) * factor
    sched.observe_step_time(modelled, run)
    end = wk.now + run
    for r in list(running):
        kv.allocate_slots(r, k)
        r.num_computed_tokens += k
        new = [_TOKEN] * k
        r.output_token_ids.extend(new)
        r.all_token_ids.extend(new)
        r.timeline.last_token = end
    wk.now = end
    for r in list(running):
        if r.num_output_tokens >= (r.max_tokens or max_len) or r.num_tokens >= max_len:
            sched.finish_request(r.request_id, RequestStatus.FINISHED_LENGTH)
            record(r)
    wk.steps += k
    wk.fast_steps += k
    wk.busy_s += run
    return end
