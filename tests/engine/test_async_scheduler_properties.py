"""Property test: the async scheduler, fed each step's tokens one step late, ends every request exactly
as the synchronous scheduler does, and drains clean.

The fake model's token for a request depends only on the request and the token's output index (as
greedy or seeded sampling does), so both schedulers must produce the same sequences and stop at the
same token, whatever the lag changes in the batches (admissions, preemptions, chunk sizes).
"""

from __future__ import annotations

import zlib

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import EngineConfig
from engine.kv_cache.manager import KVCacheManager
from engine.request import Request, RequestStatus
from engine.sched.async_scheduler import AsyncScheduler
from engine.sched.output import SchedulerOutput
from engine.sched.scheduler import Scheduler
from tests.engine.sched_utils import EOS, make_request, make_scheduler

MAX_MODEL_LEN = 64

ops = st.lists(
    st.one_of(
        st.tuples(
            st.just("add"), st.integers(1, 40), st.integers(1, 24), st.integers(0, 3), st.integers(0, 3)
        ),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.integers(1, 4)),
    ),
    min_size=1,
    max_size=50,
)


def fake_token(request: Request, eos_every: int) -> int:
    """The model's token at the request's next output index: EOS now and then, by the index alone."""
    index = request.num_output_tokens
    h = zlib.crc32(f"{request.request_id}:{index}".encode())
    return EOS if eos_every and h % (eos_every * 4) == 0 else 20 + h % 60


class Driver:
    """Steps one scheduler; the async one's tokens arrive after the next step is scheduled."""

    def __init__(self, sched: Scheduler, eos_every: int) -> None:
        self.sched = sched
        self.lagged = isinstance(sched, AsyncScheduler)
        self.eos_every = eos_every
        self.in_flight: tuple[SchedulerOutput, dict[str, Request], set[str]] | None = None
        self.runner_view: dict[str, list[int]] = {}
        self.added: list[Request] = []
        self.terminal: dict[str, int] = {}
        self.aborted: set[str] = set()  # targeted by an abort (finished or not at the time)
        self.num_samples: dict[str, int] = {}  # tokens sampled per request, kept or dropped

    def step(self) -> None:
        before = {r.request_id: r.finished for r in self.added}
        sched = self.sched
        out = sched.schedule()
        self.check_runner_view(out)
        if self.lagged:
            assert isinstance(sched, AsyncScheduler)
            if self.in_flight is not None:
                self.report(*self.in_flight)
            self.in_flight = None
            if not out.is_empty:
                step = sched._in_flight[-1]
                self.in_flight = (out, step.requests, step.sampling)
        else:
            live = {rid: sched.requests[rid] for rid in out.num_scheduled_tokens}
            sampling = {
                rid
                for rid, r in live.items()
                if r.num_computed_tokens + out.num_scheduled_tokens[rid] == r.num_tokens
            }
            self.report(out, live, sampling)
        sched.kv.check_integrity()
        self.note_finished(before)

    def report(self, out: SchedulerOutput, requests: dict[str, Request], sampling: set[str]) -> None:
        for rid in sampling:
            self.num_samples[rid] = self.num_samples.get(rid, 0) + 1
        sampled = {rid: fake_token(requests[rid], self.eos_every) for rid in sampling}
        self.sched.update_from_output(out, sampled)

    def abort(self, request: Request) -> None:
        before = {r.request_id: r.finished for r in self.added}
        self.aborted.add(request.request_id)
        self.sched.finish_request(request.request_id, RequestStatus.FINISHED_ABORTED)
        self.sched.kv.check_integrity()
        self.note_finished(before)

    def note_finished(self, before: dict[str, bool]) -> None:
        for r in self.added:
            if r.finished and not before[r.request_id]:
                self.terminal[r.request_id] = self.terminal.get(r.request_id, 0) + 1

    def check_runner_view(self, out: SchedulerOutput) -> None:
        """The block tables rebuilt from the outputs alone are the manager's, and cover the step."""
        view = self.runner_view
        for req_id in [*out.finished_req_ids, *out.preempted_req_ids]:
            view.pop(req_id, None)
        for new in out.scheduled_new_reqs:
            assert new.req_id not in view
            view[new.req_id] = list(new.block_ids)
        for cached in out.scheduled_cached_reqs:
            view[cached.req_id] += cached.new_block_ids
        for req_id, num_scheduled, num_computed in out.batch():
            assert view[req_id] == self.sched.kv.block_ids(req_id)
            assert len(view[req_id]) * self.sched.kv.block_size >= num_computed + num_scheduled
            # Never a position at max_model_len: the runner's rows end there.
            assert num_computed + num_scheduled < MAX_MODEL_LEN


def make(lagged: bool, **kw: object) -> Scheduler:
    sched = make_scheduler(**kw)  # type: ignore[arg-type]
    if not lagged:
        return sched
    config: EngineConfig = sched.config
    kv = KVCacheManager(sched.kv.num_total_blocks, config.block_size, config.enable_prefix_caching)
    return AsyncScheduler(config, kv, {EOS})


def run(lagged: bool, ops: list[tuple[int | str, ...]], eos_every: int, **kw: object) -> Driver:
    driver = Driver(make(lagged, **kw), eos_every)
    sched = driver.sched
    for op in ops:
        if op[0] == "add":
            _, prompt_len, max_tokens, prio, family = op
            assert isinstance(prompt_len, int) and isinstance(max_tokens, int)
            assert isinstance(prio, int) and isinstance(family, int)
            req = make_request(f"r{len(driver.added)}", prompt_len, max_tokens, prio, first_token=family * 13)
            try:
                sched.add_request(req)
            except ValueError:
                continue  # too large for the pool
            driver.added.append(req)
        elif op[0] == "abort":
            if driver.added:
                assert isinstance(op[1], int)
                driver.abort(driver.added[op[1] % len(driver.added)])
        else:
            assert isinstance(op[1], int)
            for _ in range(op[1]):
                driver.step()
    for _ in range(3000):
        if not sched.has_unfinished() and driver.in_flight is None:
            break
        driver.step()
    return driver


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=ops,
    num_blocks=st.integers(12, 40),
    policy=st.sampled_from(["fcfs", "priority"]),
    batching=st.sampled_from(["continuous", "static"]),
    caching=st.booleans(),
    budget=st.integers(8, 64),
    eos_every=st.integers(0, 3),
)
def test_lagged_tokens_end_every_request_as_the_synchronous_scheduler(
    ops, num_blocks, policy, batching, caching, budget, eos_every
) -> None:
    kw = dict(
        num_blocks=num_blocks,
        block_size=4,
        max_num_seqs=4,
        max_num_batched_tokens=budget,
        max_model_len=MAX_MODEL_LEN,
        policy=policy,
        batching=batching,
        prefix_caching=caching,
    )
    sync = run(False, ops, eos_every, **kw)
    lagged = run(True, ops, eos_every, **kw)
    sched = lagged.sched
    assert isinstance(sched, AsyncScheduler)
    assert not sched.has_unfinished() and sched.num_in_flight == 0, "the engine did not drain"
    assert sched.kv.num_free_blocks == sched.kv.num_total_blocks and not sched.kv.req_blocks
    sched.kv.check_integrity()
    assert [r.request_id for r in sync.added] == [r.request_id for r in lagged.added]
    assert sync.aborted == lagged.aborted
    for a, b in zip(sync.added, lagged.added, strict=True):
        assert b.finished and lagged.terminal.get(b.request_id) == 1, b
        assert b.num_output_placeholders == 0
        # No step is run for a request whose last token (by count) is already in flight.
        assert b.max_tokens is not None and lagged.num_samples.get(b.request_id, 0) <= b.max_tokens
        if b.status == RequestStatus.FINISHED_LENGTH:
            assert b.num_output_tokens == b.max_tokens or b.num_tokens >= MAX_MODEL_LEN
        if b.status == RequestStatus.FINISHED_STOPPED:
            assert b.output_token_ids[-1] == EOS and EOS not in b.output_token_ids[:-1]
        if a.request_id not in sync.aborted:
            assert b.output_token_ids == a.output_token_ids, b
            assert b.status == a.status
