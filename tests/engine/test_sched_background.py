"""fcfs with background work: a batch's lines (priority >= BACKGROUND_PRIORITY) wait behind every other
waiting request, so interactive requests that arrive after them are admitted first."""

from __future__ import annotations

from engine.sched.policy import BACKGROUND_PRIORITY
from tests.engine.sched_utils import make_request, make_scheduler, step


def test_fcfs_admits_interactive_requests_before_queued_background_ones() -> None:
    sched = make_scheduler(max_num_seqs=1)
    for i in range(3):
        sched.add_request(make_request(f"b{i}", 4, max_tokens=2, priority=BACKGROUND_PRIORITY))
    step(sched)  # b0 takes the only seat
    sched.add_request(make_request("i0", 4, max_tokens=2))
    sched.add_request(
        make_request("i1", 4, max_tokens=2, priority=5)
    )  # fcfs: any other priority is foreground
    assert [r.request_id for r in sched.waiting] == ["i0", "i1", "b1", "b2"]
    admitted = []
    for _ in range(40):
        out = step(sched)
        admitted += [r for r in out.num_scheduled_tokens if r not in admitted and r != "b0"]
        if not sched.num_waiting and not sched.running:
            break
    assert admitted == ["i0", "i1", "b1", "b2"]


def test_the_gateway_marks_batch_lines_as_background() -> None:
    from services.gateway.batches import BATCH_PRIORITY

    assert BATCH_PRIORITY >= BACKGROUND_PRIORITY
