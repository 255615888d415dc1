"""The scheduler asks its policy, and only its policy, for order, chunks, seats, rejections and victims:
a policy written here, outside the scheduler, steers it through the interface alone."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest

from engine.request import Request, RequestStatus
from engine.sched.output import SchedulerOutput
from engine.sched.policy import PriorityPolicy, SchedulingPolicy, make_policy
from engine.sched.scheduler import Scheduler
from engine.sched.slo_policy import SLOPolicy
from tests.engine.sched_utils import EOS, make_request, make_scheduler, step


class SmallSteps(SchedulingPolicy):
    """Chunks of at most 3 tokens, two seats, ids starting with x rejected, step times recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.observed: list[tuple[float, float]] = []
        self.planned: list[dict[str, int]] = []

    def begin_step(
        self, running: list[Request], now: float, tokens_left: Callable[[Request], int]
    ) -> list[tuple[Request, str]]:
        return [(r, f"{r.request_id} is not served here") for r in self.waiting if r.request_id[0] == "x"]

    def cap_chunk(
        self, request: Request, num_new: int, out: SchedulerOutput, scheduled: Sequence[Request]
    ) -> int:
        return min(num_new, 3)

    def admits(self, request: Request, running: Sequence[Request]) -> bool:
        return len(running) < 2

    def end_step(self, out: SchedulerOutput, scheduled: Sequence[Request]) -> None:
        self.planned.append(dict(out.num_scheduled_tokens))

    def observe_step_time(self, modelled_s: float, measured_s: float) -> None:
        self.observed.append((modelled_s, measured_s))


class OldestFirst(SchedulingPolicy):
    """When blocks run out, the earliest admitted request gives way (fcfs: the latest)."""

    def victim(self, running: Sequence[Request]) -> Request:
        return running[0]


def with_policy(policy: SchedulingPolicy, **kw: int) -> Scheduler:
    base = make_scheduler(**kw)
    return Scheduler(base.config, base.kv, {EOS}, policy=policy)


def test_a_given_policy_decides_chunks_seats_and_rejections() -> None:
    policy = SmallSteps()
    sched = with_policy(policy)
    for name in ("a", "x1", "b", "c"):
        sched.add_request(make_request(name, 8, max_tokens=2, first_token=ord(name[-1])))
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 3, "b": 3}  # c waits: two seats
    [rejected] = sched.rejected
    assert rejected.request_id == "x1" and rejected.status == RequestStatus.FINISHED_ERROR
    assert rejected.error == "x1 is not served here" and "x1" not in sched.requests
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert step(sched).num_scheduled_tokens == {"a": 3, "b": 3}
    assert step(sched).num_scheduled_tokens == {"a": 2, "b": 2}  # prompts done: first tokens
    assert step(sched).num_scheduled_tokens == {"a": 1, "b": 1}  # second tokens: both finish
    assert step(sched).num_scheduled_tokens == {"c": 3}
    assert policy.planned[:2] == [{"a": 3, "b": 3}] * 2 and len(policy.planned) == 5
    sched.observe_step_time(0.01, 0.03)
    assert policy.observed == [(0.01, 0.03)]
    while sched.has_unfinished():
        step(sched)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


@pytest.mark.parametrize(("policy", "victim"), [(SchedulingPolicy(), "b"), (OldestFirst(), "a")])
def test_the_policy_picks_who_is_preempted_when_blocks_run_out(policy: SchedulingPolicy, victim: str) -> None:
    # Two prompts of 8 fill 4 of 5 blocks; their first decodes need a block each: one must give way.
    sched = with_policy(policy, num_blocks=5, block_size=4)
    sched.add_request(make_request("a", 8, max_tokens=8, first_token=1))
    sched.add_request(make_request("b", 8, max_tokens=8, first_token=40))
    step(sched)
    out = step(sched)
    assert out.preempted_req_ids == [victim]
    assert [r.request_id for r in sched.running] == [{"a": "b", "b": "a"}[victim]]
    assert [r.request_id for r in sched.waiting] == [victim]


def test_the_config_names_the_policy_once() -> None:
    fcfs = make_scheduler(policy="fcfs").config
    assert type(make_policy(fcfs)) is SchedulingPolicy
    assert isinstance(make_policy(make_scheduler(policy="priority").config), PriorityPolicy)
    slo = make_policy(make_scheduler(policy="slo").config)
    assert isinstance(slo, SLOPolicy) and slo.cost is None and slo.host_speed is None
    sched = make_scheduler(policy="priority")
    assert sched.waiting is sched.policy.waiting
