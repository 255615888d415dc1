"""The GPU check's stage runner (caps, budget, results written as each stage ends) with stub stages,
and its summary's arithmetic from fixed stage outputs: what can be checked before a GPU is lent."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from bench import gpu_check
from bench.gpu_check import Stage, run_stages
from bench.gpu_check_summary import figures, kernel_tests_line, render_summary

PY = sys.executable


def _stub(name: str, code: str, cap_s: float, required: bool = False) -> Stage:
    return Stage(name, [PY, "-c", code], cap_s, required)


def _env() -> dict[str, str]:
    return {"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": "1"}


def test_a_hanging_stage_is_cut_at_its_cap_and_the_next_still_runs(tmp_path: Path) -> None:
    stages = [
        _stub("hangs", "import time; print('started', flush=True); time.sleep(600)", cap_s=2),
        # Ignores SIGINT: only the SIGKILL after the grace period ends it.
        _stub(
            "stubborn",
            "import signal, time; signal.signal(signal.SIGINT, signal.SIG_IGN); time.sleep(600)",
            2,
        ),
        _stub("fails", "raise SystemExit(3)", cap_s=30),
        _stub("passes", "print('fine')", cap_s=30),
    ]
    t0 = time.monotonic()
    results = run_stages(stages, tmp_path, budget_s=300, env=_env(), grace_s=1)
    elapsed = time.monotonic() - t0
    assert [r.status for r in results] == ["timeout", "timeout", "failed(rc=3)", "ok"]
    assert elapsed < 120  # the stubs would sleep 1200 s between them: the caps ended them
    assert (tmp_path / "hangs.log").read_text().startswith("started")
    assert (tmp_path / "passes.log").read_text() == "fine\n"
    rows = [line.split("\t") for line in (tmp_path / "stages.tsv").read_text().splitlines()]
    assert rows[0] == ["stage", "status", "seconds", "cap_s"]
    assert [r[:2] for r in rows[1:]] == [
        ["hangs", "timeout"],
        ["stubborn", "timeout"],
        ["fails", "failed(rc=3)"],
        ["passes", "ok"],
    ]
    assert json.loads((tmp_path / "stages.json").read_text())[0]["cap_s"] == 2


def test_results_are_written_as_each_stage_ends(tmp_path: Path) -> None:
    # The second stage reads stages.tsv while it runs: the first stage's row is already there.
    code = f"print(open({str(tmp_path / 'stages.tsv')!r}).read(), end='')"
    results = run_stages([_stub("first", "pass", 30), _stub("second", code, 30)], tmp_path, 300, _env(), 1)
    assert [r.status for r in results] == ["ok", "ok"]
    assert "first\tok" in (tmp_path / "second.log").read_text()


def test_the_budget_cuts_caps_and_skips_what_cannot_fit(tmp_path: Path) -> None:
    stages = [
        _stub("long", "import time; time.sleep(600)", cap_s=100),
        _stub("never", "print('ran')", cap_s=30),
    ]
    # Budget 4 s with a 0.5 s grace: the first stage's cap is cut to 3.5 s; nothing is left for the next.
    results = run_stages(stages, tmp_path, budget_s=4, env=_env(), grace_s=0.5, min_stage_s=1)
    assert results[0].status == "timeout" and results[0].cap_s <= 3.5
    assert results[1].status == "skipped" and not (tmp_path / "never.log").exists()


def test_a_failed_required_stage_skips_the_rest(tmp_path: Path) -> None:
    stages = [
        _stub("preflight", "raise SystemExit('no CUDA')", 30, required=True),
        _stub("bench", "pass", 30),
    ]
    results = run_stages(stages, tmp_path, 300, _env(), 1)
    assert [r.status for r in results] == ["failed(rc=1)", "skipped"]


def test_gpu_stages_order_caps_and_pytest_options(tmp_path: Path) -> None:
    stages = gpu_check.gpu_stages("python3", tmp_path)
    assert [s.name for s in stages] == [
        "preflight",
        "kernel_bench",
        "engine_bench",
        "graph_check",
        "tp_check",
        "kernels",
    ]
    caps = {s.name: s.cap_s for s in stages}
    assert caps == {
        "preflight": 60,
        "kernel_bench": 110,
        "engine_bench": 180,
        "graph_check": 90,
        "tp_check": 90,
        "kernels": 120,
    }
    pytest_argv = stages[-1].argv
    assert "-rfE" in pytest_argv and any(a.startswith("faulthandler_timeout=") for a in pytest_argv)
    env = gpu_check.stage_env(tmp_path)
    assert env["TRITON_CACHE_DIR"].endswith(".triton-cache") or "TRITON_CACHE_DIR" in env
    assert "TRITON_INTERPRET" not in env


# -- the summary's arithmetic, from fixed stage outputs -------------------------------------------

KERNEL_BENCH = {
    "device": "test",
    "copy_bandwidth_gbps": 4000.0,
    "results": [
        # 8B heads, batch 64, context 1024: K/V 2*64*1024*8*128*2 bytes + q and out 2*64*32*128*2 =
        # 269,484,032 bytes in 80 us = 3369 GB/s = 84% of 4000.
        {
            "case": {"batch": 64, "context": 1024, "num_heads": 32, "num_kv_heads": 8},
            "num_splits": None,
            "time_us": 80.0,
            "bytes_moved": 269_484_032,
            "gbps": 1.0,  # deliberately wrong: the summary recomputes from bytes and time
            "fraction_of_copy": 0.01,
        },
        {
            "case": {"batch": 64, "context": 1024, "num_heads": 32, "num_kv_heads": 8},
            "num_splits": 1,
            "time_us": 1.0,
            "bytes_moved": 1,
            "gbps": 1.0,
            "fraction_of_copy": 1.0,
        },
    ],
    "sweep_complete": False,
    "sweep_best": {
        "batch 64 context 1024 heads 32/8": {
            "config": {"block_n": 128, "num_warps": 8, "num_stages": 3},
            "num_splits": None,
            "fraction_of_copy": 0.87,
        }
    },
}
ENGINE_BENCH = {
    "decode_step": {"step_ms": 6.6, "bound_ms": 4.4},  # 1.50x: exactly at the target
    "decode_profile": {
        "kernel_us_per_step": 6000.0,
        "share": {"attention": 0.25, "gemm": 0.65, "pointwise": 0.08, "copy": 0.02},
    },
    "batch1_decode": {"graph_ms": 7.0, "piecewise_ms": 8.0, "eager_ms": 10.0},  # 1.43x: a miss
    "workload": {"output_tokens": 90_000, "seconds": 10.0, "tpot_p50_ms": 20.0},  # 9000 tok/s
    "workload_sampled": {"output_tokens": 35_000, "seconds": 5.0, "tpot_p50_ms": 22.0},  # 7000
}
GRAPH_CHECK = {
    "max_abs_diff_replay_vs_eager_padded": 0.0,
    "max_abs_diff_piecewise_vs_eager_padded": 0.0,
    "greedy_identical": "24/24",
    "passed": True,
}


def _write(out: Path) -> None:
    (out / "kernel_bench.json").write_text(json.dumps(KERNEL_BENCH))
    (out / "gpu_engine_bench.json").write_text(json.dumps(ENGINE_BENCH))
    (out / "graph_check.json").write_text(json.dumps(GRAPH_CHECK))


def test_summary_figures_against_their_targets(tmp_path: Path) -> None:
    _write(tmp_path)
    got = {f.name: f for f in figures(tmp_path)}
    attention = got["decode attention, 8B heads, b64 ctx1k"]
    assert attention.measured.startswith("84% of copy (3369 of 4000 GB/s)") and attention.verdict == "ok"
    roofline = got["decode step, 8B bf16, b64 ctx1k"]
    assert roofline.measured.startswith("1.50x") and roofline.verdict == "ok"
    assert (
        got["output tok/s, greedy"].measured.startswith("9000")
        and got["output tok/s, greedy"].verdict == "ok"
    )
    sampled = got["output tok/s, T0.8 top-p 0.95"]
    assert sampled.measured.startswith("7000") and sampled.verdict == "MISS"
    assert got["batch-1 decode, graphs vs eager"].measured.startswith("1.43x")
    assert got["batch-1 decode, graphs vs eager"].verdict == "MISS"
    assert got["graph replay vs eager (decode, mixed)"].verdict == "ok"


def test_summary_renders_on_one_screen_with_missing_stages(tmp_path: Path) -> None:
    # Only the kernel bench finished: every other figure says so, and nothing raises.
    (tmp_path / "kernel_bench.json").write_text(json.dumps(KERNEL_BENCH))
    (tmp_path / "gpu_engine_bench.json").write_text('{"decode_st')  # cut off mid-write
    stages = [{"name": "kernel_bench", "status": "ok", "seconds": 50.0, "cap_s": 110.0}]
    text = render_summary(tmp_path, stages)
    assert len(text.splitlines()) <= 30 and max(len(line) for line in text.splitlines()) <= 110
    assert text.count("no data") >= 5
    assert "decode config sweep (cut short)" in text and "block_n=128 num_warps=8 num_stages=3" in text


def test_tests_line_from_junit_or_from_the_per_test_report(tmp_path: Path) -> None:
    (tmp_path / "kernel-tests.jsonl").write_text(
        "\n".join(
            json.dumps(r)
            for r in [
                {"nodeid": "tests/kernels/test_a.py::test_x", "outcome": "passed"},
                {"nodeid": "tests/kernels/test_a.py::test_y", "outcome": "failed"},
            ]
        )
    )
    assert kernel_tests_line(tmp_path) == (
        "kernel tests (cut off; per-test report): 1 failed, 1 passed; failing: test_a.py::test_y"
    )
    (tmp_path / "pytest-kernels.xml").write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.kernels.test_a" name="test_x"/>'
        '<testcase classname="tests.kernels.test_a" name="test_y"><failure message="x"/></testcase>'
        "</testsuite></testsuites>"
    )
    assert kernel_tests_line(tmp_path) == (
        "kernel tests: 2 passed, 1 failed, 0 errors, 1 skipped; failing: test_a::test_y"
    )


# -- the engine bench's arithmetic -----------------------------------------------------------------


def test_bound_streams_every_weight_but_the_embedding_table() -> None:
    from bench.gpu_engine_bench import EMBEDDING, decode_bound_bytes, streamed_weight_bytes

    sizes = {EMBEDDING: 1000, "lm_head.weight": 1000, "layers.0.qkv": 300}
    assert streamed_weight_bytes(sizes, tied=False) == 1300  # a step gathers 64 rows of the table
    assert streamed_weight_bytes({EMBEDDING: 1000, "layers.0.qkv": 300}, tied=True) == 1300  # it is the head
    # Llama-3-8B bf16 at batch 64, context 1024: 32 layers x 2 (K, V) x 8 heads x 128 x 2 bytes per token.
    assert decode_bound_bytes(0, 64, 1024, 32, 8, 128, 2) == 64 * 1024 * 131072
    assert decode_bound_bytes(5, 1, 1, 1, 1, 1, 2) == 5 + 4


def test_kernel_table_splits_a_step_into_its_parts() -> None:
    from bench.gpu_engine_bench import kernel_category, kernel_table

    names = {
        "_paged_attention_kernel": "attention",
        "_merge_splits_kernel": "attention",
        "sm90_xmma_gemm_bf16bf16_bf16f32": "gemm",
        "nvjet_tst_128x64_64x8_1x1_v_bz_coopB_TNT": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop>": "gemm",
        "_fused_add_rms_norm_kernel": "pointwise",
        "_rotary_kernel": "pointwise",
        "Memcpy HtoD (Pinned -> Device)": "copy",
    }
    assert {n: kernel_category(n) for n in names} == names
    table = kernel_table(
        [
            ("_paged_attention_kernel", 3000.0, 320),
            ("nvjet_gemm", 6000.0, 1280),
            ("_rotary_kernel", 1000.0, 320),
        ],
        steps=10,
    )
    assert table["kernel_us_per_step"] == 1000.0
    assert table["us_per_step"] == {"attention": 300.0, "gemm": 600.0, "pointwise": 100.0, "copy": 0.0}
    assert table["share"]["gemm"] == 0.6
    assert [k["name"] for k in table["top_kernels"]] == [
        "nvjet_gemm",
        "_paged_attention_kernel",
        "_rotary_kernel",
    ]
    assert table["top_kernels"][0]["calls_per_step"] == 128


def test_main_clears_an_earlier_runs_results_and_stops_after_a_failed_preflight(
    tmp_path: Path, capsys
) -> None:
    (tmp_path / "kernel_bench.json").write_text(json.dumps(KERNEL_BENCH))  # an earlier run's figures
    # `false` as the interpreter: the preflight fails at once, as on a host without CUDA.
    assert gpu_check.main(["--out", str(tmp_path), "--python", "false"]) == 1
    assert not (tmp_path / "kernel_bench.json").exists()
    statuses = [line.split("\t")[1] for line in (tmp_path / "stages.tsv").read_text().splitlines()[1:]]
    assert statuses == ["failed(rc=1)", "skipped", "skipped", "skipped", "skipped", "skipped"]
    summary = (tmp_path / "summary.txt").read_text()
    assert "decode attention, 8B heads, b64 ctx1k" in summary and "84%" not in summary
    assert summary.strip() in capsys.readouterr().out
