"""Timelines, batch matrix and trace export on a real (tiny) engine run, continuous and static."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.results import RunResult
from bench.stats import summarize
from bench.targets import TargetConfig
from bench.targets.engine import EngineTarget
from bench.timeline import ABSENT, DECODE, PREFILL, WAITING, batch_matrix, chrome_trace, request_timelines
from inflight.plan.workload import RequestSpec

# Two requests at once, then three more while they run. The first two generate long enough (tens of
# steps) that the others arrive while they run even where a tiny-model step takes a millisecond.
SPECS = [
    RequestSpec("r0", 0.0, tuple(range(10, 40)), 48),
    RequestSpec("r1", 0.0, tuple(range(50, 62)), 40),
    RequestSpec("r2", 0.01, tuple(range(70, 90)), 7),
    RequestSpec("r3", 0.02, tuple(range(100, 105)), 9),
    RequestSpec("r4", 0.03, tuple(range(200, 248)), 6),
]


@pytest.fixture(scope="module")
def runs(tiny_model: Path) -> dict[str, RunResult]:
    config = TargetConfig(model=str(tiny_model), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128)
    out = {}
    for name in ("continuous", "static"):
        target = EngineTarget(name, config)
        target.warmup(SPECS[:1])
        out[name] = target.run(SPECS, "test", 100.0)
        target.close()
    return out


@pytest.mark.parametrize("name", ["continuous", "static"])
def test_every_request_gets_exactly_its_tokens(runs: dict[str, RunResult], name: str) -> None:
    run = runs[name]
    assert [r.num_output_tokens for r in run.requests] == [s.max_tokens for s in SPECS]
    for r in run.requests:
        assert r.first_scheduled is not None and r.prefill_done is not None
        assert r.arrival <= r.first_scheduled <= r.prefill_done <= r.token_times[0]
        assert r.token_times == sorted(r.token_times)
    assert summarize(run)["num_completed"] == len(SPECS)


@pytest.mark.parametrize("name", ["continuous", "static"])
def test_steps_record_engine_state(runs: dict[str, RunResult], name: str) -> None:
    steps = runs[name].steps
    assert [s.step for s in steps] == list(range(steps[0].step, steps[0].step + len(steps)))
    for s in steps:
        assert s.num_scheduled_seqs == len(s.batch) <= 4
        assert s.num_scheduled_tokens == sum(n for _, n, _ in s.batch) <= 32
        assert s.start < s.end and s.schedule_time + s.execute_time <= s.duration + 1e-6
        assert 0 < s.prepare_time < s.execute_time  # the runner's input-preparation hook is set
        # Allocated-but-empty slots: less than one block per running request.
        assert 0 <= s.kv_slots_empty < 16 * max(1, s.num_running)
        assert s.kv_slots_used % 16 == 0
    assert sum(s.num_scheduled_tokens for s in steps) == sum(
        sp.num_prompt_tokens + sp.max_tokens - 1 for sp in SPECS
    )


@pytest.mark.parametrize("name", ["continuous", "static"])
def test_batch_matrix(runs: dict[str, RunResult], name: str) -> None:
    run = runs[name]
    ids, matrix = batch_matrix(run)
    assert ids == [s.request_id for s in SPECS]
    assert all(len(row) == len(run.steps) for row in matrix)
    for spec, row in zip(SPECS, matrix, strict=True):
        active = [v for v in row if v != ABSENT]
        # Waiting, then prefill chunk(s), then one decode per token after the first.
        first_prefill = active.index(PREFILL)
        assert set(active[:first_prefill]) <= {WAITING}
        assert row.count(DECODE) == spec.max_tokens - 1
        assert max(i for i, v in enumerate(row) if v == PREFILL) < min(
            i for i, v in enumerate(row) if v == DECODE
        )


def test_static_admits_nobody_into_a_running_batch(runs: dict[str, RunResult]) -> None:
    static = runs["static"]
    _, matrix = batch_matrix(static)
    for col in range(len(static.steps)):
        admitted = [row[col] == PREFILL and (col == 0 or row[col - 1] != PREFILL) for row in matrix]
        if any(admitted) and col > 0:
            # A new batch starts only after the previous step left nobody running.
            assert static.steps[col - 1].num_running == 0
    # r2..r4 arrive while r0, r1 run: under static batching they wait, under continuous they join.
    cont = {t["request_id"]: t for t in request_timelines(runs["continuous"], 4)}
    stat = {t["request_id"]: t for t in request_timelines(static, 4)}
    assert stat["r2"]["waiting_steps"] > cont["r2"]["waiting_steps"]
    assert stat["r2"]["held_with_free_seats"] > 0
    assert stat["r2"]["held_with_free_seats_and_budget"] > 0  # the batching rule, not budget or KV
    assert cont["r2"]["held_with_free_seats_and_budget"] == 0  # the KV pool is never short here


def test_request_timelines(runs: dict[str, RunResult]) -> None:
    tl = request_timelines(runs["continuous"], 4)
    assert [t["request_id"] for t in tl] == [s.request_id for s in SPECS]
    for t, spec in zip(tl, SPECS, strict=True):
        assert len(t["decode_steps"]) == spec.max_tokens - 1
        assert t["prefill_steps"] and max(t["prefill_steps"]) < min(t["decode_steps"])
        assert t["first_token"] >= t["arrival"] and t["output_tokens"] == spec.max_tokens
        names = [e[0] for e in t["events"]]
        assert names[:2] == ["queued", "admitted"] and names[-1] == "finished"
    json.dumps(tl)


def test_chrome_trace_shape(runs: dict[str, RunResult]) -> None:
    trace = chrome_trace(runs.values())
    events = trace["traceEvents"]
    json.loads(json.dumps(trace))  # plain JSON, no NaN
    assert {e["ph"] for e in events} == {"M", "X", "C", "i"}
    for e in events:
        if e["ph"] in ("X", "C", "i"):
            assert isinstance(e["ts"], float) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    for pid, run in enumerate(runs.values(), start=1):
        steps = [e for e in events if e["pid"] == pid and e.get("cat") == "step"]
        assert len(steps) == len(run.steps)
        assert steps[0]["args"]["requests"] == [f"{rid}:{n}" for rid, n, _ in run.steps[0].batch]
        names = {e["args"]["name"] for e in events if e["pid"] == pid and e["name"] == "thread_name"}
        assert names == {"engine steps"} | {s.request_id for s in SPECS}
        firsts = [e for e in events if e["pid"] == pid and e["name"] == "first token"]
        assert len(firsts) == len(SPECS)
        marks = {e["name"] for e in events if e["pid"] == pid and e["ph"] == "i"}
        assert {"queued", "admitted", "prefill_chunk", "finished"} <= marks


def test_run_json_round_trip(runs: dict[str, RunResult]) -> None:
    run = runs["continuous"]
    back = RunResult.from_json(json.loads(json.dumps(run.to_json())))
    assert back.requests == run.requests and back.steps == run.steps
    assert summarize(back) == summarize(run)
