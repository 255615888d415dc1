"""What the engine core's faults do to a worker, through real services: a refusal reaches its one request
as OpenAI's error, and a stalled core is killed and its request resumes on another worker.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness.servers import ServerProcess
from harness.stack import ServiceProcess
from services.common import keys
from services.common.wire import DeltaEvent, DoneEvent, decode_event
from services.worker.main import EXIT_ENGINE_STALLED, EXIT_HAND_OVER
from tests.services.conftest import ExtraGateway
from tests.services.stack import MODEL_NAME, Stack, new_stack, wait_for, worker_stats

pytestmark = pytest.mark.timeout(180)


def test_an_over_long_token_prompt_gets_a_400_with_its_param_and_the_worker_serves_on(
    extra_gateway: ExtraGateway, model_path: Path
) -> None:
    """A gateway without the checkpoint cannot count a token-id prompt against the context: the engine
    core refuses it, and the refusal must come back as the gateway's own 400 would, and harm nothing."""
    gateway = extra_gateway(INFLIGHT_MODEL="")
    max_model_len = json.loads((model_path / "config.json").read_text())["max_position_embeddings"]
    body = {"model": MODEL_NAME, "prompt": [1 + i % 900 for i in range(max_model_len + 10)], "max_tokens": 4}
    resp = httpx.post(f"{gateway.url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "prompt"
    assert "maximum context length" in error["message"]
    ok = {"model": MODEL_NAME, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
    after = httpx.post(f"{gateway.url}/v1/completions", json=ok, timeout=60)
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 4


PARAMS: dict[str, Any] = {
    "model": MODEL_NAME,
    "prompt": "Once upon a time, in a small village near the sea, there lived",
    "max_tokens": 60,
    "temperature": 0.9,
    "seed": 4321,
    "extra_body": {"ignore_eos": True},
}
STALL_S = 3.0  # the stall bound under test: steps are paced at 0.05 s, so a healthy core is far below it


@pytest.fixture
def paced_pair(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> Iterator[Stack]:
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        workers=2,
        INFLIGHT_FAULT_STEP_DELAY_S="0.05",
        INFLIGHT_ENGINE_STALL_TIMEOUT_S=str(STALL_S),
        INFLIGHT_ENGINE_STALL_WARMUP_S=str(STALL_S),
    )
    yield stack
    stack.close()


def _owner(stack: Stack, request_id: str) -> ServiceProcess:
    owner = stack.redis_client().get(keys.owner(request_id))
    (worker,) = [w for w in stack.workers if w.proc.poll() is None and worker_stats(w)["worker"] == owner]
    return worker


def _watch_readyz(worker: ServiceProcess, seen: list[int], stop: threading.Event) -> None:
    """Every status /readyz answers until the worker is gone."""
    while not stop.is_set():
        try:
            seen.append(httpx.get(f"{worker.url}/readyz", timeout=5).status_code)
        except httpx.HTTPError:
            if worker.proc.poll() is not None:
                return
        stop.wait(0.05)


def test_a_stalled_core_is_killed_and_its_request_resumes_on_another_worker(paced_pair: Stack) -> None:
    stack = paced_pair
    reference = stack.client(timeout=120).completions.create(**PARAMS).choices[0].text
    stalled: list[tuple[ServiceProcess, int]] = []
    statuses: list[int] = []
    stop = threading.Event()

    def stop_the_core(request_id: str) -> None:
        owner = _owner(stack, request_id)
        core_pid = worker_stats(owner)["engine_pid"]
        os.kill(core_pid, signal.SIGSTOP)  # alive, holding its requests, stepping no more
        stalled.append((owner, core_pid))
        threading.Thread(target=_watch_readyz, args=(owner, statuses, stop), daemon=True).start()

    chunks, request_id = [], ""
    try:
        for i, chunk in enumerate(stack.client(timeout=120).completions.create(**PARAMS, stream=True)):
            request_id = chunk.id
            chunks.append(chunk.choices[0].text)
            if i == 10:
                stop_the_core(request_id)
        ((owner, core_pid),) = stalled
        # The worker said it is not ready, then exited for a restart with the stall's exit code (or, where
        # leaving the group hung in a rebalance the broker did not finish, a loaded host, with the
        # hand-over's: its partitions are freed by its exit just the same).
        code = owner.proc.wait(timeout=60)
        assert code == EXIT_ENGINE_STALLED or (
            code == EXIT_HAND_OVER and "the group could not be left" in owner.tail_log(20_000)
        )
        stop.set()
        assert 503 in statuses and 200 not in statuses[statuses.index(503) :]
        assert "the engine core stalled" in owner.tail_log(20_000)
        wait_for(lambda: not _alive(core_pid), 10, message="the stalled core to be gone")
    finally:
        stop.set()
        for _, pid in stalled:
            _kill(pid)
    assert "".join(chunks) == reference  # resumed elsewhere, token for token
    log = [decode_event(raw) for raw in stack.redis_client().lrange(keys.log(request_id), 0, -1)]
    assert [e.seq for e in log] == list(range(1, len(log) + 1)), "gap or duplicate in the sequence"
    assert isinstance(log[-1], DoneEvent) and log[-1].status == "completed"
    assert len({e.worker for e in log if isinstance(e, DeltaEvent)}) == 2


def _alive(pid: int) -> bool:
    """Running or stopped; a zombie (killed, not yet reaped by a parent that has exited) is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
