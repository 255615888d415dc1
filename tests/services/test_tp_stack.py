"""The local stack with a tensor-parallel worker: two gloo ranks serve what one rank serves, and a rank
that dies takes the worker's engine down as a dead engine core does (readyz 503)."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest

from engine import SamplingParams
from engine.llm_engine import LLMEngine
from harness.servers import ServerProcess
from services.common.settings import Settings, SettingsError
from tests.engine.test_tensor_parallel import children_of
from tests.services.stack import MODEL_NAME, new_stack, wait_for, worker_stats

PROMPT = "The quick brown fox"


def reference(model: Path, max_tokens: int) -> str:
    engine = LLMEngine.from_engine_args(str(model), dtype="float32")
    engine.add_request("ref", PROMPT, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            text += out.outputs[0].text if out.outputs else ""
    return text


def test_the_setting_becomes_the_engine_argument() -> None:
    env = {"INFLIGHT_TENSOR_PARALLEL_SIZE": "2", "INFLIGHT_ENGINE_ARGS": '{"max_num_seqs": 8}'}
    assert Settings.from_env(env).engine_args == {"max_num_seqs": 8, "tensor_parallel_size": 2}
    with pytest.raises(SettingsError, match="disagrees"):
        Settings.from_env({**env, "INFLIGHT_ENGINE_ARGS": '{"tensor_parallel_size": 4}'})


def test_a_two_rank_worker_serves_and_a_dead_rank_fails_it(
    kafka: ServerProcess, redis_server: ServerProcess, model_path: Path, tmp_path: Path
) -> None:
    stack = new_stack(
        kafka,
        redis_server,
        model_path,
        tmp_path,
        INFLIGHT_TENSOR_PARALLEL_SIZE="2",
        INFLIGHT_TORCH_THREADS="2",  # one each
        INFLIGHT_ENGINE_ARGS='{"dtype": "float32"}',
    )
    try:
        (worker,) = stack.workers
        params = dict(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        text = stack.client(timeout=120).completions.create(**params).choices[0].text  # type: ignore[call-overload]
        assert text == reference(model_path, 12)
        core_pid = worker_stats(worker)["engine_pid"]
        (rank_pid,) = children_of(core_pid)
        os.kill(rank_pid, signal.SIGKILL)  # while the engine idles: the core notices without a step
        wait_for(
            lambda: httpx.get(f"{worker.url}/readyz", timeout=5).status_code == 503,
            30,
            message="readyz 503 after the rank died",
        )
        assert worker.proc.poll() is None  # the worker stays up to say so, as for a dead core
        assert "tensor-parallel rank 1" in worker.tail_log(50_000)
    finally:
        stack.close()
