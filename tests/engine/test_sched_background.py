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


def test_background_steps_aside_once_for_each_interactive_arrival() -> None:
    sched = make_scheduler(max_num_seqs=4)
    for i in range(2):
        sched.add_request(make_request(f"b{i}", 4, max_tokens=20, priority=BACKGROUND_PRIORITY))
    step(sched)
    assert set(step(sched).num_scheduled_tokens) == {"b0", "b1"}  # decoding
    sched.add_request(make_request("i0", 6, max_tokens=20))
    # The newcomer's prefill runs alone; the step after, everyone decodes together again.
    assert set(step(sched).num_scheduled_tokens) == {"i0"}
    assert set(step(sched).num_scheduled_tokens) == {"i0", "b0", "b1"}
    # Without a free seat the newcomer could not join this step: background work does not step aside.
    sched.add_request(make_request("b2", 4, max_tokens=20, priority=BACKGROUND_PRIORITY))
    step(sched)  # b2 takes the last seat
    assert sched.num_running == 4
    sched.add_request(make_request("i1", 6, max_tokens=3))
    assert {"b0", "b1", "b2"} <= set(step(sched).num_scheduled_tokens)


def test_a_newcomer_the_cache_cannot_take_holds_background_work_one_step_at_most() -> None:
    # Eight blocks of 4: the background pair holds six; the newcomer's prompt needs five blocks.
    sched = make_scheduler(num_blocks=8, block_size=4, max_num_seqs=4, prefix_caching=False)
    for i in range(2):
        sched.add_request(make_request(f"b{i}", 8, max_tokens=4, priority=BACKGROUND_PRIORITY))
    step(sched)
    sched.add_request(make_request("i0", 20, max_tokens=2))
    held = step(sched)
    assert not {"b0", "b1"} & set(held.num_scheduled_tokens)  # stepped aside once
    for _ in range(12):
        out = step(sched)
        if {"b0", "b1"} & set(out.num_scheduled_tokens):
            break
    else:
        raise AssertionError("background work stayed held behind a newcomer that could not join")
    for _ in range(40):  # and everything finishes
        step(sched)
        if not sched.num_waiting and not sched.running:
            break
    assert not sched.num_waiting and not sched.running
