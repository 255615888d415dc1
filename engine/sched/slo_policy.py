"""The ``slo`` policy as the scheduler sees it: deadlines order the queue, bound the chunks and seats,
and reject what is surely lost. The rules themselves are in engine/sched/slo.py; this class holds
their state across steps:

  * the cost model it plans with: the calibrated one scaled by the host's measured speed
    (engine/sched/host_speed.py), when steps are timed one at a time;
  * this step's time bound (``slo.step_time_cap``), set before the step is scheduled;
  * the recent step time, a moving mean of the planned steps over about a second, which the step cap
    expects of the next ones.

Without a cost model it orders by deadline only: chunks are whole and every seat is open.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from engine.config import EngineConfig
from engine.cost_model import StepCostModel
from engine.request import Request
from engine.sched.host_speed import HostSpeed
from engine.sched.output import SchedulerOutput
from engine.sched.policy import SchedulingPolicy
from engine.sched.slo import SLOQueue, lost_message, seat_fits, step_time_cap

_RECENT_S = 1.0  # seconds the recent step time averages over


def _context(out: SchedulerOutput, scheduled: Sequence[Request]) -> int:
    """The tokens the batch so far attends over: each row's computed tokens plus its new ones."""
    return sum(r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] for r in scheduled)


class SLOPolicy(SchedulingPolicy):
    def __init__(self, config: EngineConfig, cost: StepCostModel | None) -> None:
        self.headroom = config.slo_tpot_headroom
        self.horizon = config.slo_tpot_horizon
        self.reject = config.slo_reject
        self.max_model_len = config.max_model_len
        self.budget = config.max_num_batched_tokens
        self.chunked = config.enable_chunked_prefill
        self.block_size = config.block_size  # the smallest chunk a step always grants a prefill
        self.calibrated = cost
        self.cost = cost  # the calibrated model scaled by the host's speed
        window = config.slo_speed_window_s
        self.host_speed = HostSpeed(window) if cost is not None and window else None
        self.waiting: SLOQueue = SLOQueue(cost, self.budget, config.slo_starvation_s, self.block_size)
        self.step_cap: float | None = None
        self.recent_step_s: float | None = None

    def begin_step(
        self, running: list[Request], now: float, tokens_left: Callable[[Request], int]
    ) -> list[tuple[Request, str]]:
        rows = len(running)
        context = sum(r.num_computed_tokens for r in running)
        self.step_cap = None
        if self.cost is not None:
            floor = self.cost.step_time(rows, rows, context) if rows else 0.0
            self.step_cap = step_time_cap(
                running, now, self.headroom, self.max_model_len, floor, self.recent_step_s, self.horizon
            )
        self.waiting.reorder(now, (rows, context, self.step_cap))
        lost = self.waiting.lost() if self.reject else []
        # Decodes first, so the prefill chunks after them are sized against what the step already holds.
        running.sort(key=lambda r: tokens_left(r) > 1)
        return [(r, lost_message(r, now, self.cost, self.budget)) for r in lost]

    def cap_chunk(
        self, request: Request, num_new: int, out: SchedulerOutput, scheduled: Sequence[Request]
    ) -> int:
        """Cut a prefill chunk to what keeps the step within the tightest running TPOT deadline."""
        if self.step_cap is None or num_new <= 1 or not self.chunked:
            return num_new
        assert self.cost is not None
        fits = self.cost.max_chunk(
            self.step_cap,
            out.total_num_scheduled_tokens,
            out.num_seqs,
            _context(out, scheduled),
            request.num_computed_tokens,
        )
        if not any(n > 1 for n in out.num_scheduled_tokens.values()):
            fits = max(fits, self.block_size)  # one chunk a step always runs: no starved prefills
        return max(0, min(num_new, fits))

    def admits(self, request: Request, running: Sequence[Request]) -> bool:
        # One more row would push the decode step past the TPOT: it waits for a seat.
        return self.cost is None or seat_fits(self.cost, running, request, self.headroom)

    def end_step(self, out: SchedulerOutput, scheduled: Sequence[Request]) -> None:
        if self.calibrated is None or out.is_empty:
            return
        modelled = self.calibrated.step_time(
            out.total_num_scheduled_tokens, out.num_seqs, _context(out, scheduled)
        )
        if self.host_speed is not None:
            out.modelled_s = modelled
        # The step cap expects the next steps to take about as long as the recent ones. The model is
        # linear, so the scaled model's time is the calibrated one's times the factor.
        planned = modelled * (self.host_speed.factor if self.host_speed is not None else 1.0)
        if self.recent_step_s is None:
            self.recent_step_s = planned
        else:
            weight = 1.0 - math.exp(-planned / _RECENT_S)
            self.recent_step_s += weight * (planned - self.recent_step_s)

    def observe_step_time(self, modelled_s: float, measured_s: float) -> None:
        """Plan the next steps with the model scaled to the host's current speed."""
        if self.host_speed is None or self.calibrated is None:
            return
        if self.host_speed.observe(modelled_s, measured_s):
            self.cost = self.calibrated.scaled(self.host_speed.factor)
            self.waiting.cost = self.cost
