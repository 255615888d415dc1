"""The GPU check's stage runner and its one-screen summary (scripts/gpu_check.sh calls this).

    python -m bench.gpu_check --out DIR [--python PY] [--budget-s 470]

Stages run in order, figures first, each in its own process group under its own cap; the whole run
under a budget (a stage's cap is cut to what is left of it, a stage with too little left is
skipped). At a cap the stage gets SIGINT (Python prints where it was; pytest prints its summary and
writes its junit file), then SIGKILL after a grace period. After every stage, stages.tsv and
stages.json are rewritten, so a run cut short by its host still says what ran; the stage's output
goes to the log and to DIR/<stage>.log. At the end the summary (each figure next to its target)
is printed and written to DIR/summary.txt. Exit status 0 only if every stage passed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO

from bench.gpu_check_summary import render_summary

ROOT = Path(__file__).resolve().parents[1]
# A stage that is cut off gets this long between SIGINT and SIGKILL to print where it was.
GRACE_S = 10.0
# A stage is not started with less than this left of the budget: it could only time out.
MIN_STAGE_S = 15.0

PREFLIGHT = """
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check: torch sees no CUDA device")
try:
    import numpy
    import pytest
    import triton
except ImportError as exc:
    sys.exit(f"gpu_check: missing {exc.name}; it needs torch, triton, numpy and pytest")
import engine.llm_engine  # the engine stages need nothing beyond the above

torch.zeros(1, device="cuda").add_(1).item()  # the CUDA context exists before the figures' stages
print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}, "
      f"pytest {pytest.__version__}, {torch.cuda.get_device_name()}")
"""


# What the stages write into the results folder (besides the logs).
STAGE_OUTPUTS = (
    "kernel_bench.json",
    "gpu_engine_bench.json",
    "graph_check.json",
    "tp_check.json",
    "pytest-kernels.xml",
    "kernel-tests.jsonl",
    "stages.tsv",
    "stages.json",
    "summary.txt",
)


@dataclass(frozen=True)
class Stage:
    name: str
    argv: list[str]
    cap_s: float  # the stage's own limit before SIGINT
    required: bool = False  # a failure stops the run (nothing after it could work)


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # ok | failed(rc=N) | timeout | skipped
    seconds: float
    cap_s: float  # the cap it ran under (cut to the budget left)


def gpu_stages(python: str, out: Path) -> list[Stage]:
    """The H200 run: kernel bench, engine bench, graph check, then the kernel tests."""
    pytest_args = [
        "-m",
        "pytest",
        "-p",
        "no:cacheprovider",
        "--confcutdir=tests/kernels",  # only the kernel tests' conftest: no service fixtures here
        "-rfE",  # failures and errors listed at the end, names and messages
        "-v",  # one line per test as it ends: a cut-off stage still shows how far it got
        "--tb=short",
        "-o",
        "faulthandler_timeout=45",  # a test stuck this long dumps every thread's stack (names the test)
        "--maxfail=10",
        f"--junitxml={out / 'pytest-kernels.xml'}",
        # The runner's own tests check this harness, not the GPU: seconds better spent on kernels.
        "--ignore=tests/kernels/test_gpu_check.py",
        "tests/kernels",
    ]
    return [
        Stage("preflight", [python, "-c", PREFLIGHT], 60, required=True),
        Stage(
            "kernel_bench",
            [python, "-m", "bench.kernel_bench", "--out", str(out), "--sweep", "--sweep-budget-s", "60"],
            110,
        ),
        Stage("engine_bench", [python, "-m", "bench.gpu_engine_bench", "--out", str(out)], 180),
        Stage("graph_check", [python, "-m", "bench.gpu_graph_check", "--out", str(out)], 90),
        # Two NCCL ranks against one where the host lends two GPUs; with one it says so and passes.
        Stage("tp_check", [python, "-m", "bench.gpu_tp_check", "--out", str(out)], 90),
        Stage("kernels", [python, *pytest_args], 120),
    ]


def _pump(src: IO[bytes], sinks: Sequence[IO[bytes]]) -> None:
    for line in iter(src.readline, b""):
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_stage(
    stage: Stage, cap_s: float, log_path: Path, env: dict[str, str], grace_s: float = GRACE_S
) -> str:
    """Runs one stage under cap_s; returns its status. Output goes to stdout and to log_path."""
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            stage.argv,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: a cap ends every child it started
        )
        assert proc.stdout is not None
        pump = threading.Thread(target=_pump, args=(proc.stdout, [sys.stdout.buffer, log]), daemon=True)
        pump.start()
        try:
            rc = proc.wait(timeout=cap_s)
        except subprocess.TimeoutExpired:
            print(
                f"== {stage.name}: cap of {cap_s:.0f}s reached; SIGINT, SIGKILL after {grace_s:.0f}s",
                flush=True,
            )
            _signal_group(proc, signal.SIGINT)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait()
            pump.join(timeout=5)
            return "timeout"
        pump.join(timeout=5)
    return "ok" if rc == 0 else f"failed(rc={rc})"


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):  # already gone
        os.killpg(proc.pid, sig)


def write_stages(out: Path, results: list[StageResult]) -> None:
    lines = ["stage\tstatus\tseconds\tcap_s"]
    lines += [f"{r.name}\t{r.status}\t{r.seconds:.0f}\t{r.cap_s:.0f}" for r in results]
    (out / "stages.tsv").write_text("\n".join(lines) + "\n")
    (out / "stages.json").write_text(json.dumps([asdict(r) for r in results], indent=2))


def run_stages(
    stages: list[Stage],
    out: Path,
    budget_s: float,
    env: dict[str, str],
    grace_s: float = GRACE_S,
    min_stage_s: float = MIN_STAGE_S,
) -> list[StageResult]:
    """Every stage in order within budget_s (each stage's grace included); results written as each ends."""
    deadline = time.monotonic() + budget_s
    results: list[StageResult] = []
    stop = False
    for stage in stages:
        left = deadline - time.monotonic() - grace_s
        cap = min(stage.cap_s, left)
        if stop or cap < min(min_stage_s, stage.cap_s):
            results.append(StageResult(stage.name, "skipped", 0.0, max(cap, 0.0)))
            print(
                f"== {stage.name}: skipped ({'an earlier stage failed' if stop else 'budget spent'})",
                flush=True,
            )
            write_stages(out, results)
            continue
        print(f"== {stage.name} (cap {cap:.0f}s)", flush=True)
        t0 = time.monotonic()
        status = run_stage(stage, cap, out / f"{stage.name}.log", env, grace_s)
        result = StageResult(stage.name, status, time.monotonic() - t0, cap)
        results.append(result)
        write_stages(out, results)
        print(f"== {stage.name}: {status} in {result.seconds:.0f}s", flush=True)
        if stage.required and status != "ok":
            stop = True
    return results


def stage_env(out: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # compiled kernels: the tests use the interpreter only if set
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"  # lines reach the log as they are printed
    env["PYTHONFAULTHANDLER"] = "1"  # a crash in C code still prints the Python stack
    # Compiled kernels kept in the tree (ignored by git): a rerun on the same machine compiles nothing.
    env.setdefault("TRITON_CACHE_DIR", str(ROOT / ".triton-cache"))
    # The C++ CPU kernels are not what this checks: their tests skip instead of compiling them (~30 s).
    env["INFLIGHT_DISABLE_CPU_KERNELS"] = "1"
    env["GPU_CHECK_TESTS_REPORT"] = str(out / "kernel-tests.jsonl")
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", default="bench-results/gpu-check")
    parser.add_argument("--python", default=sys.executable, help="the interpreter the stages run on")
    parser.add_argument("--budget-s", type=float, default=450.0, help="the whole run, every stage included")
    args = parser.parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    # An earlier run's results would pass for this run's in the summary.
    for name in STAGE_OUTPUTS:
        (out / name).unlink(missing_ok=True)
    print(
        f"gpu_check: {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, python {args.python}, "
        f"budget {args.budget_s:.0f}s, results in {out}/",
        flush=True,
    )
    results = run_stages(gpu_stages(args.python, out), out, args.budget_s, stage_env(out))
    summary = render_summary(out, [asdict(r) for r in results])
    (out / "summary.txt").write_text(summary + "\n")
    print(summary, flush=True)
    return 0 if all(r.status == "ok" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
