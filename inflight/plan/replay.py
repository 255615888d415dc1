"""The measured side of the planner's validation: a trace replayed in real time on real engines.

One engine per worker, each in its own process with its own intra-op threads (a worker is a pod with
its own cores), each fed the requests of the partitions it owns, as the simulator routes them. Every
engine replays open loop, as the benchmark's driver does: a request joins at the first step boundary
after its arrival, and its wait for that boundary is part of its TTFT.

Besides token times, every step is recorded with what a step-cost model cannot see on its own:

    wall       around ``step()``: what ``inflight plan calibrate`` times and the model predicts
    engine     the engine's own StepRecord (schedule + inputs + model + sampling); wall - engine is
               output processing (detokenising, collecting outputs)
    cpu        this process's CPU time over the step: with one intra-op thread, wall - cpu is time the
               process waited for a core (other work on the host), which no model of the engine has
    gap        busy time between the end of one step and the start of the next (the loop's own work)
    new_shape  the first step of this many tokens in the process: kernels specialised on the shape
               pay a first-call cost there (bf16 on CPU: oneDNN creates a matmul primitive per row
               count, ONEDNN_VERBOSE=2 shows create:cache_miss for each new one)
    recency    how many other token counts ran since this one last did (-1: never): oneDNN keeps
               its primitives in an LRU cache (1,024 by default, four linear shapes a token count),
               so a count unused for long enough pays the first-call cost again
and the garbage collector's pauses (``gc.callbacks``) over the run.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import queue
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.models.row_padding import RowPadding


@dataclass(frozen=True)
class StepTiming:
    start: float  # seconds after the run's start
    wall: float
    engine: float
    cpu: float
    gap: float  # 0 when the engine was idle before this step
    num_tokens: int
    num_seqs: int
    sum_context: int
    num_decode_rows: int
    new_shape: bool
    recency: int = -1


@dataclass
class WorkerRun:
    token_times: dict[str, list[float]]  # request id -> seconds after the run's start, one per token
    steps: list[StepTiming] = field(default_factory=list)
    gc_pause_s: float = 0.0
    gc_collections: int = 0
    threads: int = 1
    warm_shapes: frozenset[int] = frozenset()  # token counts the warm-up ran before the trace
    # The worker's own calibration just before the trace (replay_fleet's ``grid``): a
    # calibrate.Timed, every worker timing its steps side by side as they then serve.
    calibration: Any = None


class _GCTimer:
    """Sums the collector's pauses while installed (a callback runs at each collection's start and stop)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0
        self._began = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._began = time.perf_counter()
        else:
            self.total += time.perf_counter() - self._began
            self.count += 1


def replay(engine: Any, specs: Sequence[Any], t0: float, prompt_lens: dict[str, int]) -> WorkerRun:
    """Replay ``specs`` (sorted by arrival, seconds after ``t0`` on the monotonic clock) on ``engine``."""
    from engine.inputs import EngineRequest
    from engine.sampling_params import SamplingParams

    for tokens in sorted(_warm_shapes(engine)):
        note_shape(tokens)
    rows = engine_padding(engine).padded
    order = PROCESS_SHAPES
    run = WorkerRun({s.request_id: [] for s in specs}, warm_shapes=frozenset(order))
    timer = _GCTimer()
    gc.callbacks.append(timer)
    last_end: float | None = None
    i = 0
    try:
        while i < len(specs) or engine.has_unfinished_requests():
            now = time.monotonic() - t0
            while i < len(specs) and specs[i].arrival <= now:
                s = specs[i]
                params = SamplingParams(max_tokens=s.max_tokens, temperature=0.0, ignore_eos=True)
                request = EngineRequest(
                    s.request_id, list(s.prompt_token_ids), params, arrival_time=t0 + s.arrival
                )
                engine.add_request(request)
                i += 1
            if not engine.has_unfinished_requests():
                time.sleep(max(0.0, specs[i].arrival - now))
                last_end = None
                continue
            before = engine.metrics.num_steps
            cpu0 = time.process_time()
            start = time.monotonic()
            outputs = engine.step()
            end = time.monotonic()
            cpu = time.process_time() - cpu0
            if engine.metrics.num_steps > before:
                rec = engine.metrics.steps[-1]
                tokens = rec.num_tokens
                shape = rows(tokens)
                run.steps.append(
                    StepTiming(
                        start=start - t0,
                        wall=end - start,
                        engine=rec.duration,
                        cpu=cpu,
                        gap=0.0 if last_end is None else start - last_end,
                        num_tokens=tokens,
                        num_seqs=len(rec.batch),
                        sum_context=rec.sum_context,
                        num_decode_rows=sum(
                            1
                            for rid, n, done in rec.batch
                            if n == 1 and done >= prompt_lens.get(rid, 1 << 30)
                        ),
                        new_shape=shape not in order,
                        recency=note_shape(shape),
                    )
                )
            last_end = end
            t = end - t0
            for out in outputs:
                run.token_times[out.request_id].extend([t] * sum(len(c.token_ids) for c in out.outputs))
    finally:
        gc.callbacks.remove(timer)
    run.gc_pause_s, run.gc_collections = timer.total, timer.count
    return run


# Token counts that engines driven by this process have run, least recently first. Compiled shapes are
# the process's (oneDNN's primitive cache is global), so a second engine, or a calibration earlier in
# the same process, finds warm what the first ran; calibrate and replay both note theirs here.
PROCESS_SHAPES: OrderedDict[int, None] = OrderedDict()


def note_shape(tokens: int) -> int:
    """Mark ``tokens`` as just run; returns how many other counts ran since it last did (-1: never)."""
    order = PROCESS_SHAPES
    if tokens in order:
        recency = len(order) - 1 - list(order).index(tokens)
        order.move_to_end(tokens)
        return recency
    order[tokens] = None
    return -1


def engine_padding(engine: Any) -> RowPadding:
    """The in-process engine's row padding (grain 1 where it pads none)."""
    padding: RowPadding | None = engine.runner.model.kernels.row_padding
    return padding or RowPadding(1, 0)


def _warm_shapes(engine: Any) -> set[int]:
    """The shapes the engine built before the trace: its warm-up steps' row counts, and every padded
    count when it pads (all built when the model loaded)."""
    padding = engine_padding(engine)
    ran = {padding.padded(rec.num_tokens) for rec in engine.metrics.steps}
    return ran | set(padding.built())


def make_engine(model: str, engine_args: dict[str, Any]) -> Any:
    """An engine warmed up as the benchmark warms its targets: every code path runs once, unmeasured."""
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams
    from inflight.plan.workload import warmup_specs

    engine = LLMEngine.from_engine_args(model, **engine_args)
    for i, s in enumerate(warmup_specs(engine.config.model.vocab_size, engine.config.max_model_len)):
        engine.add_request(
            f"warm-{i}", list(s.prompt_token_ids), SamplingParams(max_tokens=4, ignore_eos=True)
        )
    while engine.has_unfinished_requests():
        engine.step()
    return engine


def _worker_main(
    model: str,
    specs: list[Any],
    engine_args: dict[str, Any],
    threads: int,
    barrier: Any,
    results: Any,
    grid: Any = None,
) -> None:
    import torch

    torch.set_num_threads(threads)
    engine = make_engine(model, engine_args)
    timed = None
    if grid is not None:
        from inflight.plan.calibrate import time_steps

        barrier.wait()  # every engine loaded: the calibrations run side by side
        timed = time_steps(engine, model, grid)
    barrier.wait()  # every engine loaded and warm (and calibrated): the trace starts for all at once
    t0 = time.monotonic()
    run = replay(engine, specs, t0, {s.request_id: s.num_prompt_tokens for s in specs})
    run.threads = threads
    run.calibration = timed
    results.put(run)


def replay_fleet(
    model: str,
    parts: Sequence[Sequence[Any]],
    engine_args: dict[str, Any],
    threads: int,
    grid: Any = None,
) -> list[WorkerRun]:
    """One engine process per part (a worker's share of the trace), started together. With ``grid``
    (a calibrate.Grid) each worker first calibrates its own engine, all at once, and the trace
    follows at once (WorkerRun.calibration)."""
    ctx = mp.get_context("spawn")  # a fresh interpreter: no torch state or threads inherited
    barrier = ctx.Barrier(len(parts))
    results = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker_main,
            args=(model, sorted(p, key=lambda s: s.arrival), engine_args, threads, barrier, results, grid),
            daemon=True,
        )
        for p in parts
    ]
    for p in procs:
        p.start()
    runs: list[WorkerRun] = []
    try:
        while len(runs) < len(procs):
            try:
                runs.append(results.get(timeout=1.0))
            except queue.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"a replay worker died (exit code {dead[0]})") from None
    finally:
        for p in procs:
            if len(runs) < len(procs):  # failed: the others may wait at the barrier forever
                p.kill()
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return runs
