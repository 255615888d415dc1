"""Property tests: whatever arrives, aborts or finishes, the engine drains clean.

Once drained: every block is free, the pool's integrity holds, and every request reached exactly
one terminal state (checked by recording each transition into a finished status).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.request import RequestStatus
from tests.engine.sched_utils import EOS, check_runner_view, make_request, make_scheduler, scheduled

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(0, 3), st.integers(0, 3)
        ),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(0, 9)),
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    policy=st.sampled_from(["fcfs", "priority"]),
    batching=st.sampled_from(["continuous", "static"]),
    caching=st.booleans(),
    budget=st.integers(8, 64),
)
def test_random_traffic_drains_clean(ops, num_blocks, policy, batching, caching, budget) -> None:
    sched = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=64,
        policy=policy,
        batching=batching,
        prefix_caching=caching,
    )
    added = []
    terminal_transitions: dict[str, int] = {}

    def note_finished(before: dict[str, RequestStatus]) -> None:
        for r in added:
            if r.finished and not before[r.request_id].finished:
                terminal_transitions[r.request_id] = terminal_transitions.get(r.request_id, 0) + 1

    def do_step(eos_every: int) -> None:
        before = {r.request_id: r.status for r in added}
        out = sched.schedule()
        assert out.num_seqs <= 4 and out.total_num_scheduled_tokens <= budget
        sampled = {}
        check_runner_view(sched, out)
        for r in scheduled(sched, out):
            if r.num_computed_tokens + out.num_scheduled_tokens[r.request_id] == r.num_tokens:
                token = EOS if eos_every and (r.num_output_tokens + 1) % (eos_every + 3) == 0 else 50
                sampled[r.request_id] = token
        sched.update_from_output(out, sampled)
        sched.kv.check_integrity()
        note_finished(before)

    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, prio, family = op
            # Few prompt "families" so prefixes are shared and the cache gets hits.
            req = make_request(
                f"r{len(added)}", prompt_len, max_tokens, priority=prio, first_token=family * 13
            )
            try:
                sched.add_request(req)
            except ValueError:
                continue  # too large for the pool: refused, nothing else touched
            added.append(req)
        elif op[0] == "abort":
            if added:
                target = added[op[1] % len(added)]
                before = {r.request_id: r.status for r in added}
                sched.finish_request(target.request_id, RequestStatus.FINISHED_ABORTED)
                note_finished(before)
                sched.kv.check_integrity()
        else:
            do_step(op[1])

    for _ in range(2000):
        if not sched.has_unfinished():
            break
        do_step(0)
    assert not sched.has_unfinished(), "the engine did not drain"
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks
    assert not sched.kv.req_blocks
    sched.kv.check_integrity()
    for r in added:
        assert r.finished
        assert terminal_transitions.get(r.request_id) == 1, r
        if r.status == RequestStatus.FINISHED_LENGTH:
            assert r.num_output_tokens == r.max_tokens or r.num_tokens >= 64
