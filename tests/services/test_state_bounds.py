"""What one request can make the services hold is bounded: every Redis key they write expires, each
request's keys no later than its record; a request's token log stops growing at ``INFLIGHT_MAX_LOG_BYTES``;
a grammar compile stops (its process killed) at the engine's ``grammar_compile_timeout_s``.

One stack for the module on a Redis of its own (the scan sees this module's keys only, none that another
test wrote by hand), with one worker paced at 20 ms a step (a stream is still running when its client
leaves, on any host), a small log bound and a 3 s compile bound.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess, start_redis
from services.common import keys
from tests.services.stack import MODEL_NAME, PACED_STEP_DELAY_S, REDIS_PASSWORD, Stack, new_stack, wait_for

pytestmark = pytest.mark.timeout(300)

LOG_BOUND = 20_000
COMPILE_BOUND_S = 3
# An alternation of 1,000 bounded repeats: 14 KB of regex that xgrammar compiles for minutes (its time
# grows with the square of the alternatives: 100 of them took 0.6 s on a 2-core host).
SLOW_REGEX = "(" + "|".join(f"[a-z]{{1,{i + 1}}}x" for i in range(1000)) + ")"


@pytest.fixture(scope="module")
def ttl_stack(
    kafka: ServerProcess, model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("ttls")
    with start_redis(password=REDIS_PASSWORD, workdir=workdir / "redis") as redis_server:
        stack = new_stack(
            kafka,
            redis_server,
            model_path,
            workdir,
            INFLIGHT_FAULT_STEP_DELAY_S=PACED_STEP_DELAY_S,
            INFLIGHT_MAX_LOG_BYTES=str(LOG_BOUND),
            INFLIGHT_ENGINE_ARGS=json.dumps({"grammar_compile_timeout_s": COMPILE_BOUND_S}),
        )
        try:
            yield stack
        finally:
            stack.close()


def job(http: httpx.Client, **body: Any) -> str:
    request = {"model": MODEL_NAME, "prompt": "Count:", "max_tokens": 4, **body}
    resp = http.post("/v1/jobs", json={"endpoint": "/v1/completions", "body": request})
    assert resp.status_code == 202, resp.text
    return str(resp.json()["id"])


def finished(http: httpx.Client, job_id: str) -> dict[str, Any]:
    def terminal() -> dict[str, Any] | None:
        view: dict[str, Any] = http.get(f"/v1/jobs/{job_id}").json()
        return view if view["status"] in ("completed", "failed", "cancelled") else None

    result: dict[str, Any] = wait_for(terminal, 120, interval_s=0.2, message=f"job {job_id} finished")
    return result


def test_a_token_log_stops_at_its_byte_bound(ttl_stack: Stack) -> None:
    redis = ttl_stack.redis_client()
    with httpx.Client(base_url=ttl_stack.url, timeout=60) as http:
        # 20 logprobs a token: hundreds of bytes each, so the 20,000-byte bound is passed within ~50 tokens,
        # far short of the 2,000 asked for.
        job_id = job(http, max_tokens=2000, ignore_eos=True, logprobs=20)
        view = finished(http, job_id)
        assert view["status"] == "failed", view
        assert view["error"]["code"] == "output_too_large", view
        assert "INFLIGHT_MAX_LOG_BYTES" in view["error"]["message"]
        logged = sum(len(raw) for raw in redis.lrange(keys.log(job_id), 0, -1))
        # Past the bound by at most the deltas in flight when it was crossed (a publish round's worth).
        assert LOG_BOUND < logged < 2 * LOG_BOUND, logged
        # A synchronous request answers the same error, as a 400 naming it.
        body = {
            "model": MODEL_NAME,
            "prompt": "Count:",
            "max_tokens": 2000,
            "ignore_eos": True,
            "logprobs": 20,
        }
        resp = http.post("/v1/completions", json=body)
        assert resp.status_code == 400, resp.text
        assert resp.json()["error"]["code"] == "output_too_large"
    metrics = httpx.get(f"{ttl_stack.workers[0].url}/metrics", timeout=30).text
    assert re.search(r"^inflight:log_bound_failures_total 2\.0$", metrics, re.MULTILINE), metrics[-2000:]


def test_every_key_written_expires_no_later_than_its_record(ttl_stack: Stack) -> None:
    client = ttl_stack.client()
    # A request of each kind, and the ways they end: completed, streamed, left by their client (a cancel
    # of a running request), cancelled as jobs, a batch with its file.
    client.completions.create(model=MODEL_NAME, prompt="one", max_tokens=3)
    assert list(client.completions.create(model=MODEL_NAME, prompt="two", max_tokens=3, stream=True))
    with httpx.Client(base_url=ttl_stack.url, timeout=60) as http:
        body = {"model": MODEL_NAME, "prompt": "left", "max_tokens": 1000, "ignore_eos": True, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as left:
            assert next(left.iter_lines()).startswith("data: ")  # running: the cancel finds it in an engine
        assert finished(http, job(http))["status"] == "completed"
        running = job(http, max_tokens=1000, ignore_eos=True)
        wait_for(lambda: http.get(f"/v1/jobs/{running}").json()["status"] == "in_progress", 60)
        assert http.delete(f"/v1/jobs/{running}").status_code == 200
        assert finished(http, running)["status"] == "cancelled"
    line = {
        "custom_id": "a",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL_NAME, "prompt": "b"},
    }
    upload = client.files.create(file=("in.jsonl", io.BytesIO(json.dumps(line).encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    wait_for(lambda: client.batches.retrieve(batch.id).status == "completed", 120, interval_s=0.5)

    redis = ttl_stack.redis_client()
    names = sorted(redis.scan_iter(count=1000))
    assert any(":cancel" in n for n in names) and any(":log" in n for n in names), names
    without_ttl = [n for n in names if redis.pttl(n) == -1]
    assert not without_ttl, without_ttl
    # Each request's keys (log, cancel, owner) go with its record, never after it: a cancel key of a
    # synchronous request lives its record's 15 minutes, not a job's day.
    for name in names:
        found = re.fullmatch(r"inflight:req:\{([^}]+)\}:\w+", name)
        record = redis.hgetall(keys.record(found.group(1))) if found else {}
        if record.get("ttl"):
            assert redis.ttl(name) <= int(record["ttl"]), (name, redis.ttl(name), record["ttl"])


def _compilers_under(pid: int) -> list[int]:
    """The grammar compiler processes among ``pid``'s descendants (the worker's engine core starts one)."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            commands[int(entry.name)] = (entry / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue  # ended meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            todo.append(child)
            if "engine.structured.compile_proc" in commands.get(child, ""):
                found.append(child)
    return found


def test_a_grammar_past_its_compile_bound_is_refused_and_stops(ttl_stack: Stack) -> None:
    worker = ttl_stack.workers[0]
    body: dict[str, Any] = {"model": MODEL_NAME, "prompt": "Code:", "max_tokens": 4}
    with httpx.Client(base_url=ttl_stack.url, timeout=120) as http:
        # The compiler (and its process) is built by the first constrained request: a quick one.
        assert http.post("/v1/completions", json={**body, "guided_regex": "[a-z]{1,5}"}).status_code == 200
        assert len(_compilers_under(worker.proc.pid)) == 1
        resp = http.post("/v1/completions", json={**body, "guided_regex": SLOW_REGEX})
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "guided_regex", error
        assert f"did not compile within {COMPILE_BOUND_S} s" in error["message"], error
        # Its process was killed: nothing compiles it any more (the next compile starts a fresh one).
        assert _compilers_under(worker.proc.pid) == []
        # The worker serves on, constrained requests included.
        assert http.post("/v1/completions", json=body).status_code == 200
        again = http.post("/v1/completions", json={**body, "guided_regex": "[0-9]{2}"})
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"].isdigit()
