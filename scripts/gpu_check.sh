#!/usr/bin/env bash
# GPU check, one command from the repository root on a fresh CUDA machine (H200 in mind):
#
#   scripts/gpu_check.sh            (PYTHON=/path/to/python to choose the interpreter)
#
# Stages, each under its own timeout so one hung or failing stage cannot eat the run (about 6 min
# in all); a failed stage is recorded and the next one still runs:
#   preflight    torch sees CUDA; triton, numpy, pytest import; the engine imports       20 s
#   kernels      tests/kernels compiled on the GPU, gpu-marked tests included (KV cache
#                past 2^31 elements, split-K at the captured max_model_len, the fused
#                sampler vs the torch sampler at a 128k vocabulary)                      140 s
#   kernel_bench paged decode attention vs copy bandwidth                                 40 s
#   graph_check  CUDA-graph replay vs the same padded step run eagerly (bitwise): decode
#                graphs, and piecewise graphs around eager attention for mixed steps;
#                the unpadded eager path's greedy tokens                                  40 s
#   engine_bench Llama-3-8B-shaped bf16, dummy weights: decode step vs the bandwidth
#                bound, batch-1 graphs vs eager, a greedy workload and one at
#                temperature 0.8 / top-p 0.95 (every engine loop has a step cap)        120 s
#
# Nothing is downloaded: the repository runs from PYTHONPATH (no pip install), on the machine's own
# torch + triton (+ numpy, pytest). Results and the log go to $GPU_CHECK_OUT (default
# bench-results/gpu-check): gpu_check.log, stages.tsv (stage, status, seconds), kernel_bench.json,
# graph_check.json, gpu_engine_bench.json, pytest-kernels.xml. Exit status 0 only if every stage passed.
set -uo pipefail
cd "$(dirname "$0")/.."

OUT="${GPU_CHECK_OUT:-bench-results/gpu-check}"
mkdir -p "$OUT"
LOG="$OUT/gpu_check.log"
: >"$LOG"
exec > >(tee -a "$LOG") 2>&1
printf 'stage\tstatus\tseconds\n' >"$OUT/stages.tsv"

# A .venv built on a CPU-only host holds a CPU torch: use it only if it can see the GPU.
if [[ -n "${PYTHON:-}" ]]; then
  PY="$PYTHON"
elif [[ -x .venv/bin/python ]] && timeout 30 .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The tests run the interpreter only when this is set or CUDA is missing; here we want compiled kernels.
unset TRITON_INTERPRET
# The C++ CPU kernels are not what this checks: their tests skip instead of compiling them (~30 s).
export INFLIGHT_DISABLE_CPU_KERNELS=1
echo "gpu_check: $(date -u +%FT%TZ), python $PY, results in $OUT/"

FAILED=()
# stage NAME SECONDS CMD...: run CMD under a hard timeout (SIGTERM, then SIGKILL 5 s later).
stage() {
  local name="$1" limit="$2"
  shift 2
  echo "== $name (limit ${limit}s)"
  local t0=$SECONDS status
  timeout -k 5 "$limit" "$@"
  local rc=$?
  if [[ $rc -eq 0 ]]; then
    status=ok
  elif [[ $rc -eq 124 || $rc -eq 137 ]]; then
    status=timeout
  else
    status="failed(rc=$rc)"
  fi
  [[ $status == ok ]] || FAILED+=("$name")
  printf '%s\t%s\t%s\n' "$name" "$status" "$((SECONDS - t0))" >>"$OUT/stages.tsv"
  echo "== $name: $status in $((SECONDS - t0))s"
  [[ $status == ok ]]
}

# `timeout` runs programs, not shell functions: the preflight is a Python program in a string.
PREFLIGHT='
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

print(f"torch {torch.__version__}, triton {triton.__version__}, numpy {numpy.__version__}, "
      f"pytest {pytest.__version__}, {torch.cuda.get_device_name()}")
'

if ! stage preflight 20 "$PY" -c "$PREFLIGHT"; then
  echo "gpu_check: preflight failed; nothing else can run"
  exit 1
fi

# --confcutdir: only tests/kernels' own conftest loads, so service test fixtures need not import here.
# --maxfail: a few failures are enough to report, and stop a cascade of slow compiles.
stage kernels 140 "$PY" -m pytest -q -p no:cacheprovider --confcutdir=tests/kernels --maxfail=5 \
  --junitxml="$OUT/pytest-kernels.xml" tests/kernels
stage kernel_bench 40 "$PY" -m bench.kernel_bench --out "$OUT"
stage graph_check 40 "$PY" -m bench.gpu_graph_check --out "$OUT"
stage engine_bench 120 "$PY" -m bench.gpu_engine_bench --out "$OUT"

echo "== stages"
column -t -s $'\t' "$OUT/stages.tsv" 2>/dev/null || cat "$OUT/stages.tsv"
if ((${#FAILED[@]})); then
  echo "gpu_check: FAILED: ${FAILED[*]}; log in $LOG"
  exit 1
fi
echo "gpu_check: all passed; results in $OUT/"
