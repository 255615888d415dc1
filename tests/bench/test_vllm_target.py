"""The vllm benchmark target: its pure parts always, vLLM itself only where ``make bench-peers`` ran.

The end-to-end test starts vLLM's CPU backend from ``.venv-peers`` (about a minute on a 2-core host)
and checks that its greedy tokens equal this engine's on the tiny checkpoint in float32.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from bench.cli import main
from bench.compare import describe_identical, identical_outputs, peer_comparisons
from bench.experiment import _saturation_targets
from bench.results import RequestResult, RunResult
from bench.targets import TargetConfig
from bench.targets.vllm_cpu import (
    driver_config,
    format_cpu_list,
    kv_cache_gib,
    peers_python,
    resolve_dtype,
    run_result,
    thread_binding,
)
from engine.platform.threads import allowed_cpus
from inflight.plan.workload import RequestSpec

SPECS = [
    RequestSpec("a", 0.0, (5, 6, 7, 8), 3),
    RequestSpec("b", 0.5, (9, 10), 2),
    RequestSpec("c", 0.5, (11,), 2),
]
# What the driver wrote for SPECS: "c" is missing, as if vLLM had dropped it.
REPLY = {
    "requests": [
        {
            "request_id": "a",
            "token_times": [0.25, 0.5, 0.5],
            "output_token_ids": [90, 657, 249],
            "finished": 0.5,
            "error": None,
        },
        {
            "request_id": "b",
            "token_times": [0.75, 1.25],
            "output_token_ids": [7, 8],
            "finished": 1.25,
            "error": None,
        },
    ],
    "wall_s": 1.3,
    "cpu_s": 2.5,
}


def test_driver_reply_becomes_a_run_result() -> None:
    run = run_result(REPLY, SPECS, "saturation", float("inf"), {"block_size": 32})
    a, b, c = run.requests
    assert (run.target, run.label, run.config) == ("vllm", "saturation", {"block_size": 32})
    assert a.ttft == 0.25 and a.tpot == 0.125 and a.itls() == [0.25, 0.0] and a.completed
    assert b.arrival == 0.5 and b.ttft == 0.25 and b.e2e == 0.75 and b.num_prompt_tokens == 2
    assert a.output_token_ids == [90, 657, 249] and b.finished == 1.25
    assert not c.completed and c.error is not None and c.token_times == []
    assert run.extra == {"child_cpu_s": 2.5}  # Session adds it to the run's CPU seconds
    assert run.steps == []  # vLLM's engine core does not expose its steps
    again = RunResult.from_json(json.loads(json.dumps(run.to_json())))
    assert again.requests[0].output_token_ids == [90, 657, 249]


def _run(target: str, outputs: dict[str, list[int]]) -> RunResult:
    reqs = [RequestResult(rid, 0.0, 4, len(ids), output_token_ids=ids) for rid, ids in outputs.items()]
    return RunResult(target, "x", 1.0, reqs)


def test_identical_outputs_counts_and_first_difference() -> None:
    ours = _run("continuous", {"a": [1, 2, 3], "b": [4, 5, 6], "c": [7, 8], "d": [], "e": [1, 2]})
    theirs = _run("vllm", {"a": [1, 2, 3], "b": [4, 9, 6], "c": [7, 8, 9], "d": []})
    result = identical_outputs(ours, theirs)
    # b differs at token 1; c is a prefix of theirs (differs at 2); d has no tokens; e is missing.
    assert result == {"identical": 1, "compared": 5, "differing": {"b": 1, "c": 2, "d": 0, "e": 0}}
    line = describe_identical(result, "continuous", "vllm")
    assert line.startswith("greedy outputs continuous vs vllm: identical 1/5 (first differing token: b @1")
    # Only peers that record tokens are compared, and only against a continuous run.
    runs = {"continuous": ours, "static": _run("static", {"a": [1]}), "vllm": theirs}
    assert list(peer_comparisons(runs)) == ["vllm"]
    assert peer_comparisons({"vllm": theirs}) == {}


def test_driver_config_matches_kv_tokens_threads_and_dtype() -> None:
    config = TargetConfig(model="m", max_num_seqs=16, block_size=16, max_model_len=200)
    cfg = driver_config(config, "/ckpt", "float32")
    # vLLM's CPU attention wants blocks of a multiple of 32: same 3,200 tokens in 100 blocks of 32.
    assert (cfg["block_size"], cfg["num_blocks"]) == (32, 100)
    assert cfg["eager"] and cfg["model"] == "/ckpt" and cfg["max_model_len"] == 200
    assert (
        driver_config(TargetConfig(model="m", block_size=48, num_blocks=10), "/c", "bfloat16")["num_blocks"]
        == 8
    )
    # 101 blocks * 32 tokens * K and V * 14 layers * 2 heads * 64 dims * 4 bytes = 23 MiB -> 1 GiB floor;
    # a cache of 40 GiB asks for 40.
    assert kv_cache_gib(cfg, 14, 2, 64) == 1
    big = dict(cfg, num_blocks=(40 * 2**30) // (32 * 2 * 32 * 8 * 128 * 4) - 1)
    assert kv_cache_gib(big, 32, 8, 128) == 40
    assert kv_cache_gib(dict(big, dtype="bfloat16"), 32, 8, 128) == 20
    plain = [frozenset({cpu}) for cpu in range(8)]
    assert [thread_binding(n, plain) for n in (1, 2, 4)] == ["0", "0-1", "0-3"]
    assert resolve_dtype(config) == "float32"  # the engine target's default
    assert resolve_dtype(TargetConfig(model="m", engine_args={"dtype": "bfloat16"})) == "bfloat16"


def test_vllm_threads_bind_to_allowed_physical_cores_first() -> None:
    # 4 cores with siblings n and n + 4, as Linux numbers them: one CPU per core, then the siblings.
    ht = [frozenset({c, c + 4}) for c in range(4)]
    assert [thread_binding(n, ht) for n in (1, 2, 4, 5, 8)] == ["0", "0-1", "0-3", "0-4", "0-7"]
    # Siblings numbered side by side (0 and 1 share a core): two threads take two cores.
    assert thread_binding(2, [frozenset({0, 1}), frozenset({2, 3})]) == "0,2"
    # A process allowed CPUs 4-5 (taskset, a container's cpuset) binds there, not to CPU 0.
    assert thread_binding(2, [frozenset({4}), frozenset({5})]) == "4-5"
    assert thread_binding(3, [frozenset({1}), frozenset({3}), frozenset({4})]) == "1,3-4"
    with pytest.raises(ValueError, match="cannot bind 3 threads"):
        thread_binding(3, [frozenset({0}), frozenset({1})])
    assert thread_binding(1) in {str(cpu) for cpu in allowed_cpus()}  # this host's own mask
    assert format_cpu_list([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"


def test_engine_experiment_targets() -> None:
    def targets(text: str, skip_hf: bool = False) -> list[str]:
        return _saturation_targets(argparse.Namespace(targets=text, skip_hf=skip_hf))

    assert targets("continuous,static,hf-batch,hf-generate") == [
        "continuous",
        "static",
        "hf-batch",
        "hf-generate",
    ]
    # continuous and static always run first: the rate search needs both.
    assert targets("vllm,hf-batch,vllm") == ["continuous", "static", "vllm", "hf-batch"]
    assert targets("hf-batch,vllm", skip_hf=True) == ["continuous", "static", "vllm"]
    with pytest.raises(SystemExit, match="unknown target"):
        targets("continuous,sglang")


@pytest.mark.skipif(not peers_python().is_file(), reason="vLLM's virtualenv is missing: make bench-peers")
@pytest.mark.timeout(900)
def test_vllm_greedy_tokens_equal_the_engine(tiny_model: Path, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    argv = ["sweep", "--model", str(tiny_model), "--out", str(out), "--targets", "continuous,vllm"]
    argv += ["--rates", "50", "--num-requests", "4", "--max-num-seqs", "4", "--threads", "1"]
    argv += ["--prompt-short", "4,12", "--prompt-long", "20,40", "--output-len", "4,12"]
    argv += ["--engine-arg", "dtype=float32", "--engine-arg", "max_num_batched_tokens=64"]
    assert main(argv) == 0
    result = json.loads((out / "sweep.json").read_text())
    assert result["greedy_outputs_identical"] == {
        "poisson-50": {"vllm": {"identical": 4, "compared": 4, "differing": {}}}
    }
    (vllm_row,) = result["sweep"]["vllm"]
    assert vllm_row["num_completed"] == 4 and vllm_row["cpu_s"] > 0
    run = json.loads((out / "runs" / "vllm_poisson-50.json").read_text())
    assert run["config"]["dtype"] == "float32" and run["config"]["block_size"] == 32
    assert run["config"]["threads"] == 1 and run["config"]["eager"]
    assert all(
        len(r["output_token_ids"]) == r["max_tokens"] == len(r["token_times"]) for r in run["requests"]
    )
