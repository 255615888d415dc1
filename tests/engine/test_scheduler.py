"""Scheduler behaviour step by step, with a fake model (the scheduler never touches tensors)."""

from __future__ import annotations

import pytest

from engine.request import RequestStatus
from engine.sched.scheduler import EngineQueueFull
from tests.engine.sched_utils import EOS, make_request, make_scheduler, scheduled, step


def batch_ids(out) -> list[str]:
    return list(out.num_scheduled_tokens)


def test_seed_six_iteration_timeline() -> None:
    """The article's timeline: A, B, C run; D arrives; A finishes and D joins; C is cancelled, E joins."""
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=64)
    reqs = {name: make_request(name, 8, max_tokens=100, first_token=i * 7) for i, name in enumerate("ABCDE")}
    for name in "ABC":
        sched.add_request(reqs[name])
    out = step(sched)  # prefill A, B, C together (the article assumes this done before iteration 1)
    assert sorted(batch_ids(out)) == ["A", "B", "C"]

    out = step(sched)  # iteration 1
    assert sorted(batch_ids(out)) == ["A", "B", "C"]
    assert all(out.num_scheduled_tokens[n] == 1 for n in "ABC")

    sched.add_request(reqs["D"])  # iteration 2: D arrives, no seat
    out = step(sched)
    assert sorted(batch_ids(out)) == ["A", "B", "C"]
    assert reqs["D"].status == RequestStatus.WAITING

    out = step(sched, {"A": EOS})  # iteration 3: A hits EOS and leaves with its blocks
    assert sorted(batch_ids(out)) == ["A", "B", "C"]
    assert reqs["A"].status == RequestStatus.FINISHED_STOPPED
    assert sched.kv.block_ids("A") == []

    out = step(sched)  # iteration 4: D joins with its prefill beside B and C's decodes
    assert sorted(batch_ids(out)) == ["B", "C", "D"]
    assert out.num_scheduled_tokens["D"] == 8 and out.new_req_ids == ["D"]

    sched.add_request(reqs["E"])  # iteration 5: E arrives, C is cancelled after the step
    out = step(sched)
    assert sorted(batch_ids(out)) == ["B", "C", "D"]
    sched.finish_request("C", RequestStatus.FINISHED_ABORTED)
    assert reqs["E"].status == RequestStatus.WAITING

    out = step(sched)  # iteration 6: E takes C's seat
    assert sorted(batch_ids(out)) == ["B", "D", "E"]
    assert "C" in out.finished_req_ids
    assert reqs["C"].status == RequestStatus.FINISHED_ABORTED
    sched.kv.check_integrity()


def test_chunked_prefill_shares_budget_with_decodes() -> None:
    sched = make_scheduler(max_num_batched_tokens=16, block_size=4)
    sched.add_request(make_request("short", 4, max_tokens=50))
    step(sched)  # short prefilled
    sched.add_request(make_request("long", 40, max_tokens=4, first_token=200))
    out = step(sched)
    # The decode goes first and costs 1 token; the long prompt takes the 15 left.
    assert out.num_scheduled_tokens == {"short": 1, "long": 15}
    out = step(sched)
    assert out.num_scheduled_tokens == {"short": 1, "long": 15}
    out = step(sched)
    assert out.num_scheduled_tokens == {"short": 1, "long": 10}  # the rest, and it samples
    assert sched.requests["long"].num_output_tokens == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget() -> None:
    sched = make_scheduler(num_blocks=200, max_num_batched_tokens=300, chunked_prefill=False)
    sched.add_request(make_request("a", 250, max_tokens=5))
    sched.add_request(make_request("b", 100, max_tokens=5, first_token=200))
    out = step(sched)
    assert batch_ids(out) == ["a"]  # b does not fit in the 50 tokens left, and is not chunked
    out = step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 100}


def test_preemption_by_recompute_when_blocks_run_out() -> None:
    # 6 blocks of 4 tokens: two requests of 8-token prompts take 2 blocks each; as they grow, the
    # later one is preempted, then recomputed from scratch once blocks free up.
    sched = make_scheduler(num_blocks=6, block_size=4, prefix_caching=False)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    preempted = []
    for _ in range(40):
        if not sched.has_unfinished():
            break
        out = step(sched)
        preempted += out.preempted_req_ids
    assert preempted and preempted[0] == "b"
    assert b.timeline.num_preemptions >= 1
    assert sched.num_allocation_failures >= len(preempted)
    assert a.status == b.status == RequestStatus.FINISHED_LENGTH
    assert a.num_output_tokens == b.num_output_tokens == 8
    assert sched.kv.num_free_blocks == 6


def test_prefix_cache_hit_skips_computed_blocks() -> None:
    sched = make_scheduler(block_size=4)
    first = make_request("first", 10, max_tokens=2)
    sched.add_request(first)
    while sched.has_unfinished():
        step(sched)
    second = make_request("second", 10, max_tokens=2)  # the same 10-token prompt
    sched.add_request(second)
    out = step(sched)
    # Two full blocks (8 tokens) come from the cache; only the remaining 2 are computed.
    assert out.num_cached_tokens["second"] == 8
    assert out.num_scheduled_tokens["second"] == 2
    assert sched.kv.pool.num_cache_hits == 8


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    sched = make_scheduler(block_size=4)
    sched.add_request(make_request("x", 8, max_tokens=1))
    while sched.has_unfinished():
        step(sched)
    sched.add_request(make_request("y", 8, max_tokens=1))
    out = step(sched)
    assert out.num_cached_tokens["y"] == 4 and out.num_scheduled_tokens["y"] == 4


def test_priority_preempts_a_less_urgent_running_request() -> None:
    sched = make_scheduler(max_num_seqs=2, policy="priority")
    sched.add_request(make_request("low1", 4, max_tokens=50, priority=5))
    sched.add_request(make_request("low2", 4, max_tokens=50, priority=5, first_token=30))
    step(sched)
    sched.add_request(make_request("urgent", 4, max_tokens=50, priority=0, first_token=60))
    out = step(sched)
    assert "urgent" in batch_ids(out)
    assert out.preempted_req_ids == ["low2"]  # the least urgent, latest arrival
    assert sched.requests["low2"].status == RequestStatus.PREEMPTED


def test_priority_orders_waiting_by_value_then_arrival() -> None:
    sched = make_scheduler(max_num_seqs=1, policy="priority")
    for name, prio in (("p3", 3), ("p1a", 1), ("p2", 2), ("p1b", 1)):
        sched.add_request(make_request(name, 4, max_tokens=1, priority=prio))
    order = []
    while sched.has_unfinished():
        order += [i for i in step(sched).new_req_ids]
    assert order == ["p1a", "p1b", "p2", "p3"]


def test_static_batching_admits_nothing_until_the_batch_drains() -> None:
    sched = make_scheduler(batching="static", max_num_seqs=4)
    sched.add_request(make_request("long", 4, max_tokens=10))
    sched.add_request(make_request("short", 4, max_tokens=2, first_token=40))
    step(sched)
    sched.add_request(make_request("late", 4, max_tokens=2, first_token=70))
    compositions = []
    while sched.has_unfinished():
        compositions.append(sorted(batch_ids(step(sched))))
    # "late" only runs once "long" has finished, although "short" freed a seat early.
    first_late = next(i for i, c in enumerate(compositions) if "late" in c)
    assert all("long" not in c for c in compositions[first_late:])
    assert any(c == ["long"] for c in compositions)


def test_max_num_seqs_and_budget_bound_each_step() -> None:
    sched = make_scheduler(max_num_seqs=3, max_num_batched_tokens=20)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", 9, max_tokens=3, first_token=i * 11))
    while sched.has_unfinished():
        out = sched.schedule()
        assert out.num_seqs <= 3 and out.total_num_scheduled_tokens <= 20
        sampled = {
            r.request_id: 50
            for r in scheduled(sched, out)
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens
        }
        sched.update_from_output(out, sampled)
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks


def test_bad_requests_are_refused_without_side_effects() -> None:
    sched = make_scheduler(num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(make_request("huge", 10, max_tokens=100))
    sched.add_request(make_request("ok", 4, max_tokens=4))
    with pytest.raises(ValueError, match="already in flight"):
        sched.add_request(make_request("ok", 4, max_tokens=4))
    assert sched.finish_request("nope", RequestStatus.FINISHED_ABORTED) is None
    assert list(sched.requests) == ["ok"]


def test_waiting_bound_sheds_load() -> None:
    sched = make_scheduler()
    object.__setattr__(sched.config, "max_waiting", 1)
    sched.add_request(make_request("a", 4))
    with pytest.raises(EngineQueueFull):
        sched.add_request(make_request("b", 4))


def test_request_timeline_events_in_order() -> None:
    sched = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=5, prefix_caching=False)
    a, b = make_request("a", 8, max_tokens=8), make_request("b", 8, max_tokens=8, first_token=50)
    sched.add_request(a)
    sched.add_request(b)
    while sched.has_unfinished():
        step(sched)
    names = [e[0] for e in b.events]
    assert names[:3] == ["queued", "admitted", "prefill_chunk"]
    assert "preempted" in names and "resumed" in names
    assert names.index("preempted") < names.index("resumed")
    assert names[-1] == "finished" and b.events[-1][2]["reason"] == "length"
    assert names.count("first_token") == 1
    times = [e[1] for e in b.events]
    assert times == sorted(times)
    chunks = [e[2]["tokens"] for e in a.events if e[0] == "prefill_chunk"]
    assert sum(chunks[:2]) == 8 and max(chunks) <= 5  # chunked under the 5-token budget
