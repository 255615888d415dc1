"""Tensor parallelism on a CPU: two gloo ranks compute what one rank computes.

Greedy tokens over a batch that chunks its prompts (a small token budget) and is preempted (a small KV
pool) equal the single-rank engine's, token for token, on the Llama, Mistral and Qwen2 shapes in
float32: the only arithmetic difference is the all-reduce, which adds two partial sums where one rank
adds them all in one matmul (different rounding, far below the tiny models' logit gaps). The rank's
failures end the engine: a killed rank and a hung one raise ``RankFailure`` within the collective
timeout instead of leaving rank 0 waiting.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine import SamplingParams
from engine.core.client import EngineCoreClient
from engine.distributed.parallel_state import RankFailure
from engine.distributed.sharding import ShardPlan, check_divisible
from engine.inputs import EngineRequest
from engine.llm_engine import LLMEngine
from engine.models.loader import read_safetensors
from engine.models.tiny import write_tiny_checkpoint

MAX_NEW = 10


def prompts(n: int, seed: int, lo: int = 5, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 1000) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(engine: LLMEngine, batch: list[list[int]], n: int = 1) -> dict[str, list[list[int]]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True, n=n)
    for i, prompt in enumerate(batch):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[list[int]]] = {f"r{i}": [[] for _ in range(n)] for i in range(len(batch))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            for completion in out.outputs:
                got[out.request_id][completion.index].extend(completion.token_ids)
    return got


def engine(path: Path, **kwargs: Any) -> LLMEngine:
    return LLMEngine.from_engine_args(str(path), dtype="float32", attention_backend="auto", **kwargs)


@pytest.fixture
def tp_engines() -> Iterator[list[LLMEngine]]:
    """Tensor-parallel engines made by a test, their ranks ended after it."""
    made: list[LLMEngine] = []
    yield made
    for e in made:
        e.runner.close()


# Each arch with what it brings: Qwen2 its q/k/v biases, tied embeddings and a vocabulary that does
# not split evenly (the last shard is padded); Mistral one KV head, replicated on both ranks.
CASES = {
    "llama": dict(arch="llama", seed=1),
    "mistral": dict(arch="mistral", seed=10, num_key_value_heads=1),
    "qwen2": dict(arch="qwen2", seed=2, tie_word_embeddings=True, vocab_size=1023),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_two_ranks_match_one_under_chunking_and_preemption(
    case: str, tmp_path: Path, tp_engines: list[LLMEngine]
) -> None:
    path = write_tiny_checkpoint(tmp_path, **CASES[case])  # type: ignore[arg-type]
    batch = prompts(5, seed=3)
    # A 24-token budget chunks every longer prompt; 20 blocks of 4 cannot hold all five requests.
    args = dict(max_num_batched_tokens=24, max_num_seqs=5, block_size=4, num_blocks=20)
    one = engine(path, **args)
    expected = run(one, batch)
    two = engine(path, tensor_parallel_size=2, **args)
    tp_engines.append(two)
    got = run(two, batch)
    assert two.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    differing = [r for r in expected if got[r] != expected[r]]
    assert not differing, f"{len(differing)} of {len(expected)} sequences differ: {differing}"
    two.kv.check_integrity()
    assert two.kv.num_free_blocks == two.kv.num_total_blocks


def test_async_scheduling_prefix_caching_and_n(tmp_path: Path, tp_engines: list[LLMEngine]) -> None:
    path = write_tiny_checkpoint(tmp_path, arch="llama", seed=4)
    shared = prompts(1, seed=5, lo=16, hi=16)[0]
    batch = [shared + p for p in prompts(3, seed=6, lo=3, hi=9)]
    args = dict(max_num_seqs=8, block_size=4, async_scheduling=True)
    expected = run(engine(path, **args), batch, n=2)
    two = engine(path, tensor_parallel_size=2, **args)
    tp_engines.append(two)
    assert two.config.async_scheduling
    # One at a time, so the later ones find the first one's prefix blocks cached.
    got: dict[str, list[list[int]]] = {}
    for i, prompt in enumerate(batch):
        got[f"r{i}"] = run(two, [prompt], n=2)["r0"]
    assert got == expected
    assert two.kv.pool.num_cache_hits > 0, "the shared 16-token prefix was meant to hit the cache"


def test_dummy_weights_split_as_the_checkpoint_would(tmp_path: Path, tp_engines: list[LLMEngine]) -> None:
    """load_format="dummy" (the GPU benchmarks' random weights): each rank draws the same tensors and
    keeps its slice, so two ranks still compute the one-rank model."""
    path = write_tiny_checkpoint(tmp_path, arch="qwen2", seed=3)
    batch = prompts(3, seed=8)
    expected = run(engine(path, load_format="dummy", seed=5), batch)
    two = engine(path, load_format="dummy", seed=5, tensor_parallel_size=2)
    tp_engines.append(two)
    assert run(two, batch) == expected


def test_each_rank_reads_only_its_shard(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, arch="qwen2", seed=2, vocab_size=1023)
    full = read_safetensors(path)
    config = engine(path).config.model
    check_divisible(config, 2)
    for rank in (0, 1):
        part = read_safetensors(path, ShardPlan(config, rank, 2))
        q = part["model.layers.0.self_attn.q_proj.weight"]
        assert q.shape[0] == full["model.layers.0.self_attn.q_proj.weight"].shape[0] // 2
        assert part["model.layers.0.mlp.down_proj.weight"].shape[1] == config.intermediate_size // 2
        embed = part["model.embed_tokens.weight"]
        assert embed.shape[0] == 512  # 1023 rows in two shards of 512, the last padded with a zero row
        assert part["model.norm.weight"].equal(full["model.norm.weight"])
    assert embed[-1].abs().sum() == 0


def test_a_rank_that_fails_to_start_fails_the_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_tiny_checkpoint(tmp_path, arch="llama", seed=1)
    monkeypatch.setattr(sys, "executable", "/bin/false")  # the rank's interpreter exits at once
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 .* exited with code 1"):
        engine(path, tensor_parallel_size=2)
    assert time.monotonic() - start < 60  # seen as it exits, not after the start-up bound (300 s)


def test_shapes_that_do_not_split_are_refused(tmp_path: Path) -> None:
    path = write_tiny_checkpoint(tmp_path, arch="llama", seed=1)
    with pytest.raises(ValueError, match="num_attention_heads"):
        engine(path, tensor_parallel_size=3)


@pytest.mark.parametrize("fault", ["kill", "hang"])
def test_a_dead_or_hung_rank_fails_the_engine(
    fault: str, tmp_path: Path, tp_engines: list[LLMEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("INFLIGHT_TP_TIMEOUT_S", "3")
    path = write_tiny_checkpoint(tmp_path, arch="llama", seed=1)
    two = engine(path, tensor_parallel_size=2, async_scheduling=False)
    tp_engines.append(two)
    two.add_request(
        "r", prompts(1, seed=7)[0], SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    )
    two.step()
    ranks = two.runner.ranks
    assert ranks is not None
    (pid,) = ranks.pids
    os.kill(pid, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
    start = time.monotonic()
    try:
        with pytest.raises(RankFailure):
            for _ in range(100):
                two.step()
        # Killed: seen at once (the pipe or the collective's peer is gone); hung: the timeout.
        assert time.monotonic() - start < 15
    finally:
        if fault == "hang":
            os.kill(pid, signal.SIGKILL)


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


async def test_the_engine_core_serves_with_two_ranks_and_dies_with_one(tiny_llama_path: Path) -> None:
    """Through the engine core process, as the worker runs it: a killed rank fails the core (its
    streams end with the error, as for a dead core) and leaves no rank process behind."""
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = run(engine(tiny_llama_path), [[1, 2, 3]])["r0"][0][:8]
    args = {"block_size": 8, "max_model_len": 256, "dtype": "float32", "tensor_parallel_size": 2}
    client = EngineCoreClient(str(tiny_llama_path), args, torch_threads=2)
    await client.start()
    try:
        assert client.pid is not None
        (rank_pid,) = children_of(client.pid)
        tokens: list[int] = []
        async for out in client.generate(EngineRequest("a", [1, 2, 3], greedy)):
            tokens += out.outputs[0].token_ids
        assert tokens == expected
        long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        with pytest.raises(RuntimeError, match="engine loop has died"):
            async for out in client.generate(EngineRequest("b", [1, 2, 3], long)):
                if out.outputs[0].token_ids:
                    os.kill(rank_pid, signal.SIGKILL)
        assert "RankFailure" in str(client.dead_error) or "exited" in str(client.dead_error)
    finally:
        await client.shutdown()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank_pid}").exists() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # a killed child stays a zombie until the core reaps or exits
    assert (
        not Path(f"/proc/{rank_pid}").exists() or "Z" in Path(f"/proc/{rank_pid}/stat").read_text().split()[2]
    )


def test_a_second_engine_starts_after_the_first_is_deleted(tmp_path: Path) -> None:
    """Deleting a tensor-parallel engine without close() ends its ranks and leaves the process group,
    so a second one starts in the same process (not "initialize the default process group twice")."""
    path = write_tiny_checkpoint(tmp_path, arch="llama", seed=3)
    batch = prompts(3, seed=4)
    first = engine(path, tensor_parallel_size=2)
    pids = first.runner.ranks.pids if first.runner.ranks is not None else []
    expected = run(first, batch)
    del first
    second = engine(path, tensor_parallel_size=2)
    try:
        assert run(second, batch) == expected
        assert second.runner.ranks is not None and set(second.runner.ranks.pids).isdisjoint(pids)
    finally:
        second.runner.close()
