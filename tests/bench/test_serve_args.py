"""``bench serve``'s plain parts, without vLLM: the phases, the command lines both servers and vLLM's
client get, the ShareGPT-shaped dataset, and the client's result files read into rows and a table."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench import serve_args as sa
from bench.serve_bench import parse_args

SETUP = sa.ClientSetup("http://127.0.0.1:8000", "smollm2", "/models/smol", "/out/sharegpt.json", 128, 64, 7)


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_the_phases_follow_the_burst_rate() -> None:
    burst = sa.burst_phase("random", 48)
    assert (burst.name, burst.rate, burst.concurrency) == ("random burst", math.inf, None)
    phases = sa.load_phases("random", 48, 1.84, [0.5, 0.7, 0.9])
    assert [p.name for p in phases] == ["random poisson 50%", "random poisson 70%", "random poisson 90%"]
    assert [p.rate for p in phases] == pytest.approx([0.92, 1.288, 1.656])
    assert [p.load for p in phases] == [0.5, 0.7, 0.9]
    sweep = sa.concurrency_phases("sharegpt", 48, [1, 4, 16])
    assert [(p.name, p.concurrency, p.rate) for p in sweep] == [
        ("sharegpt c=1", 1, math.inf),
        ("sharegpt c=4", 4, math.inf),
        ("sharegpt c=16", 16, math.inf),
    ]
    with pytest.raises(ValueError, match="burst's request rate"):
        sa.load_phases("random", 48, 0.0, [0.5])  # a burst where nothing completed
    with pytest.raises(ValueError, match="dataset"):
        sa.Phase("x", "sonnet", 4)


def test_vllm_is_the_reference_and_repeats_alternate() -> None:
    assert sa.reference_rate({"inflight": 2.0, "vllm": 1.5}) == 1.5
    assert sa.reference_rate({"inflight": 2.0}) == 2.0
    assert sa.target_order(["inflight", "vllm"], 0) == ["inflight", "vllm"]
    assert sa.target_order(["inflight", "vllm"], 1) == ["vllm", "inflight"]
    assert sa.target_order(["inflight", "vllm"], 2) == ["inflight", "vllm"]


def test_client_argv_for_a_random_burst() -> None:
    argv = sa.bench_serve_argv(sa.burst_phase("random", 48), SETUP, Path("/out/client"), "b.json")
    assert argv[:2] == ["bench", "serve"]
    assert _flag(argv, "--backend") == "openai" and _flag(argv, "--endpoint") == "/v1/completions"
    assert _flag(argv, "--base-url") == SETUP.base_url
    assert (_flag(argv, "--model"), _flag(argv, "--tokenizer")) == ("smollm2", "/models/smol")
    assert _flag(argv, "--request-rate") == "inf" and _flag(argv, "--num-prompts") == "48"
    assert (_flag(argv, "--random-input-len"), _flag(argv, "--random-output-len")) == ("128", "64")
    assert "--ignore-eos" in argv and "--save-result" in argv and "--save-detailed" in argv
    assert (_flag(argv, "--result-dir"), _flag(argv, "--result-filename")) == ("/out/client", "b.json")
    assert _flag(argv, "--seed") == "7"
    assert "--max-concurrency" not in argv and "--dataset-path" not in argv


def test_client_argv_for_poisson_and_concurrency_on_sharegpt() -> None:
    (poisson,) = sa.load_phases("sharegpt", 10, 2.0, [0.7])
    argv = sa.bench_serve_argv(poisson, SETUP, Path("/o"), "p.json")
    assert _flag(argv, "--request-rate") == "1.4000"
    assert (_flag(argv, "--dataset-name"), _flag(argv, "--dataset-path")) == (
        "sharegpt",
        "/out/sharegpt.json",
    )
    assert "--random-input-len" not in argv
    (closed,) = sa.concurrency_phases("sharegpt", 10, [4])
    argv = sa.bench_serve_argv(closed, SETUP, Path("/o"), "c.json")
    assert (_flag(argv, "--max-concurrency"), _flag(argv, "--request-rate")) == ("4", "inf")
    no_data = sa.ClientSetup("http://x", "m", "/t")
    with pytest.raises(ValueError, match="sharegpt_path"):
        sa.bench_serve_argv(closed, no_data, Path("/o"), "c.json")


def test_both_servers_get_the_same_engine_settings() -> None:
    server = sa.ServerSetup("/models/smol", "smollm2", threads=2, max_num_seqs=64, kv_tokens=16_384)
    env = sa.inflight_env(server)
    args = json.loads(env["INFLIGHT_ENGINE_ARGS"])
    assert env["INFLIGHT_TORCH_THREADS"] == "2" and env["INFLIGHT_SERVED_MODEL_NAME"] == "smollm2"
    assert env["INFLIGHT_MAX_MODEL_LEN"] == "1024"
    assert (
        args["dtype"] == "float32" and args["max_num_seqs"] == 64 and args["max_num_batched_tokens"] == 2048
    )
    assert args["num_blocks"] * args["block_size"] == 16_384 and args["enable_prefix_caching"] is False
    argv = sa.vllm_serve_argv(server, 9001)
    assert argv[:2] == ["serve", "/models/smol"]
    assert _flag(argv, "--served-model-name") == "smollm2" and _flag(argv, "--port") == "9001"
    assert (_flag(argv, "--max-num-seqs"), _flag(argv, "--max-num-batched-tokens")) == ("64", "2048")
    assert _flag(argv, "--dtype") == "float32" and _flag(argv, "--max-model-len") == "1024"
    # The same KV tokens in vLLM's 32-token blocks, plus its null block.
    assert int(_flag(argv, "--num-gpu-blocks-override")) == 16_384 // 32 + 1
    assert "--no-enable-prefix-caching" in argv and "--enforce-eager" in argv
    venv = sa.vllm_serve_env(server, "0-1", 3)
    assert venv == {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "OMP_NUM_THREADS": "2", "VLLM_CPU_KVCACHE_SPACE": "3"}


def test_the_sharegpt_set_has_sharegpts_shape() -> None:
    data = sa.sharegpt_dataset(200, seed=3)
    assert data == sa.sharegpt_dataset(200, seed=3)  # the same set for every target and repeat
    assert data != sa.sharegpt_dataset(200, seed=4)
    words = [
        (len(d["conversations"][0]["value"].split()), len(d["conversations"][1]["value"].split()))
        for d in data
    ]
    for entry in data:
        assert [t["from"] for t in entry["conversations"]] == ["human", "gpt"]
    prompts, answers = sorted(p for p, _ in words), sorted(a for _, a in words)
    assert prompts[0] >= 8 and prompts[-1] <= 400 and answers[0] >= 8 and answers[-1] <= 200
    assert prompts[-1] > 3 * prompts[100]  # a long tail, as ShareGPT's prompts have
    assert 40 <= prompts[100] <= 90 and 55 <= answers[100] <= 110  # medians near 60 and 80 words


def _result(completed: int, failed: int, tok_s: float, p99_ttft: float) -> dict[str, object]:
    return {
        "completed": completed,
        "failed": failed,
        "request_throughput": tok_s / 64,
        "output_throughput": tok_s,
        "median_ttft_ms": p99_ttft / 2,
        "p99_ttft_ms": p99_ttft,
        "median_tpot_ms": 30.0,
        "errors": ["", "", "Bad Request"][: completed + failed],
    }


def test_rows_summaries_and_table() -> None:
    burst = sa.burst_phase("random", 3)
    rows = [
        sa.result_row(_result(3, 0, 120.0, 900.0), target="inflight", phase=burst, repeat=0),
        sa.result_row(_result(3, 0, 100.0, 1000.0), target="vllm", phase=burst, repeat=0),
        sa.result_row(_result(2, 1, 110.0, 800.0), target="vllm", phase=burst, repeat=1),
        sa.result_row(_result(3, 0, 140.0, 700.0), target="inflight", phase=burst, repeat=1),
    ]
    assert rows[2]["failed"] == 1 and rows[2]["errors"] == ["Bad Request"]
    assert rows[0]["rate"] is None and rows[0]["duration"] is None  # absent from the file: None
    inflight, vllm = sa.summarize(rows)
    assert (inflight["target"], inflight["repeats"], inflight["failed"], inflight["requests"]) == (
        "inflight",
        2,
        0,
        6,
    )
    assert inflight["output_throughput"] == 130.0 and vllm["output_throughput"] == 105.0
    assert vllm["failed"] == 1 and "vs_vllm" not in vllm
    assert inflight["vs_vllm"]["output_throughput"] == pytest.approx(130 / 105)
    text = sa.table([inflight, vllm])
    lines = text.splitlines()
    assert lines[0].startswith("| phase | target | failed |") and len(lines) == 4
    assert lines[2].startswith("| random burst | inflight | 0/6 | 130.0 |") and lines[2].endswith("| 1.24x |")
    assert lines[3].startswith("| random burst | vllm | 1/6 | 105.0 |") and lines[3].endswith("| - |")
    # A client that failed outright: every request counts as failed.
    dead = sa.result_row(
        {"completed": 0, "failed": 3, "errors": ["client exit 1"]}, target="vllm", phase=burst, repeat=0
    )
    assert (dead["failed"], dead["output_throughput"], dead["errors"]) == (3, None, ["client exit 1"])


def test_quick_and_full_arguments() -> None:
    quick = parse_args(["--quick"])
    assert (quick.num_prompts, quick.repeats, quick.load_list, quick.concurrency_list) == (6, 1, [0.7], [4])
    assert quick.dataset_list == ["random", "sharegpt"]
    full = parse_args([])
    assert (full.num_prompts, full.repeats, full.load_list, full.concurrency_list) == (
        48,
        3,
        [0.5, 0.7, 0.9],
        [1, 4, 16],
    )
    assert parse_args(["--concurrency", ""]).concurrency_list == []
    mine = parse_args(["--quick", "--num-prompts", "3", "--concurrency", ""])  # given flags win
    assert (mine.num_prompts, mine.concurrency_list, mine.repeats) == (3, [], 1)
    with pytest.raises(SystemExit):
        parse_args(["--datasets", "sonnet"])
